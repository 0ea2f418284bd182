"""Rendezvous hashing, route keys, the router's view of cores, and the routing/TLS config."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.config import GatewayConfig
from gateway.routing import Router, RouterSettings, rendezvous_order, resolve, route_key
from shared.config import ConfigError, build
from tests.conftest import free_port

CORES = [f"visor-core-{i}" for i in range(4)]


def _keys(n: int) -> list[bytes]:
    return [route_key("tenant", f"{i:064x}", "rid") for i in range(n)]


def _owner(key: bytes, cores: list[str]) -> str:
    return rendezvous_order(key, cores)[0]


def test_route_key_is_tenant_and_first_hash_or_request_id() -> None:
    assert route_key("a", "h", "r1") == route_key("a", "h", "r2")  # request id ignored with media
    assert route_key("a", "h", "r") != route_key("b", "h", "r")  # tenants never share a route
    assert route_key("a", None, "r1") != route_key("a", None, "r2")  # no media: spread by id


def test_order_is_stable_and_spreads_evenly() -> None:
    keys = _keys(4000)
    owners = Counter(_owner(k, CORES) for k in keys)
    assert set(owners) == set(CORES)
    assert all(900 <= n <= 1100 for n in owners.values()), owners
    assert [_owner(k, list(reversed(CORES))) for k in keys] == [_owner(k, CORES) for k in keys]


def test_removing_a_core_moves_only_its_keys_to_their_second_choice() -> None:
    keys = _keys(2000)
    gone = CORES[1]
    rest = [c for c in CORES if c != gone]
    for k in keys:
        before = rendezvous_order(k, CORES)
        after = _owner(k, rest)
        if before[0] == gone:
            assert after == before[1]
        else:
            assert after == before[0]  # everyone else keeps their cache


def test_adding_a_core_takes_about_its_share() -> None:
    keys = _keys(3000)
    grown = [*CORES, "visor-core-4"]
    moved = [k for k in keys if _owner(k, grown) != _owner(k, CORES)]
    assert all(_owner(k, grown) == "visor-core-4" for k in moved)  # only to the newcomer
    assert 0.15 < len(moved) / len(keys) < 0.25  # ~1/5


def test_resolve_lists_every_address() -> None:
    addresses = asyncio.run(resolve("localhost:1234"))
    assert addresses and set(addresses) <= {"127.0.0.1:1234", "[::1]:1234"}


def _settings(*targets: str) -> RouterSettings:
    return RouterSettings(tuple(targets), 0.2, 0.2, 60.0, None, "")


def test_router_with_no_live_core_still_offers_every_core_in_order() -> None:
    """No core answers: none is marked healthy, yet each is offered (marks may be stale)."""
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        router = Router(_settings(*dead, f"dns:///localhost:{free_port()}"))
        await router.start()
        try:
            key = route_key("t", "h", "r")
            offered = [c.address for c in router.candidates(key)]
            return offered, router.healthy(), rendezvous_order(key, offered)
        finally:
            await router.close()

    offered, healthy, ranked = asyncio.run(scenario())
    assert healthy == []
    assert set(dead) <= set(offered) and len(offered) >= 4  # the DNS entry resolved too
    assert offered == ranked


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"VISOR_GATEWAY_CORES": "10.0.0.7:50052"}, "plaintext is allowed only on loopback"),
        ({"VISOR_GATEWAY_CORES": "dns:///visor-core:50052"}, "plaintext is allowed only"),
        ({"VISOR_GATEWAY_CORES": "dns:///visor-core"}, "host:port"),
        ({"VISOR_GATEWAY_CORE_TLS_CA": "/ca.crt"}, "all three TLS files"),
        ({"VISOR_GATEWAY_HEALTH_INTERVAL_S": "0"}, "health_interval_s"),
    ],
)
def test_bad_routing_config_is_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(GatewayConfig, "gateway", {}, env)


def test_tls_allows_cores_off_loopback() -> None:
    tls = {
        "VISOR_GATEWAY_CORE_TLS_CA": "/tls/ca.crt",
        "VISOR_GATEWAY_CORE_TLS_CERT": "/tls/tls.crt",
        "VISOR_GATEWAY_CORE_TLS_KEY": "/tls/tls.key",
    }
    env = {**tls, "VISOR_GATEWAY_CORES": "dns:///visor-core.visor.svc:50052,10.0.0.8:50052"}
    cfg = build(GatewayConfig, "gateway", {}, env)
    assert cfg.cores == ("dns:///visor-core.visor.svc:50052", "10.0.0.8:50052")
    assert cfg.core_tls().enabled


def test_dns_entries_follow_the_name_and_survive_a_dns_outage() -> None:
    """The resolver stands in for a DNS server whose answer changes (none can run here)."""
    ports = [free_port() for _ in range(3)]
    a, b, c = (f"127.0.0.1:{p}" for p in ports)
    answers: list[list[str] | None] = [[a, b], [b, c], None]
    asked: list[str] = []

    async def resolver(name_port: str) -> list[str]:
        asked.append(name_port)
        answer = answers.pop(0)
        if answer is None:
            raise OSError("name resolution failed")
        return answer

    async def scenario() -> list[list[str]]:
        static = f"127.0.0.1:{free_port()}"
        router = Router(_settings(static, "dns:///visor-core:50052"), resolver=resolver)
        seen = []
        try:
            await router.start()
            seen.append(router.addresses())
            await router._refresh()  # what the background loop does every dns_refresh_s
            seen.append(router.addresses())
            await router._refresh()  # DNS down: keep what we had
            seen.append(router.addresses())
        finally:
            await router.close()
        return [[x for x in addresses if x != static] for addresses in seen]

    assert asyncio.run(scenario()) == [sorted([a, b]), sorted([b, c]), sorted([b, c])]
    assert asked == ["visor-core:50052"] * 3

"""Which core serves a request: rendezvous (highest-random-weight) hashing over healthy cores.

The route key is (tenant, first item's content hash), so repeats of an image land on the core
whose LMDB holds its features; a request without media hashes on (tenant, request id). Each core
is ranked by a hash of (key, core id); the request goes to the highest-ranked healthy core and,
when that one cannot be reached, to the next. When a core leaves, only its keys move (each to
its own second choice); when it comes back, they move back. The core id (its `core_id`, stable
across restarts, e.g. a StatefulSet pod name) is the identity hashed, not its IP address.

Cores come from static `host:port` entries and from `dns:///name:port` entries, resolved again
every `dns_refresh_s`. Each core is checked with grpc.health.v1 every `health_interval_s`; a call
that fails with UNAVAILABLE marks its core down at once, before the next check.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from gateway import metrics
from gateway.config import DNS_SCHEME, GatewayConfig
from gateway.core_client import CoreClient
from shared import logs, tls
from shared.net import split_host_port

log = logs.get("gateway.routing")


def route_key(tenant: str, content_hash: str | None, request_id: str) -> bytes:
    """The bytes a request is routed on."""
    return b"\0".join((tenant.encode(), (content_hash or request_id).encode()))


def _score(key: bytes, identity: str) -> int:
    digest = hashlib.blake2b(key + b"\0" + identity.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: bytes, identities: Sequence[str]) -> list[str]:
    """`identities` ranked best first for `key` (ties, e.g. duplicate ids, broken by name)."""
    return sorted(identities, key=lambda i: (-_score(key, i), i))


@dataclass(frozen=True, slots=True)
class RouterSettings:
    targets: tuple[str, ...]  # `host:port` or `dns:///name:port` entries
    health_interval_s: float  # health check period
    health_timeout_s: float  # one check's deadline
    dns_refresh_s: float  # re-resolution period of dns:/// entries
    credentials: grpc.ChannelCredentials | None  # mTLS to cores; None = plaintext (loopback)
    server_name: str  # certificate name override; "" = the host dialled (or the DNS name)

    @staticmethod
    def from_config(cfg: GatewayConfig) -> RouterSettings:
        creds = tls.channel_credentials(cfg.core_tls()) if cfg.core_tls().enabled else None
        return RouterSettings(
            cfg.cores,
            cfg.health_interval_s,
            cfg.health_timeout_s,
            cfg.dns_refresh_s,
            creds,
            cfg.core_tls_server_name,
        )


class _Endpoint:
    """One core address, its client and whether it may take requests."""

    __slots__ = ("checking", "client", "healthy", "target")

    def __init__(self, client: CoreClient, target: str) -> None:
        self.client = client
        self.target = target  # the config entry it came from
        self.healthy = False  # up only after a SERVING check and a Describe
        self.checking: asyncio.Task[None] | None = None  # a check out of turn, while it runs

    @property
    def identity(self) -> str:
        return self.client.core_id or self.client.address


async def resolve(name_port: str) -> list[str]:
    """Every address `name:port` resolves to, as `host:port` strings (IPv6 bracketed)."""
    host, port = split_host_port(name_port)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = set()
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = str(sockaddr[0])
        out.add(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return sorted(out)


Connect = Callable[[str, grpc.ChannelCredentials | None, str], CoreClient]
Resolve = Callable[[str], Awaitable[list[str]]]


class Router:
    """Keeps the set of cores, their health, and ranks them per request."""

    def __init__(
        self, settings: RouterSettings, connect: Connect = CoreClient, resolver: Resolve = resolve
    ) -> None:
        self.settings = settings
        self._connect = connect
        self._resolve = resolver
        self._endpoints: dict[str, _Endpoint] = {}
        self._retired: list[CoreClient] = []  # removed by DNS; closed one refresh later
        self._task: asyncio.Task[None] | None = None
        self._resolved_at = 0.0

    async def start(self) -> None:
        """Resolves every entry, checks every core once, then keeps checking in the background."""
        await self._refresh()
        await self._check_all()
        self._task = asyncio.create_task(self._loop(), name="core-health")

    def candidates(self, key: bytes) -> list[CoreClient]:
        """Healthy cores best first for `key`; when none is healthy, every core (the marks may
        be stale and trying costs one fast failure each)."""
        pool = [e for e in self._endpoints.values() if e.healthy] or list(self._endpoints.values())
        by_identity: dict[str, list[_Endpoint]] = {}
        for e in pool:
            by_identity.setdefault(e.identity, []).append(e)
        ranked = rendezvous_order(key, list(by_identity))
        return [e.client for i in ranked for e in sorted(by_identity[i], key=lambda e: e.target)]

    def mark_down(self, client: CoreClient) -> None:
        """A call to `client` failed with UNAVAILABLE: stop routing to it until a check passes."""
        endpoint = self._endpoints.get(client.address)
        if endpoint is not None and endpoint.healthy:
            endpoint.healthy = False
            metrics.CORES_HEALTHY.set(len(self.healthy()))
            log.warning("core_down", address=client.address, reason="UNAVAILABLE")

    def suspect(self, client: CoreClient) -> None:
        """A hedge outran `client`'s handshake: it may have just hung. Checks it now rather
        than at the next round (a hung core is marked down within `health_timeout_s`, so the
        requests it owns stop paying a hedge delay each); a core that was only slow once passes
        the check in milliseconds and keeps its requests."""
        endpoint = self._endpoints.get(client.address)
        if endpoint is None or not endpoint.healthy or endpoint.checking is not None:
            return
        endpoint.checking = asyncio.create_task(self._check_now(endpoint))

    def suspected(self, client: CoreClient) -> bool:
        """Whether `client` is being checked out of turn: a request it owns asks the next core
        at once too, rather than after the hedge delay."""
        endpoint = self._endpoints.get(client.address)
        return endpoint is not None and endpoint.checking is not None

    def healthy(self) -> list[str]:
        return sorted(a for a, e in self._endpoints.items() if e.healthy)

    def addresses(self) -> list[str]:
        return sorted(self._endpoints)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        checks = [e.checking for e in self._endpoints.values() if e.checking is not None]
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
        for client in [*(e.client for e in self._endpoints.values()), *self._retired]:
            await client.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            stale = time.monotonic() - self._resolved_at >= self.settings.dns_refresh_s
            if stale or not self._endpoints:  # nothing to route to: look again every interval
                await self._refresh()
            await self._check_all()

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in list(self._endpoints.values())))
        metrics.CORES_HEALTHY.set(len(self.healthy()))

    async def _check_now(self, endpoint: _Endpoint) -> None:
        try:
            await self._check(endpoint)
            metrics.CORES_HEALTHY.set(len(self.healthy()))
        finally:
            endpoint.checking = None

    async def _check(self, endpoint: _Endpoint) -> None:
        timeout = self.settings.health_timeout_s
        up = await endpoint.client.serving(timeout)
        if up:
            try:  # the id we hash on, and the geometry requests need, come from Describe
                await endpoint.client.geometry(timeout)
            except Exception:  # any failure here means "not ready yet"
                endpoint.client.forget()
                up = False
        if up != endpoint.healthy:
            endpoint.healthy = up
            log.info(
                "core_up" if up else "core_down",
                address=endpoint.client.address,
                core_id=endpoint.client.core_id,
                num_cores=len(self.healthy()),
            )
        if not up:
            endpoint.client.forget()  # a core that comes back may run another model

    async def _refresh(self) -> None:
        """(Re)builds the endpoint set: static entries once, DNS entries on every refresh."""
        self._resolved_at = time.monotonic()
        for client in self._retired:
            await client.close()
        self._retired = []
        wanted: dict[str, tuple[str, str]] = {}  # address -> (target, certificate name)
        for target in self.settings.targets:
            if not target.startswith(DNS_SCHEME):
                wanted[target] = (target, self.settings.server_name)
                continue
            name_port = target.removeprefix(DNS_SCHEME)
            try:
                addresses = await self._resolve(name_port)
            except OSError:
                # Keep what we had: a DNS outage must not empty the routing table.
                log.warning("core_dns_failed", address=name_port)
                addresses = [a for a, e in self._endpoints.items() if e.target == target]
            name = self.settings.server_name or split_host_port(name_port)[0]
            for address in addresses:
                wanted.setdefault(address, (target, name))
        for address in set(self._endpoints) - set(wanted):
            self._retired.append(self._endpoints.pop(address).client)
            log.info("core_removed", address=address)
        for address, (target, name) in wanted.items():
            if address not in self._endpoints:
                client = self._connect(address, self.settings.credentials, name)
                self._endpoints[address] = _Endpoint(client, target)
                log.info("core_added", address=address)

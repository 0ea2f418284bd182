"""Per-tenant keys, limits and policy: parsing, tighten-only checks, the tenant table, quotas
across reloads, and the core's per-tenant cache TTL (real LMDB in a temp dir)."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from core.cache import FeatureCache
from gateway.auth import authenticate
from gateway.config import GatewayConfig, LimitsConfig
from gateway.limits import check_profile
from gateway.quota import Quotas
from gateway.tenants import (
    ENTRY_KEYS,
    ConfigFile,
    TenantConfigError,
    TenantPolicy,
    reread,
    tenants_from,
)
from shared.config import ConfigError
from shared.errors import Reason, VisorError
from shared.hashing import key_sha256
from tests.core.test_cache import KEY, entry, same

ROOT = Path(__file__).resolve().parents[2]


def _row(tenant: str = "acme", key: str = "k1", **tables: dict[str, Any]) -> dict[str, Any]:
    return {"id": tenant, "key_sha256": key_sha256(key), **tables}


def _table(*rows: dict[str, Any], cfg: GatewayConfig | None = None) -> Any:
    return tenants_from({"tenants": list(rows)}, cfg or GatewayConfig(), LimitsConfig())


def _bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def test_rotation_two_keys_one_tenant_and_no_key_shared() -> None:
    both = {"id": "acme", "keys_sha256": [key_sha256("old"), key_sha256("new")]}
    table = _table(both, _row("other", "k2"))
    assert authenticate(table, _bearer("old")).id == authenticate(table, _bearer("new")).id
    assert authenticate(table, _bearer("k2")).id == "other"
    # key_sha256 and keys_sha256 together are one list of keys
    mixed = {**_row("acme", "old"), "keys_sha256": [key_sha256("new")]}
    assert _table(mixed).tenants[0].keys_sha256 == (key_sha256("old"), key_sha256("new"))
    with pytest.raises(ConfigError, match=r"#1 and #2 share a key"):
        _table(both, _row("other", "new"))
    with pytest.raises(TenantConfigError, match="the id of entry #1 again"):
        _table(_row("acme", "a"), _row("acme", "b"))
    for bad in ({"id": "x"}, {"id": "x", "keys_sha256": ["short"]}, {**_row(), "role": "x"}):
        with pytest.raises(ConfigError):
            _table(bad)


def test_limits_tighten_for_one_tenant_only() -> None:
    table = _table(_row("b", "kb", limits={"max_items": 1, "max_new_tokens": 64}), _row())
    tight, other = table.tenants
    assert (tight.limits.max_items, other.limits.max_items) == (1, LimitsConfig().max_items)
    # an inherited default above the tenant's own cap follows it down
    assert tight.limits.default_new_tokens == 64
    assert other.limits == LimitsConfig() and other.policy == TenantPolicy()


@pytest.mark.parametrize(
    ("limits", "key"),
    [({"max_items": 9}, "max_items"), ({"max_video_duration_s": 61.0}, "max_video_duration_s")],
)
def test_loosening_a_limit_names_tenant_and_key(limits: dict[str, Any], key: str) -> None:
    with pytest.raises(TenantConfigError) as info:
        _table(_row("acme", limits=limits))
    assert f"[tenants.limits] {key}" in str(info.value) and '"acme"' in str(info.value)
    assert "loosens" in info.value.loggable() and "acme" not in info.value.loggable()


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        ({"max_itemz": 1}, "unknown key"),
        ({"max_items": "1"}, "type int"),
        ({"max_items": 0}, "> 0"),
    ],
)
def test_bad_tenant_limits(limits: dict[str, Any], match: str) -> None:
    with pytest.raises(TenantConfigError, match=match):
        _table(_row(limits=limits))


def test_quotas_tighten_only_where_the_gateway_sets_one() -> None:
    free = _table(_row(policy={"max_concurrent": 9, "rate_per_s": 50.0, "burst": 100}))
    assert free.tenants[0].policy.max_concurrent == 9
    capped = GatewayConfig(max_concurrent_per_tenant=4, rate_per_tenant=2.0, burst_per_tenant=0)
    ok = _table(_row(policy={"max_concurrent": 2, "rate_per_s": 1.0, "burst": 2}), cfg=capped)
    assert (ok.tenants[0].policy.max_concurrent, ok.tenants[0].policy.burst) == (2, 2)
    inherited = _table(_row(), cfg=capped).tenants[0].policy
    assert (inherited.max_concurrent, inherited.rate_per_s) == (4, 2.0)
    for policy in ({"max_concurrent": 5}, {"max_concurrent": 0}, {"rate_per_s": 3.0}, {"burst": 3}):
        with pytest.raises(TenantConfigError, match=f"{next(iter(policy))} = .* loosens"):
            _table(_row(policy=policy), cfg=capped)


def test_profiles_and_default_profile() -> None:
    policy = {"profiles": ["low-latency", "balanced"], "default_profile": "balanced"}
    p = _table(_row(policy=policy)).tenants[0].policy
    assert check_profile(p, "") == "balanced" and check_profile(p, "low-latency") == "low-latency"
    with pytest.raises(VisorError) as info:
        check_profile(p, "none")
    assert info.value.reason is Reason.INVALID_REQUEST and "policy" in info.value.message
    for bad, match in (
        ({"profiles": ["fastest"]}, "profiles must name"),
        ({"profiles": []}, "profiles must name"),
        ({"profiles": ["balanced"]}, "default_profile"),  # the gateway's "none" is not allowed
        ({"cache_ttl_s": -1.0}, ">= 0"),
        ({"no_cache": "yes"}, "type bool"),
    ):
        with pytest.raises(TenantConfigError, match=match):
            _table(_row(policy=bad))


def test_reread_reports_sections_that_need_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "visor.toml"
    path.write_text(
        f'[limits]\nmax_items = 4\n\n[[tenants]]\nid = "a"\nkey_sha256 = "{"a" * 64}"\n'
    )
    started = tomllib.loads(path.read_text())
    cfg, lim = GatewayConfig(), LimitsConfig(max_items=4)
    path.write_text(started_text := path.read_text().replace('"a"', '"b"', 1))
    table, changed = reread(ConfigFile(path, started), cfg, lim)
    assert table.tenants[0].id == "b" and changed == []
    path.write_text(started_text.replace("max_items = 4", "max_items = 3"))
    assert reread(ConfigFile(path, started), cfg, lim)[1] == ["limits"]
    path.write_text("[[tenants]\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        reread(ConfigFile(path, started), cfg, lim)


def test_quota_counters_outlive_new_caps() -> None:
    """A reload changes the caps passed to admit; the running counters stay the tenant's."""
    quotas = Quotas()
    with quotas.admit("acme", 2, 0.0, 0):
        with pytest.raises(VisorError) as info, quotas.admit("acme", 1, 0.0, 0):
            pass  # the tightened cap counts the request admitted under the old one
        assert info.value.reason is Reason.QUOTA_EXCEEDED
        with quotas.admit("acme", 2, 0.0, 0), quotas.admit("other", 1, 0.0, 0):
            assert quotas.num_in_flight == 3
    assert quotas.num_in_flight == 0


def test_tenant_cache_ttl_is_capped_by_the_core_and_applies_at_lookup(tmp_path: Path) -> None:
    now = [1000.0]
    cache = FeatureCache(tmp_path, 64 << 20, ttl_s=60, clock=lambda: now[0])
    e = entry()
    assert cache.put(KEY, e, ttl_s=10)
    now[0] += 9
    assert same(cache.get(KEY, ttl_s=10), e)
    assert cache.get(KEY, ttl_s=5) is None  # a shortened TTL misses older entries at once
    now[0] += 2
    assert cache.get(KEY) is None  # written to expire after 10 s, whatever the reader asks
    long = dataclasses.replace(KEY, frame=1)
    assert cache.put(long, e, ttl_s=3600)
    now[0] += 61
    assert cache.get(long, ttl_s=3600) is None  # never past the core's own ttl_s


def test_example_config_shows_every_tenant_key() -> None:
    """The commented [[tenants]] example in deploy/visor.example.toml parses once uncommented,
    and names every entry key and every [tenants.policy] key."""
    text = (ROOT / "deploy" / "visor.example.toml").read_text()
    block = text[text.index("# [[tenants]]") :].splitlines()
    toml = "\n".join(line.removeprefix("# ") for line in block)
    data = tomllib.loads(toml.replace("<64 hex digits>", "a" * 64))
    row = data["tenants"][0]
    assert set(row) == set(ENTRY_KEYS)
    assert set(row["policy"]) == {f.name for f in dataclasses.fields(TenantPolicy)}
    assert tenants_from(data, GatewayConfig(), LimitsConfig()).tenants[0].policy.no_cache is False


def test_reloader_logs_one_line_and_keeps_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import structlog

    from gateway.server import reloader
    from gateway.tenants import LiveTenants
    from shared import logs

    structlog.reset_defaults()
    logs.configure("test")
    cfg, lim = GatewayConfig(), LimitsConfig()
    live = LiveTenants(tenants_from({}, cfg, lim))
    first = live.table
    reloader(ConfigFile(None, {}), cfg, lim, live)()
    path = tmp_path / "visor.toml"
    path.write_text(f'[[tenants]]\nid = "secret-team"\nkey_sha256 = "{"a" * 64}"\nrole = 1\n')
    reloader(ConfigFile(path, {}), cfg, lim, live)()
    assert live.table is first
    path.write_text(
        '[limits]\nmax_items = 2\n\n[[tenants]]\nid = "t"\nkey_sha256 = "' + "a" * 64 + '"\n'
    )
    reloader(ConfigFile(path, {}), cfg, lim, live)()
    assert live.table is not first and live.table.tenants[0].id == "t"
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    events = [line["event"] for line in lines]
    assert events == [
        "tenants_reload_skipped",
        "tenants_reload_failed",
        "tenants_reloaded",
        "restart_needed",
    ]
    assert "unknown key" in lines[1]["config_error"] and "tenant_hash" in lines[1]
    assert "secret-team" not in json.dumps(lines)
    assert lines[3]["sections"] == ["limits"]
    structlog.reset_defaults()

"""Tenants: API keys (stored hashed; several per tenant while a key is rotated), each tenant's
effective limits and policy, and the immutable table the servicer reads once per request.

A `[[tenants]]` entry may tighten any `[limits]` key (`[tenants.limits]`) and the `[gateway]`
per-tenant quotas, and choose its profiles and cache policy (`[tenants.policy]`); loosening is a
configuration error naming the key. A reload (SIGHUP) builds a whole new table from the file and
swaps it in one assignment, so a request keeps the tenant it authenticated as to its end.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gateway.config import GatewayConfig, LimitsConfig
from shared.config import ConfigError, build, read_file
from shared.hashing import key_sha256
from shared.net import is_loopback
from shared.wire import PROFILES

DEV_KEY = "visor-dev-key"
DEV_TENANT = "dev"
ENTRY_KEYS = ("id", "key_sha256", "keys_sha256", "limits", "policy")
# Sections of the file the gateway reads at start only: a reload that finds them changed says a
# restart is needed (the core's sections are the core's business).
RESTART_SECTIONS = ("gateway", "limits", "log", "deployment")


class TenantConfigError(ConfigError):
    """A refusal about one `[[tenants]]` entry. `detail` names keys and values, never the tenant
    id, so that a log line can carry the id hashed while the message at start names it."""

    def __init__(self, entry: int, tenant: str, detail: str) -> None:
        super().__init__(f'[[tenants]] #{entry} (id "{tenant}"): {detail}')
        self.entry, self.tenant, self.detail = entry, tenant, detail

    def loggable(self) -> str:
        return f"[[tenants]] #{self.entry}: {self.detail}"


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's effective policy: its `[tenants.policy]` values where set, else the
    gateway's."""

    max_concurrent: int = 0  # requests in flight; 0 = no cap
    rate_per_s: float = 0.0  # requests started per second (token bucket); 0 = no cap
    burst: int = 0  # token-bucket size; 0 = max(1, rate_per_s)
    profiles: tuple[str, ...] = PROFILES  # compression profiles a request may name
    default_profile: str = "none"  # profile of a request that names none
    cache_ttl_s: float = 0.0  # feature-cache TTL; the core applies min(this, its ttl_s); 0 = its
    no_cache: bool = False  # the core neither looks up nor stores this tenant's features

    def validate(self) -> None:
        if min(self.max_concurrent, self.rate_per_s, self.burst, self.cache_ttl_s) < 0:
            raise ConfigError(
                "[tenants.policy] max_concurrent, rate_per_s, burst and cache_ttl_s must be >= 0"
            )
        if not self.profiles or not set(self.profiles) <= set(PROFILES):
            raise ConfigError(f"[tenants.policy] profiles must name some of {', '.join(PROFILES)}")
        if self.default_profile not in self.profiles:
            raise ConfigError(
                f"[tenants.policy] default_profile ({self.default_profile}) must be one of its "
                "profiles"
            )


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str  # tenant id (logged only hashed)
    keys_sha256: tuple[str, ...]  # hex SHA-256 of each API key; two or more while rotating
    limits: LimitsConfig  # [limits], tightened by the entry's [tenants.limits]
    policy: TenantPolicy  # quotas, profiles and cache policy


@dataclass(frozen=True, slots=True)
class TenantTable:
    """Every tenant and its keys; never changed once built (a reload builds another)."""

    tenants: tuple[Tenant, ...]  # in file order
    by_hash: Mapping[str, Tenant]  # hex SHA-256 of an API key -> its tenant (read-only)

    @classmethod
    def of(cls, tenants: tuple[Tenant, ...]) -> TenantTable:
        by_hash = {key: t for t in tenants for key in t.keys_sha256}
        return cls(tenants, MappingProxyType(by_hash))


class LiveTenants:
    """The table in force. `table` is replaced whole, by one assignment on the event loop; a
    request reads it once, so it finishes under the limits and policy it started with."""

    def __init__(self, table: TenantTable) -> None:
        self.table = table


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """Where the gateway's configuration came from, for reloads."""

    path: Path | None  # the --config file; None = defaults and environment only
    data: Mapping[str, Any]  # its contents at start


def gateway_policy(cfg: GatewayConfig) -> TenantPolicy:
    """The policy of a tenant that sets none of its own."""
    return TenantPolicy(
        cfg.max_concurrent_per_tenant,
        cfg.rate_per_tenant,
        cfg.burst_per_tenant,
        default_profile=cfg.default_profile,
    )


def tenants_from(data: Mapping[str, Any], cfg: GatewayConfig, lim: LimitsConfig) -> TenantTable:
    """The `[[tenants]]` of a config file, checked against the running [gateway] and [limits].
    With none, a loopback gateway serves the dev key as tenant "dev"; any other refuses."""
    rows = data.get("tenants", [])
    if not isinstance(rows, list):
        raise ConfigError("tenants must be an array of tables ([[tenants]])")
    tenants = tuple(_tenant(n, row, cfg, lim) for n, row in enumerate(rows, start=1))
    seen_ids: dict[str, int] = {}
    seen_keys: dict[str, int] = {}
    for n, tenant in enumerate(tenants, start=1):
        if tenant.id in seen_ids:
            raise TenantConfigError(n, tenant.id, f"the id of entry #{seen_ids[tenant.id]} again")
        seen_ids[tenant.id] = n
        for key in tenant.keys_sha256:
            if key in seen_keys:
                raise ConfigError(f"[[tenants]] #{seen_keys[key]} and #{n} share a key")
            seen_keys[key] = n
    if not tenants:
        if not is_loopback(cfg.listen):
            raise ConfigError("the gateway listens beyond loopback: configure [[tenants]]")
        tenants = (Tenant(DEV_TENANT, (key_sha256(DEV_KEY),), lim, gateway_policy(cfg)),)
    return TenantTable.of(tenants)


def reread(
    config: ConfigFile, cfg: GatewayConfig, lim: LimitsConfig
) -> tuple[TenantTable, list[str]]:
    """Reads the file again: a new table (checked against the running sections), and which of
    the sections read only at start differ from what the gateway started with."""
    assert config.path is not None
    data = read_file(config.path)
    table = tenants_from(data, cfg, lim)
    return table, [s for s in RESTART_SECTIONS if data.get(s) != config.data.get(s)]


def _tenant(n: int, row: Any, cfg: GatewayConfig, lim: LimitsConfig) -> Tenant:
    if not isinstance(row, dict):
        raise ConfigError(f"[[tenants]] #{n} must be a table")
    tenant = row.get("id", "")
    if not isinstance(tenant, str) or not tenant:
        raise ConfigError(f"[[tenants]] #{n}: id must be a non-empty string")
    unknown = sorted(set(row) - set(ENTRY_KEYS))
    if unknown:
        raise TenantConfigError(n, tenant, f"unknown key(s) {unknown}; known: {list(ENTRY_KEYS)}")
    try:
        keys = _keys(row)
        limits = _limits(_table(row, "limits"), lim)
        policy = _policy(_table(row, "policy"), cfg)
    except ConfigError as exc:
        raise TenantConfigError(n, tenant, str(exc)) from None
    return Tenant(tenant, keys, limits, policy)


def _table(row: Mapping[str, Any], name: str) -> dict[str, Any]:
    table = row.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"[tenants.{name}] must be a table")
    return table


def _keys(row: Mapping[str, Any]) -> tuple[str, ...]:
    many = row.get("keys_sha256", [])
    if not isinstance(many, list):
        raise ConfigError("keys_sha256 must be a list")
    keys = ([row["key_sha256"]] if "key_sha256" in row else []) + many
    if not keys:
        raise ConfigError("set key_sha256, or keys_sha256 (two while a key is rotated)")
    out = tuple(str(k).lower() for k in keys)
    if not all(re.fullmatch(r"[0-9a-f]{64}", k) for k in out):
        raise ConfigError("key_sha256 and keys_sha256 entries must be 64 hex digits")
    if len(set(out)) != len(out):
        raise ConfigError("a key is listed twice")
    return out


def _limits(own: Mapping[str, Any], lim: LimitsConfig) -> LimitsConfig:
    merged = {**dataclasses.asdict(lim), **own}
    # A limit left to the global value may have to follow the one it is bounded by.
    for low, high in (
        ("default_new_tokens", "max_new_tokens"),
        ("max_item_bytes", "max_request_bytes"),
    ):
        if low not in own and type(merged[high]) is int:
            merged[low] = min(merged[low], merged[high])
    limits = build(LimitsConfig, "tenants.limits", {"tenants.limits": merged}, {})
    for key in own:
        mine, everyone = getattr(limits, key), getattr(lim, key)
        if mine > everyone:
            raise ConfigError(
                f"[tenants.limits] {key} = {mine} loosens [limits] {key} = {everyone}; "
                "a tenant may only tighten a limit"
            )
    return limits


def _policy(own: Mapping[str, Any], cfg: GatewayConfig) -> TenantPolicy:
    base = gateway_policy(cfg)
    merged = {**dataclasses.asdict(base), **own}
    policy = build(TenantPolicy, "tenants.policy", {"tenants.policy": merged}, {})
    # A global quota of 0 is no cap, so any value tightens it; a set one only a smaller nonzero.
    capacity = (
        (cfg.burst_per_tenant or max(1, int(cfg.rate_per_tenant))) if cfg.rate_per_tenant else 0
    )
    caps = {
        "max_concurrent": ("max_concurrent_per_tenant", cfg.max_concurrent_per_tenant),
        "rate_per_s": ("rate_per_tenant", cfg.rate_per_tenant),
        "burst": ("burst_per_tenant", capacity),
    }
    for key, (name, everyone) in caps.items():
        mine = getattr(policy, key)
        if key in own and everyone and not 0 < mine <= everyone:
            raise ConfigError(
                f"[tenants.policy] {key} = {mine:g} loosens [gateway] {name} ({everyone:g}); "
                "a tenant may only tighten a quota (0 = no cap)"
            )
    return policy

"""Configuration loading: one TOML file, every key overridable by `VISOR_<SECTION>_<KEY>`.

Each package declares its sections as frozen dataclasses with safe defaults and a `validate()`;
this module only reads the file, applies the environment and refuses unknown sections and keys.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

# Every section any visor service reads; a section outside this list is a typo.
KNOWN_SECTIONS = frozenset(
    {"gateway", "limits", "core", "cache", "scheduler", "log", "tenants", "deployment"}
)
ENV_PREFIX = "VISOR_"


class ConfigError(ValueError):
    """A configuration that cannot be used; raised at start, before any port is opened."""


class Section(Protocol):
    def validate(self) -> None: ...


S = TypeVar("S", bound=Section)


def read_file(path: Path | None) -> dict[str, Any]:
    """Reads the TOML file (or nothing) and refuses unknown sections."""
    if path is None:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - KNOWN_SECTIONS)
    if unknown:
        raise ConfigError(f"unknown config section(s) {unknown}; known: {sorted(KNOWN_SECTIONS)}")
    return data


def build(cls: type[S], name: str, data: Mapping[str, Any], env: Mapping[str, str]) -> S:
    """Builds section `name` from the file's table plus environment overrides, then validates it."""
    table = dict(data.get(name, {}))
    if not isinstance(data.get(name, {}), dict):
        raise ConfigError(f"[{name}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) in [{name}]: {unknown}; known: {sorted(fields)}")
    prefix = f"{ENV_PREFIX}{name.upper()}_"
    hints = typing.get_type_hints(cls)
    for var, raw in env.items():
        if not var.startswith(prefix):
            continue
        key = var[len(prefix) :].lower()
        if key not in fields:
            raise ConfigError(f"{var} names no key of [{name}]; known: {sorted(fields)}")
        table[key] = _parse_env(var, raw, hints[key])
    for key, value in table.items():
        table[key] = _coerce(name, key, value, hints[key])
    section = cls(**table)
    section.validate()
    return section


def environ() -> Mapping[str, str]:
    return dict(os.environ)


def _parse_env(var: str, raw: str, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return [item.strip() for item in raw.split(",") if item.strip()]
    if hint is bool:
        if raw.lower() in {"1", "true", "yes", "on"}:
            return True
        if raw.lower() in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"{var} must be true or false")
    try:
        return hint(raw) if hint in (int, float, str) else raw
    except ValueError as exc:
        raise ConfigError(f"{var} must be of type {hint.__name__}") from exc


def _coerce(section: str, key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    where = f"[{section}] {key}"
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list")
        return tuple(str(v) for v in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not isinstance(value, hint):
        raise ConfigError(f"{where} must be of type {hint.__name__}")
    if hint is int and isinstance(value, bool):
        raise ConfigError(f"{where} must be an integer")
    return value


LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "info"  # one of LEVELS

    def validate(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError(f"[log] level must be one of {LEVELS}")

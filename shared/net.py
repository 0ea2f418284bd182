"""Address helpers."""

from __future__ import annotations

import ipaddress

from shared.config import ConfigError


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"address {address!r} must be host:port")
    return host.strip("[]"), int(port)


def is_loopback(address: str) -> bool:
    host, _ = split_host_port(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

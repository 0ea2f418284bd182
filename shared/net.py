"""Address helpers."""

from __future__ import annotations

import ipaddress
import socket

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


def free_port() -> int:
    """A loopback TCP port free at this instant, for services a test or benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

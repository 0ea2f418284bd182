"""API-key authentication: `authorization: Bearer <key>` -> tenant id. Keys are stored hashed."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from gateway.config import Tenant
from shared.errors import Reason, VisorError
from shared.hashing import key_sha256

DEV_KEY = "visor-dev-key"
DEV_TENANT = "dev"


class Authenticator:
    def __init__(self, tenants: Iterable[Tenant]) -> None:
        self._by_hash = {t.key_sha256: t.id for t in tenants}

    @classmethod
    def for_listen(cls, tenants: tuple[Tenant, ...], loopback: bool) -> Authenticator:
        """With no tenants, loopback gets the dev key; anything else refuses to start."""
        if tenants:
            return cls(tenants)
        if not loopback:
            raise ValueError("the gateway listens beyond loopback: configure [[tenants]]")
        return cls([Tenant(DEV_TENANT, key_sha256(DEV_KEY))])

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        header = next((v for k, v in metadata if k.lower() == "authorization"), None)
        if not isinstance(header, str) or not header.startswith("Bearer "):
            raise VisorError(Reason.UNAUTHENTICATED, "missing bearer token")
        digest = key_sha256(header[len("Bearer ") :].strip())
        for known, tenant in self._by_hash.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise VisorError(Reason.UNAUTHENTICATED, "unknown API key")

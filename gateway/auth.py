"""API-key authentication: `authorization: Bearer <key>` -> tenant. Keys are stored hashed."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from gateway.tenants import Tenant, TenantTable
from shared.errors import Reason, VisorError
from shared.hashing import key_sha256


def authenticate(table: TenantTable, metadata: Iterable[tuple[str, str | bytes]]) -> Tenant:
    header = next((v for k, v in metadata if k.lower() == "authorization"), None)
    if not isinstance(header, str) or not header.startswith("Bearer "):
        raise VisorError(Reason.UNAUTHENTICATED, "missing bearer token")
    digest = key_sha256(header[len("Bearer ") :].strip())
    for known, tenant in table.by_hash.items():
        if hmac.compare_digest(known, digest):
            return tenant
    raise VisorError(Reason.UNAUTHENTICATED, "unknown API key")

"""Per-tenant admission: how many requests a tenant may have in flight, and how many it may start
per second (a token bucket). Refusals are QUOTA_EXCEEDED, before any media is parsed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from shared.errors import Reason, VisorError


@dataclass(slots=True)
class _Bucket:
    tokens: float  # requests the tenant may still start now
    stamp: float  # monotonic time of the last refill
    in_flight: int = 0  # requests admitted and not finished


@dataclass(slots=True)
class Quotas:
    """`max_concurrent` 0 = no cap; `rate_per_s` 0 = no rate limit; `burst` defaults to the rate.
    State lives in one event loop, so plain counters are enough (no locks)."""

    max_concurrent: int  # requests in flight per tenant
    rate_per_s: float  # sustained requests per second per tenant
    burst: int  # bucket size
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def _bucket(self, tenant: str) -> _Bucket:
        capacity = float(self.burst or max(1.0, self.rate_per_s))
        bucket = self._buckets.get(tenant)
        now = time.monotonic()
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(capacity, now)
        elif self.rate_per_s > 0:
            bucket.tokens = min(capacity, bucket.tokens + (now - bucket.stamp) * self.rate_per_s)
            bucket.stamp = now
        return bucket

    @contextmanager
    def admit(self, tenant: str) -> Iterator[None]:
        bucket = self._bucket(tenant)
        if self.max_concurrent and bucket.in_flight >= self.max_concurrent:
            raise VisorError(
                Reason.QUOTA_EXCEEDED,
                f"the tenant has max_concurrent_per_tenant ({self.max_concurrent}) requests "
                "running",
            )
        if self.rate_per_s > 0:
            if bucket.tokens < 1.0:
                raise VisorError(
                    Reason.QUOTA_EXCEEDED,
                    f"the tenant exceeds rate_per_tenant ({self.rate_per_s:g} requests/s)",
                )
            bucket.tokens -= 1.0
        bucket.in_flight += 1
        try:
            yield
        finally:
            bucket.in_flight -= 1

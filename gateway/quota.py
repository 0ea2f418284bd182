"""Admission: how many requests the gateway and each tenant may have in flight, how many a tenant
may start per second (a token bucket), and how many bytes unfinished uploads may hold. A request
is admitted right after authentication, before its body is received, so a stalled upload counts
from the moment it opens. Refusals are QUOTA_EXCEEDED (the tenant's own limits) or OVERLOADED
(the gateway's), each with its reason, before any media is parsed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from shared.errors import Reason, VisorError

MIB = 1024 * 1024


@dataclass(slots=True)
class _Bucket:
    tokens: float  # requests the tenant may still start now
    stamp: float  # monotonic time of the last refill
    in_flight: int = 0  # requests admitted and not finished


@dataclass(slots=True)
class Quotas:
    """Counters that outlive any one tenant table: buckets are keyed by tenant id, and each
    admission brings the caps in force for it (a reload applies new caps to new admissions; a
    request already admitted keeps its slot). `max_in_flight` 0 = no gateway-wide cap. State
    lives in one event loop, so plain counters are enough (no locks)."""

    max_in_flight: int = 0  # requests in flight, all tenants together
    num_in_flight: int = 0  # requests admitted and not finished, all tenants
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def _bucket(self, tenant: str, rate_per_s: float, capacity: float) -> _Bucket:
        bucket = self._buckets.get(tenant)
        now = time.monotonic()
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(capacity, now)
        elif rate_per_s > 0:
            bucket.tokens = min(capacity, bucket.tokens + (now - bucket.stamp) * rate_per_s)
            bucket.stamp = now
        return bucket

    @contextmanager
    def admit(
        self, tenant: str, max_concurrent: int, rate_per_s: float, burst: int
    ) -> Iterator[None]:
        """Holds one slot of the gateway's and one of `tenant`'s until the block ends.
        `max_concurrent` 0 = no cap; `rate_per_s` 0 = no rate limit; `burst` 0 = the rate."""
        if self.max_in_flight and self.num_in_flight >= self.max_in_flight:
            raise VisorError(
                Reason.OVERLOADED,
                f"the gateway has max_requests_in_flight ({self.max_in_flight}) requests running; "
                "retry later",
            )
        bucket = self._bucket(tenant, rate_per_s, float(burst or max(1.0, rate_per_s)))
        if max_concurrent and bucket.in_flight >= max_concurrent:
            raise VisorError(
                Reason.QUOTA_EXCEEDED,
                f"the tenant has {max_concurrent} requests running, its cap "
                "(max_concurrent_per_tenant, or its [tenants.policy] max_concurrent)",
            )
        if rate_per_s > 0:
            if bucket.tokens < 1.0:
                raise VisorError(
                    Reason.QUOTA_EXCEEDED,
                    f"the tenant exceeds its rate of {rate_per_s:g} requests/s "
                    "(rate_per_tenant, or its [tenants.policy] rate_per_s)",
                    retry_after_s=(1.0 - bucket.tokens) / rate_per_s,  # the bucket's refill
                )
            bucket.tokens -= 1.0
        bucket.in_flight += 1
        self.num_in_flight += 1
        try:
            yield
        finally:
            bucket.in_flight -= 1
            self.num_in_flight -= 1


@dataclass(slots=True)
class UploadBytes:
    """Bytes held by uploads still being received, all clients together: a bound on the memory
    that slow or stalled uploads can pin, whatever each request's own byte limits allow."""

    max_bytes: int  # cap on bytes held by unfinished uploads
    num_bytes: int = 0  # bytes they hold now
    last_end: float = 0.0  # when an upload last ended (time.monotonic()); 0.0: none yet

    @contextmanager
    def hold(self) -> Iterator[Callable[[int], None]]:
        """Yields `take(n)`, which accounts `n` more bytes of this upload or refuses OVERLOADED;
        everything taken is given back when the block ends, however it ends."""
        held = 0

        def take(num_bytes: int) -> None:
            nonlocal held
            if self.num_bytes + num_bytes > self.max_bytes:
                raise VisorError(
                    Reason.OVERLOADED,
                    "unfinished uploads hold max_upload_bytes_in_flight "
                    f"({self.max_bytes / MIB:g} MiB); retry later",
                )
            self.num_bytes += num_bytes
            held += num_bytes

        try:
            yield take
        finally:
            self.num_bytes -= held
            self.last_end = time.monotonic()

"""When the client may send a refused request again, and after how long.

Only refusals that leave nothing done are retried: QUOTA_EXCEEDED and OVERLOADED (the gateway
refuses them at admission, before any work) and CORE_UNAVAILABLE (no core reached, or none that
answered) -- and only while the call has received no event, since a second call after a token
would generate the answer again. The wait is the server's RetryInfo hint when it sent one (never
shorter, up to 20% longer so that clients refused together do not return together), otherwise
exponential backoff with jitter. Attempts are bounded, and no wait outlives the deadline.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from shared.errors import Reason, VisorError

RETRYABLE = frozenset({Reason.QUOTA_EXCEEDED, Reason.OVERLOADED, Reason.CORE_UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class Retry:
    """A retry policy; `Retry(max_attempts=1)` turns retrying off."""

    max_attempts: int = 4  # calls in all, the first included
    initial_backoff_s: float = 0.2  # the first wait when the server sent no hint
    max_backoff_s: float = 5.0  # cap on a wait without a hint
    multiplier: float = 2.0  # growth of the wait per attempt

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s or self.multiplier < 1:
            raise ValueError("needs 0 < initial_backoff_s <= max_backoff_s and multiplier >= 1")

    def wait_s(
        self, err: VisorError, attempt: int, num_events: int, time_left_s: float | None
    ) -> float | None:
        """Seconds to wait before sending again after call number `attempt` (0 = the first)
        failed with `err` after `num_events` events; None when `err` is final."""
        if num_events or err.reason not in RETRYABLE or attempt + 1 >= self.max_attempts:
            return None
        if err.retry_after_s is not None:
            wait = err.retry_after_s * random.uniform(1.0, 1.2)
        else:
            backoff = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt)
            wait = backoff * random.uniform(0.5, 1.0)  # "equal jitter": grows, never in step
        if time_left_s is not None and wait >= time_left_s:
            return None  # the deadline would pass before the next call could answer
        return wait


NO_RETRY = Retry(max_attempts=1)

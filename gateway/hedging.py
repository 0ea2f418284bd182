"""Hedged attempts: a second core is asked when the first has not answered the handshake in time.

An attempt claims the request when its core's cache reply arrives, before any pixel is decoded
or sent; the first claim wins and every other attempt is cancelled. Until then, an attempt still
waiting after `hedge_s` gets company from the next core. The handshake costs a core a cache
lookup, so a hedge is cheap; what it saves is a request waiting out `core_attempt_timeout_s` on
a core that hangs in the second or so before the health loop marks it down.

`HedgeDelay` sets `hedge_s` as "The Tail at Scale" defers a hedged request: to the 95th
percentile of recent handshakes, so about one request in twenty asks a second core, and one sent
to a core that has just hung waits about one slow handshake, not a fixed cap.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from gateway import metrics
from gateway.core_client import CoreUnreachable

C = TypeVar("C")
T = TypeVar("T")
Attempt = Callable[[C, Callable[[], bool]], AsyncIterator[T]]


class Lost(Exception):
    """Raised in an attempt whose handshake came after another attempt's."""


_END = object()


class HedgeDelay:
    """How long an attempt waits for its handshake before the next core is asked too: the 95th
    percentile of the last `window` handshakes, within [`floor_s`, `cap_s`]; `cap_s` until
    `warmup` handshakes have been seen."""

    QUANTILE = 0.95

    def __init__(
        self, cap_s: float, floor_s: float = 0.01, window: int = 256, warmup: int = 20
    ) -> None:
        self.cap_s, self.floor_s, self.warmup = cap_s, min(floor_s, cap_s), warmup
        self._recent: deque[float] = deque(maxlen=window)  # arrival order, to drop the oldest
        self._sorted: list[float] = []

    def observe(self, seconds: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent[0])]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)

    def __call__(self) -> float:
        if len(self._sorted) < self.warmup:
            return self.cap_s
        p = self._sorted[min(len(self._sorted) - 1, int(self.QUANTILE * len(self._sorted)))]
        return min(self.cap_s, max(self.floor_s, p))


async def first_to_answer(
    cores: list[C],
    attempt: Attempt[C, T],
    hedge_s: float,
    failed: Callable[[C], None],
    outrun: Callable[[C], None] = lambda _: None,
) -> AsyncIterator[T]:
    """Yields the events of the attempt that claims first; takes cores from the front of `cores`
    as it starts attempts. A core whose attempt fails unreachable before any claim is passed to
    `failed` and the next is tried; when the winner fails, `failed` is called and the error
    raised (the caller decides whether another core may still answer). Any other refusal is the
    core's answer and is raised as it is. A core whose attempt, started earlier, is still
    waiting when a later one claims is passed to `outrun`."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    started: list[C] = []
    tasks: list[asyncio.Task[None]] = []
    winner: list[int] = []

    def claim(n: int) -> bool:
        if not winner:
            winner.append(n)
            for m, task in enumerate(tasks):
                if m != n:
                    if m < n and not task.done():
                        outrun(started[m])
                    task.cancel()
        return winner[0] == n

    async def run(n: int, core: C) -> None:
        try:
            async for item in attempt(core, lambda: claim(n)):
                await queue.put((n, item))
            await queue.put((n, _END))
        except Exception as exc:  # reported to the loop below; cancellation is not
            await queue.put((n, exc))

    def start() -> None:
        started.append(cores.pop(0))
        tasks.append(asyncio.create_task(run(len(tasks), started[-1])))

    start()
    running = 1
    try:
        while True:
            wait = hedge_s if not winner and cores else None
            try:
                n, item = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                metrics.CORE_HEDGES.inc()
                start()
                running += 1
                continue
            if item is _END:
                return
            if not isinstance(item, Exception):
                yield item  # type: ignore[misc]
                continue
            running -= 1
            if isinstance(item, Lost) or (winner and winner[0] != n):
                continue
            if not isinstance(item, CoreUnreachable):
                raise item
            failed(started[n])
            if winner:
                raise item
            if running == 0:
                if not cores:
                    raise item
                start()
                running += 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

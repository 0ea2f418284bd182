"""The vision queue: encoder batches formed by tile count with a short maximum wait, run off the
event loop (on the encoder's own thread in the core). A request's item is never split across
batches; only items of one view shape share a batch, and an encoder whose rows are not views
(`per_view` False: native-resolution items, attended over as a whole) gets one item per call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from core import metrics

T = TypeVar("T")

Encode = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
Result = tuple[np.ndarray, np.ndarray]


class VisionQueue:
    def __init__(
        self,
        encode: Encode,
        run: Callable[..., Awaitable[Any]],
        max_batch_tiles: int,
        max_wait_s: float,
        per_view: bool = True,
    ) -> None:
        self._encode, self._run = encode, run
        self.max_batch_tiles, self.max_wait_s = max_batch_tiles, max_wait_s
        self.per_view = per_view  # the encoder's rows are views: items may share a batch
        self._pending: list[tuple[np.ndarray, asyncio.Future[Result]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def encode(self, pixels: np.ndarray) -> Result:
        """(views, 3, H, W) uint8 -> (rows, tokens, hidden) features, (rows, tokens) scores;
        rows = views when `per_view`, else 1."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self._pending.append((pixels, future))
        if sum(p.shape[0] for p, _ in self._pending) >= self.max_batch_tiles:
            self._dispatch()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._dispatch)
        return await future

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            first = self._pending.pop(0)
            batch, tiles, rest = [first], first[0].shape[0], []
            for item in self._pending if self.per_view else ():
                fits = tiles + item[0].shape[0] <= self.max_batch_tiles
                if fits and item[0].shape[1:] == first[0].shape[1:]:
                    batch.append(item)
                    tiles += item[0].shape[0]
                else:
                    rest.append(item)
            if self.per_view:
                self._pending = rest
            task = asyncio.get_running_loop().create_task(self._run_batch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, batch: list[tuple[np.ndarray, asyncio.Future[Result]]]) -> None:
        live = [(p, f) for p, f in batch if not f.cancelled()]
        if not live:
            return
        stacked = np.concatenate([p for p, _ in live]) if len(live) > 1 else live[0][0]
        metrics.ENCODER_BATCH_TILES.observe(stacked.shape[0])
        try:
            feats, scores = await self._run(self._encode, stacked)
        except Exception as exc:
            for _, f in live:
                if not f.done():
                    f.set_exception(exc)
            return
        start = 0
        for pixels, f in live:
            end = start + (pixels.shape[0] if self.per_view else 1)
            if not f.done():
                f.set_result((feats[start:end], scores[start:end]))
            start = end


class EncoderThread:
    """Runs encoder batches on a thread of their own instead of between two LLM steps: torch
    releases the GIL inside kernels, so on CUDA a batch and a step run at once on streams of
    their own and no step waits for a whole batch. One thread: batches run one at a time. It
    leaves torch's thread count alone: `set_num_threads` on one thread changes other threads'."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, "visor-encoder")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

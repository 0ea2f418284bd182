"""Visual features for a request: cache lookups, encoding of the misses through the vision
queue, and storing what was encoded. Cache I/O runs on its own thread, never on the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from core import metrics
from core.cache import Entry, FeatureCache
from core.types import CachePolicy, CoreInfo, InferRequest
from core.vision_queue import VisionQueue
from shared.hashing import FeatureKey


class FeatureService:
    def __init__(self, info: CoreInfo, queue: VisionQueue, cache: FeatureCache | None) -> None:
        self.info, self.queue, self.cache = info, queue, cache
        self._io = ThreadPoolExecutor(1, thread_name_prefix="visor-cache")
        self._writes: set[asyncio.Future[bool]] = set()

    def keys(self, req: InferRequest) -> list[FeatureKey]:
        return [
            FeatureKey(
                req.tenant,
                item.content_hash,
                self.info.model_id,
                self.info.encoder_digest,
                item.preprocess_version,
                item.resolution,
                item.tile_rows,
                item.tile_cols,
                item.frame,
                item.shape,
                item.frame_interval_s,
            )
            for item in req.items
        ]

    async def lookup(self, keys: list[FeatureKey], policy: CachePolicy) -> list[Entry | None]:
        cache = self.cache
        if cache is None or not keys or policy.no_cache:
            return [None] * len(keys)
        loop = asyncio.get_running_loop()
        ttl_s = policy.ttl_s
        found = await loop.run_in_executor(self._io, lambda: [cache.get(k, ttl_s) for k in keys])
        for entry in found:
            metrics.CACHE_LOOKUPS.labels(result="hit" if entry else "miss").inc()
        return found

    async def encode(self, pixels: np.ndarray) -> Entry:
        feats, scores = await self.queue.encode(pixels)
        return Entry(feats.reshape(-1, feats.shape[-1]), scores.reshape(-1))

    def store(self, key: FeatureKey, entry: Entry, policy: CachePolicy) -> None:
        """Writes in the background: a request never waits for its features to be stored."""
        cache = self.cache
        if cache is None or policy.no_cache or not cache.enabled_for(key.tenant):
            return
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._io, cache.put, key, entry, policy.ttl_s)
        self._writes.add(future)
        future.add_done_callback(self._writes.discard)

    async def close(self) -> None:
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if self.cache is not None:
            await asyncio.get_running_loop().run_in_executor(self._io, self.cache.close)
        self._io.shutdown(wait=True)

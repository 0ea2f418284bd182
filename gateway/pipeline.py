"""One request through the gateway: limits -> sniff -> probe -> handshake -> decode misses ->
stream tensors -> relay tokens. Plain values in, plain events out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np

from gateway import decode, limits
from gateway.config import LimitsConfig
from gateway.core_client import CoreClient, CoreFinal, CoreRequest, ItemHeader
from gateway.pool import DecodePool
from gateway.sniff import sniff
from gateway.types import Ask, Delta, Final
from shared.hashing import content_hash


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


class Pipeline:
    def __init__(
        self, limits_cfg: LimitsConfig, pool: DecodePool, core: CoreClient, default_profile: str
    ) -> None:
        self.limits, self.pool, self.core = limits_cfg, pool, core
        self.default_profile = default_profile

    async def generate(
        self,
        tenant: str,
        request_id: str,
        ask: Ask,
        started: float,
        timings: dict[str, float],
        timeout: float | None,
    ) -> AsyncIterator[Delta | Final]:
        """`started` is when the request arrived (perf_counter); `timings` holds `receive`."""
        max_new = limits.check_request(self.limits, ask)
        media = [m for t in ask.turns for m in t.media]
        t0 = time.perf_counter()
        formats = [sniff(m) for m in media]
        hashes = [content_hash(m) for m in media]
        if media:
            timings["sniff"] = _ms(t0)
        geo = await self.core.geometry(timeout)
        if media:
            t0 = time.perf_counter()
            lim = self.limits
            await asyncio.gather(
                *(
                    self.pool.run(decode.probe, m, f, lim.max_pixels, lim.max_side, lim.max_frames)
                    for m, f in zip(media, formats, strict=True)
                )
            )
            timings["probe"] = _ms(t0)
        size = geo.image_size
        items = tuple(
            ItemHeader(h, geo.preprocess_version, size, 1, 1, (1, 3, size, size)) for h in hashes
        )

        missed: list[int] = []

        async def pixels_for(missing: list[int]) -> list[np.ndarray]:
            missed.extend(missing)
            lim = self.limits
            done = await asyncio.gather(
                *(
                    self.pool.run(
                        decode.decode,
                        media[i],
                        formats[i],
                        size,
                        geo.fill,
                        lim.max_pixels,
                        lim.max_side,
                    )
                    for i in missing
                )
            )
            if done:
                timings["image_decode"] = sum(d.decode_ms for d in done)
                timings["preprocess"] = sum(d.preprocess_ms for d in done)
            return [d.pixels for d in done]

        def on_transfer(ms: float) -> None:
            timings["transfer"] = ms

        req = CoreRequest(
            tenant,
            request_id,
            ask.turns,
            replace(ask.params, max_new_tokens=max_new),
            items,
            ask.profile or self.default_profile,
        )
        first = True
        async for event in self.core.infer(req, timeout, pixels_for, on_transfer):
            if isinstance(event, Delta):
                if first and event.text:
                    timings["ttft"], first = _ms(started), False
                yield event
            else:
                yield _final(event, hashes, set(missed), timings, started, first)


def _final(
    f: CoreFinal,
    hashes: list[str],
    missing: set[int],
    timings: dict[str, float],
    started: float,
    no_text: bool,
) -> Final:
    if no_text:
        timings["ttft"] = _ms(started)
    merged = {**f.timings_ms, **timings}
    cache = tuple((h, i not in missing) for i, h in enumerate(hashes))
    return Final(
        f.text,
        f.text_tokens,
        f.visual_tokens_before,
        f.visual_tokens_after,
        f.output_tokens,
        cache,
        f.core_id,
        f.finish_reason,
        merged,
    )

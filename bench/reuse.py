"""What the two caches save on the bench model: the same image with a different question (cold:
encode + full prefill; warm: features from LMDB + the image's KV blocks from the prefix cache),
and a three-turn conversation that resends everything each turn (caches on vs off)."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.workload import QUESTIONS, timed
from core.cache import Entry, FeatureCache
from core.config import SchedulerConfig
from core.engine import Engine
from core.model.tokenizer import ChatTurn
from core.types import InferRequest, SamplingParams
from shared.hashing import FeatureKey


def _key(engine: Engine, seed: int) -> FeatureKey:
    i = engine.info
    return FeatureKey(
        "bench", f"{seed:064x}", i.model_id, i.encoder_digest, "pp1", i.image_size, 1, 1
    )


async def _features(
    engine: Engine, cache: FeatureCache | None, pixels: np.ndarray, key: FeatureKey
) -> np.ndarray:
    """The image's features: from the cache when it holds them, else encoded (and stored)."""
    if cache is not None:
        got = cache.get(key)
        if got is not None:
            return got.features
    feats, scores = await engine.run(engine.encoder.encode, pixels)
    entry = Entry(feats.reshape(-1, feats.shape[-1]), scores.reshape(-1))
    if cache is not None:
        cache.put(key, entry)
    return entry.features


async def _ask(
    engine: Engine, cache: FeatureCache | None, seed: int, turns: tuple[ChatTurn, ...], n: int
) -> tuple[float, float, str]:
    """(TTFT, latency, text) of one request about image `seed`, timing the feature step too."""
    size = engine.info.image_size
    pixels = np.random.default_rng(seed).integers(0, 256, (1, 3, size, size), dtype=np.uint8)
    key = _key(engine, seed)
    t0 = time.perf_counter()
    feats = await _features(engine, cache, pixels, key)
    spent = time.perf_counter() - t0
    req = InferRequest("bench", f"q{seed}", turns, SamplingParams(n, min_new_tokens=n), (), "none")
    content = [key.encode()]
    ttft, latency, result = await timed(engine, req, [feats], content_keys=content)
    return spent + ttft, spent + latency, result.text


async def _cold_warm(engine: Engine, cache: FeatureCache, images: int) -> dict[str, Any]:
    cold, warm = [], []
    for seed in range(images):
        one = (ChatTurn("user", QUESTIONS[0], 1),)
        cold.append((await _ask(engine, cache, 500 + seed, one, 1))[0])
        for question in QUESTIONS[1:3]:
            turn = (ChatTurn("user", question, 1),)
            warm.append((await _ask(engine, cache, 500 + seed, turn, 1))[0])
    c, w = statistics.median(cold), statistics.median(warm)
    return {
        "cold_ttft_s": round(c, 4),
        "warm_ttft_s": round(w, 4),
        "ttft_ratio_cold_over_warm": round(c / w, 2),
        "target": 9.3,
    }


async def _conversation(engine: Engine, cache: FeatureCache | None, seed: int) -> float:
    """Total latency of turns 2 and 3 of a conversation about one image."""
    turns: list[ChatTurn] = []
    total = 0.0
    for i, question in enumerate(QUESTIONS[:3]):
        turns.append(ChatTurn("user", question, 1 if i == 0 else 0))
        _, latency, answer = await _ask(engine, cache, seed, tuple(turns), 16)
        turns.append(ChatTurn("assistant", answer or "ok", 0))
        if i:
            total += latency
    return total


CONVERSATIONS = 3  # repeats of the three-turn case (different images); medians are reported


def run(model: Path, images: int, threads: int) -> dict[str, Any]:
    """Caches on and off see the same conversations (same images, same questions; greedy, so
    the same answers), each repeated `CONVERSATIONS` times on different images."""
    out: dict[str, Any] = {}
    seeds = [900 + i for i in range(CONVERSATIONS)]
    with tempfile.TemporaryDirectory() as tmp:
        cache = FeatureCache(Path(tmp) / "cache", 1 << 30, ttl_s=3600)
        on = Engine(model, "bench", threads, scheduler=SchedulerConfig())
        out["same_image_different_question"] = asyncio.run(_cold_warm(on, cache, images))
        on_s = [asyncio.run(_conversation(on, cache, seed)) for seed in seeds]
        on.close()
        off = Engine(model, "bench", threads, scheduler=SchedulerConfig(prefix_caching=False))
        off_s = [asyncio.run(_conversation(off, None, seed)) for seed in seeds]
        off.close()
        cache.close()
    on_m, off_m = statistics.median(on_s), statistics.median(off_s)
    out["three_turn_conversation"] = {
        "conversations": CONVERSATIONS,
        "turns_2_3_caches_off_s": round(off_m, 3),
        "turns_2_3_caches_on_s": round(on_m, 3),
        "speedup": round(off_m / on_m, 2),
        "speedups": [round(f / o, 2) for f, o in zip(off_s, on_s, strict=True)],
        "target": 2.9,
    }
    return out

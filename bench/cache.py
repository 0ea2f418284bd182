"""`visor bench cache`: what the feature cache saves, measured in the core's own path.

Same image, several different questions. Cold: the vision queue encodes the tiles, then prefill
runs to the first token. Warm: the features come from LMDB, then the same prefill. Also: LMDB
read + deserialise of a 576 x 4096 fp16 entry (a LLaVA-1.5-7B image), and encoder throughput per
CPU backend at batch 1 and 8.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from core import encoders
from core.cache import Entry, FeatureCache, tune_malloc
from core.engine import Engine, item_encoder
from core.model.tokenizer import ChatTurn
from core.types import InferRequest, SamplingParams
from core.vision_queue import VisionQueue
from shared.hashing import FeatureKey

QUESTIONS = (
    "What colour is the circle?",
    "How many shapes are there?",
    "Is the square left of the circle?",
    "What number is written?",
)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


async def _ttft(engine: Engine, features: np.ndarray, question: str) -> float:
    req = InferRequest(
        "bench",
        question,
        (ChatTurn("user", question, 1),),
        SamplingParams(max_new_tokens=1),
        (),
        "none",
    )
    t0 = time.perf_counter()
    async for _ in engine.generate(req, [features], {}):
        return _ms(t0)
    return _ms(t0)


async def _cold_warm(engine: Engine, cache: FeatureCache, repeats: int) -> dict[str, Any]:
    size = engine.info.image_size
    queue = VisionQueue(engine.encoder.encode, engine.run, 16, 0.002)
    cold_enc, cold_ttft, warm_get, warm_ttft = [], [], [], []
    for r in range(repeats):
        pixels = np.random.default_rng(r).integers(0, 256, (1, 3, size, size), dtype=np.uint8)
        key = FeatureKey(
            "bench",
            f"{r:064x}",
            engine.info.model_id,
            engine.info.encoder_digest,
            engine.info.preprocess_version,
            size,
            1,
            1,
        )
        t0 = time.perf_counter()
        feats, scores = await queue.encode(pixels)
        entry = Entry(feats.reshape(-1, feats.shape[-1]), scores.reshape(-1))
        cold_enc.append(_ms(t0))
        cold_ttft.append(cold_enc[-1] + await _ttft(engine, entry.features, QUESTIONS[0]))
        cache.put(key, entry)
        for question in QUESTIONS[1:]:
            t0 = time.perf_counter()
            got = cache.get(key)
            warm_get.append(_ms(t0))
            assert got is not None
            warm_ttft.append(warm_get[-1] + await _ttft(engine, got.features, question))
    p50 = statistics.median
    return {
        "cold_encode_ms": round(p50(cold_enc), 3),
        "warm_lookup_ms": round(p50(warm_get), 3),
        "cold_ttft_ms": round(p50(cold_ttft), 3),
        "warm_ttft_ms": round(p50(warm_ttft), 3),
        "ttft_ratio": round(p50(cold_ttft) / p50(warm_ttft), 2),
        "encode_vs_lookup_ratio": round(p50(cold_enc) / p50(warm_get), 1),
    }


def _big_entry() -> Entry:
    """A LLaVA-1.5-7B image: 576 tokens of 4096 fp16."""
    rng = np.random.default_rng(0)
    return Entry(
        rng.standard_normal((576, 4096)).astype(np.float16), rng.random(576).astype(np.float32)
    )


BIG_KEY = FeatureKey("bench", "b" * 64, "llava-1.5-7b", "0" * 64, "pp1", 336, 1, 1)


def _big_entry_read(cache: FeatureCache, repeats: int) -> dict[str, Any]:
    big = _big_entry()
    cache.put(BIG_KEY, big)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = cache.get(BIG_KEY)
        times.append(_ms(t0))
        assert got is not None and got.features.shape == (576, 4096)
    return {
        "entry_bytes": big.features.nbytes + big.importance.nbytes,
        "read_p50_ms": round(statistics.median(times), 3),
        "read_min_ms": round(min(times), 3),
    }


def _encryption_overhead(folder: Path, repeats: int) -> dict[str, Any]:
    """Write and read of the 4.7 MB entry: plain (xxh3) vs AES-GCM with a per-tenant key."""
    out: dict[str, Any] = {}
    big = _big_entry()
    for name, master in (("plain", None), ("aes_gcm", os.urandom(32))):
        cache = FeatureCache(folder / name, 1 << 30, ttl_s=3600, master_key=master)
        puts, gets = [], []
        for i in range(repeats):
            key = dataclasses.replace(BIG_KEY, content_hash=f"{i:064x}")
            t0 = time.perf_counter()
            cache.put(key, big)
            puts.append(_ms(t0))
            t0 = time.perf_counter()
            assert cache.get(key) is not None
            gets.append(_ms(t0))
        cache.close()
        out[name] = {
            "put_p50_ms": round(statistics.median(puts), 3),
            "get_p50_ms": round(statistics.median(gets), 3),
        }
    out["get_overhead_ratio"] = round(out["aes_gcm"]["get_p50_ms"] / out["plain"]["get_p50_ms"], 2)
    return out


def _throughput(engine: Engine, artifacts: Path) -> dict[str, Any]:
    size = engine.info.image_size
    out: dict[str, Any] = {}
    for name in ("torch", "onnxruntime"):
        enc = encoders.build(name, item_encoder(engine.model), artifacts)
        for batch in (1, 8):
            pixels = np.random.default_rng(batch).integers(
                0, 256, (batch, 3, size, size), dtype=np.uint8
            )
            enc.encode(pixels)
            t0 = time.perf_counter()
            n = 0
            while time.perf_counter() - t0 < 1.0:
                enc.encode(pixels)
                n += batch
            out[f"{name}_batch{batch}_images_per_s"] = round(n / (time.perf_counter() - t0), 1)
    return out


def main(model: Path, repeats: int) -> int:
    tune_malloc()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(model, "bench", encoder="auto", artifacts=Path(tmp) / "artifacts")
        cache = FeatureCache(Path(tmp) / "cache", 1 << 30, ttl_s=3600)
        result = {
            "bench": "cache",
            "backend": engine.encoder.name,
            **asyncio.run(_cold_warm(engine, cache, repeats)),
            "lmdb_576x4096_fp16": _big_entry_read(cache, 50),
            "encryption_576x4096_fp16": _encryption_overhead(Path(tmp), 20),
            "encoder_throughput": _throughput(engine, Path(tmp) / "artifacts"),
        }
        cache.close()
        engine.close()
    print(json.dumps(result))
    return 0

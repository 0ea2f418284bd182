"""`visor bench compression`: visual tokens, TTFT and req/s per compression profile, on the same
seeded workload of real encoder output (so the importance scores are real), token-budget policy.
Features are encoded once and compressed per profile, as the core does (one cached entry serves
every profile)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.workload import Spec, mixed, replay, summarize
from core import compression
from core.cache import Entry
from core.config import SchedulerConfig
from core.engine import Engine


def _encode(engine: Engine, specs: list[Spec]) -> list[list[Entry]]:
    size = engine.info.image_size
    out = []
    for spec in specs:
        entries = []
        for item in range(spec.num_items):
            rng = np.random.default_rng(spec.image_seed * 100 + item)
            pixels = rng.integers(0, 256, (spec.tiles_per_item, 3, size, size), dtype=np.uint8)
            feats, scores = engine.encoder.encode(pixels)
            entries.append(Entry(feats.reshape(-1, feats.shape[-1]), scores.reshape(-1)))
        out.append(entries)
    return out


def main(model: Path, n: int, seed: int, threads: int, quiet: bool) -> int:
    torch.set_num_threads(threads)
    # No animations: their frames would dominate the encode time of a CPU run.
    specs = [s for s in mixed(n, seed, mean_gap_s=1.0) if s.kind != "animation"]
    profiles: dict[str, Any] = {}
    cfg = SchedulerConfig(max_batch_tokens=256, max_prefill_chunk=256)
    engine = Engine(model, "bench", threads, scheduler=cfg)
    entries = _encode(engine, specs)
    for name, chosen in compression.PROFILES.items():
        feats = [
            [
                compression.compress_item(e.features, e.importance, s.tiles_per_item, chosen)
                for e in items
            ]
            for s, items in zip(specs, entries, strict=True)
        ]
        if not quiet and sys.stderr.isatty():
            print(f"profile {name}", file=sys.stderr)
        samples, makespan = asyncio.run(replay(engine, specs, feats))
        summary = summarize(samples, makespan)
        before = sum(e.features.shape[0] for items in entries for e in items)
        after = sum(f.shape[0] for fs in feats for f in fs)
        profiles[name] = {
            "visual_tokens_before": before,
            "visual_tokens_after": after,
            "kept": round(after / before, 3),
            **{k: summary[k] for k in ("req_per_s", "ttft_p50_s", "latency_p99_s")},
        }
    engine.close()
    base = profiles["none"]
    for p in profiles.values():
        p["ttft_vs_none"] = round(p["ttft_p50_s"] / base["ttft_p50_s"], 3)
        p["req_per_s_vs_none"] = round(p["req_per_s"] / base["req_per_s"], 3)
    result = {
        "bench": "compression",
        "model": model.resolve().name,
        "threads": threads,
        "workload": {"requests": len(specs), "seed": seed},
        "profiles": profiles,
    }
    print(json.dumps(result))
    return 0

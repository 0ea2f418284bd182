"""`python -m bench.encoder_stall`: how much encoder batches hold up LLM steps, in one run.

Eight text requests decode (forced length) while 16-tile encoder batches arrive every
`--period-ms` through the vision queue. Compared, on fresh engines: no encoding (the baseline),
batches run on the model thread between steps (`engine.run`), and batches on the encoder's own
thread (`EncoderThread`) with torch's default thread count and with one thread. Reported: the gap
between consecutive steps (p50/p99/max: what a decoding request feels), decode tokens/s and
encode latency. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.engine import Engine
from core.types import Result, SamplingParams
from core.vision_queue import EncoderThread, VisionQueue

NUM_SEQS, NEW_TOKENS, TILES = 8, 256, 16


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _decode(engine: Engine) -> int:
    async def one(i: int) -> int:
        ids = engine.tokenizer.tok.encode(f"tell me a story number {i}").ids
        params = SamplingParams(NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        async for out in engine.generate_ids(ids, params):
            if isinstance(out, Result):
                return out.output_tokens
        return 0

    return sum(await asyncio.gather(*(one(i) for i in range(NUM_SEQS))))


async def _encode_loop(
    queue: VisionQueue, size: int, period_s: float, done: asyncio.Event
) -> list[float]:
    rng = np.random.default_rng(0)
    latencies = []
    while not done.is_set():
        pixels = rng.integers(0, 256, (TILES, 3, size, size), dtype=np.uint8)
        t0 = time.perf_counter()
        await queue.encode(pixels)
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(max(0.0, period_s - latencies[-1]))
    return latencies


async def _scenario(model: Path, threads: int, mode: str, period_s: float) -> dict[str, Any]:
    engine = Engine(model, "bench", threads, encoder="torch")
    await engine.run(torch.get_num_threads)  # the model thread takes its thread count first
    worker = EncoderThread() if mode == "own_thread" else None
    run = worker.run if worker is not None else engine.run
    queue = VisionQueue(engine.encoder.encode, run, TILES, 0.002)
    engine.step_log = []
    done = asyncio.Event()
    try:
        t0 = time.perf_counter()
        encodes = None
        if mode != "none":
            loop = _encode_loop(queue, engine.info.image_size, period_s, done)
            encodes = asyncio.create_task(loop)
        tokens = await _decode(engine)
        makespan = time.perf_counter() - t0
        done.set()
        latencies = await encodes if encodes is not None else []
        model_threads = await engine.run(torch.get_num_threads)
    finally:
        engine.close()
        if worker is not None:
            worker.close()
    stamps = [t for t, _, _ in engine.step_log]
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
    out: dict[str, Any] = {
        "decode_tok_per_s": round(tokens / makespan, 1),
        "step_gap_p50_ms": round(statistics.median(gaps), 2),
        "step_gap_p99_ms": round(_pct(gaps, 0.99), 2),
        "step_gap_max_ms": round(max(gaps), 2),
        "model_thread_torch_threads": model_threads,
    }
    if latencies:
        out["encodes"] = len(latencies)
        out["encode_p50_ms"] = round(statistics.median(latencies) * 1000, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/demo")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--period-ms", type=float, default=150.0)
    args = parser.parse_args()
    result: dict[str, Any] = {"bench": "encoder_stall", "tiles": TILES, "period_ms": args.period_ms}
    for rep in range(3):  # alternating, so a busy moment on a shared host hits every mode
        for mode in ("none", "model_thread", "own_thread"):
            period = args.period_ms / 1000
            result[f"{mode}_{rep}"] = asyncio.run(
                _scenario(Path(args.model), args.threads, mode, period)
            )
    for metric in ("step_gap_p99_ms", "decode_tok_per_s"):
        medians = {
            mode: statistics.median(result[f"{mode}_{rep}"][metric] for rep in range(3))
            for mode in ("model_thread", "own_thread")
        }
        result[f"{metric}_median"] = medians
        result[f"{metric}_own_vs_model_thread"] = round(
            medians["own_thread"] / medians["model_thread"], 3
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The paged forward pass in its two modes on the bench checkpoint: batch-invariant (GEMMs padded
to 16 rows, attention per sequence per 16-query tile: the only path before packing, with the
projections now fused) against fast (unpadded GEMMs, packed attention). Workloads: a decode step
of 1 and of 16 sequences (each ~600 tokens of context: an image and a question) and a 592-token
prefill, at 1 and 2 torch threads. Prints one JSON object; times are medians in milliseconds.

    python -m bench.attention [--model models/bench] [--out bench/results/attention.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from core.model import llava, paged

CONTEXT = 592  # one 576-token image and a 16-token question


def _decode_step(batch: int, block_size: int) -> list[paged.SeqChunk]:
    per_seq = -(-(CONTEXT + 1) // block_size)
    return [
        paged.SeqChunk(CONTEXT, 1, torch.arange(i * per_seq, (i + 1) * per_seq), need_logits=True)
        for i in range(batch)
    ]


def _prefill(block_size: int) -> list[paged.SeqChunk]:
    return [paged.SeqChunk(0, CONTEXT, torch.arange(-(-CONTEXT // block_size)), True)]


def _median_ms(paths: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median time of each path, the paths alternating within every repetition so that a busy
    machine slows them alike."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()  # warm-up: the exact-rows probes, allocator
    for _ in range(repeats):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1000)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def run(model_dir: Path, repeats: int) -> dict[str, Any]:
    model = llava.load(model_dir)
    text = model.cfg.text
    kv = paged.PagedKV(text.num_layers, 640, 16, text.num_kv_heads, text.head_dim)
    gen = torch.Generator().manual_seed(0)
    workloads = {
        "decode_b1": _decode_step(1, 16),
        "decode_b16": _decode_step(16, 16),
        "prefill_592": _prefill(16),
    }
    paths: dict[str, Callable[[torch.Tensor, list[paged.SeqChunk]], object]] = {
        "invariant": lambda x, c: paged.forward(model, x, c, kv, batch_invariant=True),
        "fast": lambda x, c: paged.forward(model, x, c, kv, batch_invariant=False),
    }
    results: dict[str, Any] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, chunks in workloads.items():
            tokens = sum(c.num_tokens for c in chunks)
            x = torch.randn(tokens, text.hidden_size, generator=gen) * 0.5
            reps = max(3, repeats // 8) if name.startswith("prefill") else repeats
            row: dict[str, float] = _median_ms(
                {p: (lambda f=f, x=x, c=chunks: f(x, c)) for p, f in paths.items()}, reps
            )
            row["speedup_fast"] = round(row["invariant"] / row["fast"], 2)
            results[f"{name}_threads{threads}"] = row
    return {
        "bench": "attention",
        "model": str(model_dir),
        "torch": torch.__version__,
        "unit": "ms per step (median)",
        "context": CONTEXT,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("models/bench"))
    p.add_argument("--repeats", type=int, default=24)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    report = run(args.model, args.repeats)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-step time of a decode-only step on the CPU: the plain fast path, the padded static-buffer
path eagerly, and the same torch.compile'd (`[core] compile`), with the compile time; one JSON
object. `python -m bench.compile_decode --model models/demo --threads 1`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from core.cuda_graphs import Buckets, DecodeGraphs
from core.model import llava, paged


def _ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def measure(model_dir: Path, batches: tuple[int, ...], repeats: int) -> dict[str, Any]:
    model = llava.load(model_dir)
    buckets = Buckets.for_limits(max(batches), 16, 4096)
    return {f"batch{b}": _batch(model, b, buckets, repeats) for b in batches}


def _batch(model: llava.Llava, batch: int, buckets: Buckets, repeats: int) -> dict[str, Any]:
    text = model.cfg.text
    kv = paged.PagedKV(text.num_layers, 16 * batch + 1, 16, text.num_kv_heads, text.head_dim)
    # Sequences of 100..150 tokens, each on its own blocks.
    chunks = [
        paged.SeqChunk(100 + 7 * i, 1, torch.arange(16 * i, 16 * i + 16), True)
        for i in range(batch)
    ]
    embeds = torch.randn(batch, text.hidden_size) * 0.1
    eager = DecodeGraphs(model, kv, buckets, capture=False)
    compiled = DecodeGraphs(model, kv, buckets, capture=False, compile=True)
    t0 = time.perf_counter()
    compiled.run(embeds, chunks)
    compile_s = time.perf_counter() - t0
    with torch.inference_mode():
        plain = _ms(lambda: paged.forward(model, embeds, chunks, kv, False), repeats)
    padded = _ms(lambda: eager.run(embeds, chunks), repeats)
    fast = _ms(lambda: compiled.run(embeds, chunks), repeats)
    return {
        "plain_ms": round(plain, 3),
        "padded_eager_ms": round(padded, 3),
        "padded_compiled_ms": round(fast, 3),
        "compile_s": round(compile_s, 1),
        "compiled_vs_plain": round(plain / fast, 2),
        "compiled_vs_padded_eager": round(padded / fast, 2),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench.compile_decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/demo"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = measure(args.model, tuple(args.batches), args.repeats)
    info = {"bench": "compile_decode", "model": args.model.name, "threads": args.threads}
    print(json.dumps({**info, "torch": torch.__version__, **row}))


if __name__ == "__main__":
    main(sys.argv[1:])

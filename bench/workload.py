"""Seeded request workloads and their replay against an in-process engine, shared by the batching
and compression benchmarks. Features stand in for encoder output (random, the right shape): the
scheduler's cost does not depend on their values, and the encoder runs once per image either way."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.engine import Engine
from core.model.tokenizer import ChatTurn
from core.types import Delta, InferRequest, Result, SamplingParams

QUESTIONS = (
    "What colour is the circle?",
    "How many shapes are there?",
    "Is the square left of the circle?",
    "What number is written?",
    "describe the picture",
)


# The mixed workload's latency replay offers this fraction of what `request-count` serves (its
# requests per second in the saturated replay, measured in the same run), so the replay means the
# same on a faster or slower host. Above 1 every queue grows without bound and the worst latency
# under any work-conserving order is set by the makespan, not by the policy.
LOAD = 0.9
SATURATED_GAP_S = 0.1  # mean gap of the throughput replay: a burst, more than any policy serves


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str  # short | detail | animation | text
    num_items: int  # images (frames for an animation)
    tiles_per_item: int  # tiles of each image
    question: str  # the prompt text
    max_new_tokens: int  # exact output length (min = max)
    arrival_s: float  # offset from the start of the replay
    image_seed: int  # which image (same seed = same image)


@dataclass(frozen=True, slots=True)
class Sample:
    kind: str  # the spec's kind
    ttft_s: float  # arrival to first token
    latency_s: float  # arrival to the final event
    output_tokens: int  # tokens generated


def mixed(n: int, seed: int, mean_gap_s: float, decode_heavy: bool = False) -> list[Spec]:
    """Mostly one small image with a short question, some 4-tile high-detail images (3 cells +
    thumbnail), a few long animations (6 frames); Poisson arrivals; varied output lengths
    (64-128 tokens in the decode-heavy variant, which has short requests only)."""
    rng = np.random.default_rng(seed)
    specs, clock = [], 0.0
    for i in range(n):
        roll = rng.random()
        if decode_heavy or roll < 0.7:
            kind, items, tiles = "short", 1, 1
        elif roll < 0.9:
            kind, items, tiles = "detail", 1, 4
        else:
            kind, items, tiles = "animation", 6, 1
        lo, hi = (64, 129) if decode_heavy else (8, 41)
        out = int(rng.integers(lo, hi))
        specs.append(Spec(kind, items, tiles, QUESTIONS[i % 5], out, clock, 1000 + i))
        clock += float(rng.exponential(mean_gap_s))
    return specs


def features_for(engine: Engine, spec: Spec) -> list[np.ndarray]:
    rows = spec.tiles_per_item * engine.info.tokens_per_tile
    hidden = engine.model.cfg.text.hidden_size
    out = []
    for item in range(spec.num_items):
        rng = np.random.default_rng(spec.image_seed * 100 + item)
        out.append(rng.normal(0, 0.5, (rows, hidden)).astype(np.float32))
    return out


def request_for(spec: Spec, rid: str, tenant: str = "bench") -> InferRequest:
    n = spec.max_new_tokens
    turn = ChatTurn("user", spec.question, spec.num_items)
    return InferRequest(tenant, rid, (turn,), SamplingParams(n, min_new_tokens=n), (), "none")


async def timed(
    engine: Engine, req: InferRequest, features: list[np.ndarray], **kw: Any
) -> tuple[float, float, Result]:
    """(TTFT, latency, result) of one request, from now."""
    t0 = time.perf_counter()
    first = 0.0
    result = None
    async for out in engine.generate(req, features, {}, **kw):
        if isinstance(out, Delta) and not first:
            first = time.perf_counter() - t0
        if isinstance(out, Result):
            result = out
    assert result is not None
    return first or time.perf_counter() - t0, time.perf_counter() - t0, result


async def replay(
    engine: Engine,
    specs: list[Spec],
    feats: list[list[np.ndarray]],
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[Sample], float]:
    """Submits every spec at its arrival offset; returns the samples and the makespan."""
    start = time.perf_counter()

    async def one(i: int, spec: Spec) -> Sample:
        await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
        ttft, latency, result = await timed(engine, request_for(spec, f"r{i}"), feats[i])
        on_done()
        return Sample(spec.kind, ttft, latency, result.output_tokens)

    samples = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
    return list(samples), time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(samples: list[Sample], makespan: float) -> dict[str, float]:
    latencies = [s.latency_s for s in samples]
    short = [s.ttft_s for s in samples if s.kind == "short"] or [s.ttft_s for s in samples]
    tokens = sum(s.output_tokens for s in samples)
    kinds = sorted({s.kind for s in samples})
    return {
        "requests": len(samples),
        "makespan_s": round(makespan, 3),
        "req_per_s": round(len(samples) / makespan, 4),
        "output_tok_per_s": round(tokens / makespan, 3),
        "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_p99_s": round(_pct(latencies, 0.99), 3),
        "ttft_p50_s": round(statistics.median(s.ttft_s for s in samples), 3),
        "ttft_short_p50_s": round(statistics.median(short), 3),
        "ttft_short_p99_s": round(_pct(short, 0.99), 3),
        "latency_max_s_by_kind": {
            k: round(max(s.latency_s for s in samples if s.kind == k), 3) for k in kinds
        },
    }


def with_tenant(req: InferRequest, tenant: str) -> InferRequest:
    return dataclasses.replace(req, tenant=tenant)

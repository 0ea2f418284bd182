"""`visor bench batching`: the scheduler policies on one seeded mixed workload, in one run.

Each policy gets a fresh in-process engine on the same checkpoint and replays the same requests,
twice: first as a burst (`SATURATED_GAP_S`, more than any policy serves; throughput is compared
there, since below saturation every policy just keeps up with the arrivals), then spread out so
that they offer `LOAD` of what request-count served in the burst (latency and TTFT are compared
there). Also: a decode-heavy variant
(token-budget vs none), a text-only run against transformers' own continuous batching
(`generate_batch`), and the prefix/feature-cache cases from `bench.reuse`. Prints one JSON
object; `--plot FILE` writes a PNG (throughput and p99 per policy, tokens per step over time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import reuse
from bench.workload import (
    LOAD,
    SATURATED_GAP_S,
    Spec,
    features_for,
    mixed,
    replay,
    summarize,
)
from core.config import SchedulerConfig
from core.engine import Engine

POLICIES = ("token-budget", "request-count", "none")


def _config(policy: str, latency: bool = True) -> SchedulerConfig:
    """The mixed workload runs with a small budget: on this CPU a 256-token step takes 0.8-2 s
    (the VM's speed varies) and every decoding sequence waits for it (prefill cost per token is
    the same for 64..2048-token chunks). The throughput variants (decode-heavy, text-only) run the
    deployment defaults."""
    if not latency:
        return SchedulerConfig(policy=policy)
    return SchedulerConfig(policy=policy, max_batch_tokens=256, max_prefill_chunk=256)


def _progress(total: int, label: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=label, disable=quiet or not sys.stderr.isatty(), leave=False)


def run_policy(
    model: Path,
    policy: str,
    specs: list[Spec],
    threads: int,
    quiet: bool,
    latency: bool = True,
    overrides: dict[str, Any] | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> tuple[dict[str, Any], list[tuple[float, int, int]]]:
    """One replay of `specs` on a fresh engine; `overrides` replace `[scheduler]` keys (the GPU
    check sizes the KV cache for a 7B model), `device`/`dtype` are `[core]`'s."""
    sc = dataclasses.replace(_config(policy, latency), **(overrides or {}))
    engine = Engine(model, "bench", threads, scheduler=sc, device=device, dtype=dtype)
    feats = [features_for(engine, s) for s in specs]
    engine.step_log = []
    bar = _progress(len(specs), policy, quiet)
    cpu0 = time.process_time()
    try:
        samples, makespan = asyncio.run(replay(engine, specs, feats, lambda: bar.update(1)))
        cpu = time.process_time() - cpu0
    finally:
        bar.close()
        engine.close()
    log = engine.step_log
    t0 = log[0][0] if log else 0.0
    steps = [(t - t0, tokens, seqs) for t, tokens, seqs in log]
    summary = summarize(samples, makespan)
    summary["steps"] = len(steps)
    summary["preemptions"] = engine.scheduler.num_preemptions
    # CPU seconds this process got per wall second: on a shared machine, how loaded the run was.
    summary["cpu_share"] = round(cpu / makespan, 3)
    return summary, steps


def _compare(
    latency: dict[str, dict[str, Any]], saturated: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Throughput from the saturated replay (below saturation every policy serves the arrival
    rate), latency and TTFT from the replay at the served load."""
    tb, rc, none = (saturated[p] for p in POLICIES)
    ltb, lrc = latency["token-budget"], latency["request-count"]
    return {
        "throughput_vs_request_count": round(tb["req_per_s"] / rc["req_per_s"], 3),
        "throughput_vs_none": round(tb["req_per_s"] / none["req_per_s"], 3),
        "p99_latency_vs_request_count": round(ltb["latency_p99_s"] / lrc["latency_p99_s"], 3),
        "short_ttft_p50_vs_request_count": round(
            ltb["ttft_short_p50_s"] / lrc["ttft_short_p50_s"], 3
        ),
        "saturated_p99_latency_vs_request_count": round(
            tb["latency_p99_s"] / rc["latency_p99_s"], 3
        ),
        "saturated_short_ttft_p50_vs_request_count": round(
            tb["ttft_short_p50_s"] / rc["ttft_short_p50_s"], 3
        ),
        "targets": {
            "throughput_vs_both": ">= 1.0",
            "p99_latency_vs_request_count": "<= 0.7",
            "short_ttft_p50_vs_request_count": "<= 0.5",
        },
    }


def _text_only(model: Path, n: int, threads: int) -> dict[str, Any]:
    """Same prompts (random token ids, 64 new tokens each) through our engine and through
    transformers' `generate_batch` on the decoder of the same checkpoint."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed"}
    if not hasattr(transformers.GenerationMixin, "generate_batch"):
        return {"skipped": f"transformers {transformers.__version__} has no generate_batch"}
    rng = np.random.default_rng(7)
    engine = Engine(model, "bench", threads, scheduler=_config("token-budget", latency=False))
    vocab = engine.model.cfg.text.vocab_size
    prompts = [
        [int(t) for t in rng.integers(5, vocab, int(rng.integers(32, 256)))] for _ in range(n)
    ]
    new = 64
    ours, ours_cpu = asyncio.run(_ours_text(engine, prompts, new))
    engine.close()
    try:
        theirs, theirs_cpu = _theirs_text(model, prompts, new)
    except Exception as exc:  # report, do not hide, why the reference could not run
        return {"ours_output_tok_per_s": ours, "skipped": f"generate_batch failed: {exc!r}"[:300]}
    return {
        "requests": n,
        "new_tokens": new,
        "ours_output_tok_per_s": ours,
        "transformers_generate_batch_output_tok_per_s": theirs,
        "ratio": round(ours / theirs, 3),
        # Tokens per CPU-second of this process: the same comparison, robust to other load.
        "ours_output_tok_per_cpu_s": ours_cpu,
        "transformers_output_tok_per_cpu_s": theirs_cpu,
        "ratio_per_cpu_s": round(ours_cpu / theirs_cpu, 3),
        "target": ">= 1.0",
    }


async def _ours_text(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    from core.types import Result, SamplingParams

    async def one(ids: list[int]) -> int:
        stream = engine.generate_ids(ids, SamplingParams(new, min_new_tokens=new))
        async for out in stream:
            if isinstance(out, Result):
                return out.output_tokens
        return 0

    t0, c0 = time.perf_counter(), time.process_time()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return round(tokens / wall, 3), round(tokens / cpu, 3)


def _theirs_text(model: Path, prompts: list[list[int]], new: int) -> tuple[float, float]:
    return generate_batch_rate(decoder_of(model), prompts, new)


def decoder_of(
    model: Path, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> Any:
    """The checkpoint's decoder as a transformers LlamaForCausalLM (shared weights)."""
    import transformers

    llava = transformers.LlavaForConditionalGeneration.from_pretrained(model, dtype=dtype)
    causal: Any
    with torch.device("meta"):  # every weight comes from the checkpoint: none is drawn here
        causal = transformers.LlamaForCausalLM(llava.config.text_config)
    causal.model = llava.model.language_model
    causal.lm_head = llava.lm_head
    return causal.to(device or torch.device("cpu")).eval()


def generate_batch_rate(
    causal: Any, prompts: list[list[int]], new: int, device: torch.device | None = None
) -> tuple[float, float]:
    """Output tokens per wall second and per CPU second of `generate_batch` (the second call:
    the first builds and sizes its cache manager)."""
    import transformers

    cfg = transformers.GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    kw: dict[str, Any] = {"generation_config": cfg, "persistent_manager": True}
    cb = getattr(transformers.generation.configuration_utils, "ContinuousBatchingConfig", None)
    if cb is not None:  # newer releases: a cache sized to the prompts, not from free memory
        pages = sum(-(-(len(p) + new) // 256) for p in prompts) + len(prompts)
        kw["continuous_batching_config"] = cb(num_blocks=pages, max_batch_tokens=2048)
    causal.generate_batch(prompts, **kw)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = causal.generate_batch(prompts, **kw)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # The manager was sized for these prompts: the next batch size gets its own.
    getattr(causal, "destroy_cached_continuous_batching_manager", lambda: None)()
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return round(tokens / wall, 3), round(tokens / cpu, 3)


def peer(model: Path, name: str, dtype: str = "auto", compile: bool = False) -> dict[str, Any]:
    """`--peer llama.cpp`: visor's engine against llama-server on the same decoder (see
    bench/llamacpp.py), alternating, in one run. Visor runs its fastest mode, as a peer is
    measured at its best: `batch_invariant` off, with `[core] compile` when asked."""
    from bench import llamacpp

    if name != "llama.cpp":
        raise ValueError(f"unknown peer {name!r}: llama.cpp is the one")

    engines: list[Engine] = []

    def ours(threads: int) -> Callable[[list[list[int]], int, int], dict[str, float]]:
        for old in engines:  # one engine at a time: torch's thread count is per process
            old.close()
        sc = _config("token-budget", latency=False)
        engine = Engine(
            model,
            "bench",
            threads,
            scheduler=sc,
            dtype=dtype,
            batch_invariant=False,
            compile=compile,
        )
        engines.append(engine)
        return lambda prompts, new, concurrency: asyncio.run(
            _ours_rate(engines[-1], prompts, new, concurrency)
        )

    try:
        mode = {"dtype": dtype, "batch_invariant": False, "compile": compile}
        return {**mode, **llamacpp.compare(model, ours)}
    finally:
        for engine in engines:
            engine.close()


async def _ours_rate(
    engine: Engine, prompts: list[list[int]], new: int, concurrency: int
) -> dict[str, float]:
    """Output tokens per wall second, `concurrency` requests at a time, and prefill tokens per
    second (prompt tokens over time to first token, at concurrency 1 only: with more, the first
    token waits for the others' prefills)."""
    from core.types import Delta, Result, SamplingParams

    gate = asyncio.Semaphore(concurrency)
    prefill: list[float] = []

    async def one(ids: list[int]) -> int:
        async with gate:
            t0, first = time.perf_counter(), True
            async for out in engine.generate_ids(ids, SamplingParams(new, min_new_tokens=new)):
                if isinstance(out, Delta) and first:
                    prefill.append(time.perf_counter() - t0)
                    first = False
                if isinstance(out, Result):
                    return out.output_tokens
        return 0

    t0 = time.perf_counter()
    if concurrency == 1:
        tokens = sum([await one(p) for p in prompts])
    else:
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    row = {"output_tok_per_s": round(tokens / (time.perf_counter() - t0), 3)}
    if concurrency == 1:
        row["prefill_tok_per_s"] = round(sum(len(p) for p in prompts) / sum(prefill), 3)
    return row


def _plot(
    path: Path,
    policies: dict[str, dict[str, Any]],
    saturated: dict[str, dict[str, Any]],
    steps: list[Any],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = list(policies)
    axes[0].bar(names, [saturated[p]["req_per_s"] for p in names], color="tab:blue")
    axes[0].set_title("throughput, saturated (req/s)")
    axes[1].bar(names, [policies[p]["latency_p99_s"] for p in names], color="tab:red")
    axes[1].set_title("p99 latency at the served load (s)")
    axes[2].plot([s[0] for s in steps], [s[1] for s in steps], lw=0.8)
    axes[2].set_title("token-budget: tokens per step")
    axes[2].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(
    model: Path,
    n: int,
    seed: int,
    threads: int,
    plot: Path | None,
    gap: float | None = None,
    quiet: bool = False,
    peer_name: str | None = None,
    dtype: str = "auto",
    compile: bool = False,
) -> int:
    if peer_name is not None:  # the peer comparison alone: the policy replays take minutes more
        print(
            json.dumps(
                {
                    "bench": "batching",
                    "model": model.resolve().name,
                    "peer": {"name": peer_name, **peer(model, peer_name, dtype, compile)},
                }
            )
        )
        return 0
    torch.set_num_threads(threads)
    saturated_specs = mixed(n, seed, mean_gap_s=SATURATED_GAP_S)
    saturated = {p: run_policy(model, p, saturated_specs, threads, quiet)[0] for p in POLICIES}
    load = None
    if gap is None:
        load = LOAD
        gap = 1.0 / (LOAD * saturated["request-count"]["req_per_s"])
    specs = mixed(n, seed, mean_gap_s=gap)
    policies, steps = {}, []
    for policy in POLICIES:
        policies[policy], log = run_policy(model, policy, specs, threads, quiet)
        if policy == "token-budget":
            steps = log
    heavy_specs = mixed(n, seed + 1, mean_gap_s=0.5, decode_heavy=True)
    heavy = {
        p: run_policy(model, p, heavy_specs, threads, quiet, latency=False)[0]
        for p in ("token-budget", "none")
    }
    ratio = heavy["token-budget"]["output_tok_per_s"] / heavy["none"]["output_tok_per_s"]
    result = {
        "bench": "batching",
        "model": model.resolve().name,
        "threads": threads,
        "workload": {
            "requests": n,
            "seed": seed,
            "mean_gap_s": round(gap, 3),
            "load_vs_request_count_throughput": load,
            "kinds": _kinds(specs),
            "last_arrival_s": round(specs[-1].arrival_s, 2),
        },
        "scheduler": {
            name: {
                k: getattr(_config("token-budget", latency), k)
                for k in (
                    "max_batch_tokens",
                    "max_prefill_chunk",
                    "decode_step_tokens",
                    "batch_size",
                    "block_size",
                )
            }
            for name, latency in (("mixed", True), ("decode_heavy_and_text_only", False))
        },
        "policies": policies,
        "saturated": {"mean_gap_s": SATURATED_GAP_S, "policies": saturated},
        "comparison": _compare(policies, saturated),
        "decode_heavy": {
            **heavy,
            "output_tok_per_s_vs_none": round(ratio, 3),
            "target": ">= 3.0",
        },
        "text_only_vs_transformers": _text_only(model, max(4, n // 2), threads),
        **reuse.run(model, 3, threads),
    }
    if plot is not None:
        _plot(plot, policies, saturated, steps)
        result["plot"] = str(plot)
    print(json.dumps(result))
    return 0


def _kinds(specs: list[Spec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in specs:
        out[s.kind] = out.get(s.kind, 0) + 1
    return out

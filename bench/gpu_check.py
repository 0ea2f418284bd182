"""`bench/gpu_check.sh`: the GPU check of issue 21, one command, one JSON object, an 8-minute
budget. Sections, in order (each timed and guarded: one that fails or runs out of time is recorded
and the rest still run):

- checkpoint: a random-weight LLaVA-1.5-7B-shaped checkpoint built on the device (no download);
- parity: greedy generations of the demo model, CPU float32 vs the device (tokens and logprobs);
- decode: output tokens/s at batch 32 and 64 on the 7B shape, and the HBM roofline; on CUDA also
  decode tokens/s in fast mode (`batch_invariant = false`) with CUDA graphs off and on;
- ttft: one 576-token image plus a 30-token question, unloaded (encoder + prefill + first token);
- transformers: the same prompts through transformers' `generate_batch` on the same device;
- mixed: bench/batching's seeded mixed workload under token-budget / request-count / none;
- encoder: the torch encoder in bf16/fp16 and TensorRT (where installed) against CPU float32.

`--device cpu --small` runs every section with tiny shapes on the CPU (the test in
tests/bench/test_gpu_check.py); the CUDA run is the same code with the sizes of `FULL`. Everything
goes through the public API (`Engine`, `encoders.build`, bench/batching), not the runner."""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from bench import batching
from bench.workload import SATURATED_GAP_S, mixed, timed
from core import encoders
from core.config import SchedulerConfig
from core.device import resolve
from core.engine import Engine
from core.model import config as model_config
from core.model import demo, llava
from core.model.tokenizer import ChatTurn
from core.tensorrt_encoder import TensorRTUnavailable, import_tensorrt
from core.types import Delta, InferRequest, Result, SamplingParams

BUDGET_S = 480.0  # the whole check; bench/gpu_check.sh kills it a little after this
# HBM bandwidth by GPU name (first match wins), bytes/s: the decode roofline's denominator.
HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))


@dataclass(frozen=True, slots=True)
class Sizes:
    preset: str  # demo.PRESETS entry built for the LLM sections
    decode_batches: tuple[int, ...]  # concurrent sequences of the decode measurement
    prompt_tokens: int  # prompt length of each decode sequence
    new_tokens: int  # tokens generated per decode sequence
    parity_new: int  # tokens generated per parity prompt
    mixed_n: int  # requests of the mixed workload
    ttft_repeats: int  # timed TTFT requests (the median is reported)
    encoder_batches: tuple[int, ...]  # tiles per timed encoder call
    caps_s: tuple[tuple[str, float], ...]  # per-section time limits


FULL = Sizes(
    "llava-7b", (32, 64), 128, 128, 32, 32, 5, (1, 8, 32),
    (("checkpoint", 120), ("parity", 45), ("decode", 180), ("ttft", 40), ("transformers", 120),
     ("mixed", 150), ("encoder", 120)),
)  # fmt: skip
SMALL = Sizes(
    "demo", (4, 8), 16, 8, 6, 6, 2, (1, 2),
    (("checkpoint", 60), ("parity", 30), ("decode", 30), ("ttft", 20), ("transformers", 60),
     ("mixed", 60), ("encoder", 30)),
)  # fmt: skip


class SectionTimeout(Exception):
    """A section ran past its share of the budget (raised by SIGALRM in the main thread)."""


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise SectionTimeout


@dataclass(slots=True)
class Check:
    """The run's settings and what the sections share (the checkpoints, the 7B engine)."""

    device: torch.device
    dtype: torch.dtype
    sizes: Sizes
    workdir: Path
    threads: int
    deadline: float
    out: dict[str, Any]
    result_file: Path | None
    model: Path | None = None  # the 7B-shaped checkpoint (the demo one in --small)
    demo_model: Path | None = None
    engine: Engine | None = None  # the decode section's engine, reused for TTFT

    def section(self, name: str, fn: Callable[[Check], dict[str, Any]]) -> None:
        cap = dict(self.sizes.caps_s)[name]
        left = self.deadline - time.monotonic()
        if left < 5:
            self.out[name] = {"skipped": f"the {BUDGET_S:.0f} s budget is spent"}
            return
        limit = min(cap, left)
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            row = fn(self)
        except SectionTimeout:
            row = {"error": f"stopped at its {limit:.0f} s limit"}
        except Exception as exc:  # recorded; the next section still runs
            row = {"error": repr(exc)[:400]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        row["seconds"] = round(time.monotonic() - t0, 2)
        self.out[name] = row
        if self.result_file is not None:  # what a hard kill leaves behind
            self.result_file.write_text(json.dumps(self.out))

    def engine_for(
        self, batch_invariant: bool = True, cuda_graphs: bool = True, **scheduler: Any
    ) -> Engine:
        assert self.model is not None, "the checkpoint section did not run"
        sc = SchedulerConfig(**scheduler)
        device, dtype = self._placement().values()
        return Engine(
            self.model, "gpu-check", self.threads, scheduler=sc, device=device, dtype=dtype,
            batch_invariant=batch_invariant, cuda_graphs=cuda_graphs,
        )  # fmt: skip

    def _placement(self) -> dict[str, str]:
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch.")}

    def release(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def hbm_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in HBM_BYTES_PER_S if key in name), None)


def checkpoint(c: Check) -> dict[str, Any]:
    """The 7B-shaped checkpoint drawn on the device, and the demo one for parity."""
    c.demo_model = c.workdir / "demo"
    if not (c.demo_model / "config.json").exists():
        demo.build(c.demo_model, "demo")
    c.model = c.workdir / c.sizes.preset
    t0 = time.perf_counter()
    if not (c.model / "config.json").exists():
        demo.build(c.model, c.sizes.preset, device=c.device.type, dtype=c.dtype)
    cfg = model_config.load(c.model)
    return {
        "preset": c.sizes.preset,
        "build_s": round(time.perf_counter() - t0, 2),
        "bytes": sum(p.stat().st_size for p in c.model.glob("*.safetensors")),
        "decoder_params": decoder_params(cfg.text),
        "tokens_per_tile": cfg.tokens_per_tile,
    }


def decoder_params(text: model_config.TextConfig) -> int:
    """Parameters a decode step reads: every layer, the final norm and the LM head (the
    embedding is gathered, one row per token)."""
    h, kv = text.hidden_size, text.num_kv_heads * text.head_dim
    layer = 2 * h * h + 2 * h * kv + 3 * h * text.intermediate_size + 2 * h
    return text.num_layers * layer + h + text.vocab_size * h


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(5, vocab, length)] for _ in range(n)]


async def _tokens(engine: Engine, ids: list[int], new: int) -> list[tuple[str, float]]:
    params = SamplingParams(new, min_new_tokens=new, logprobs=True)
    got: list[tuple[str, float]] = []
    async for out in engine.generate_ids(ids, params):
        if isinstance(out, Delta):
            got += [(t.token, t.logprob) for t in out.logprobs]
    return got


def parity(c: Check) -> dict[str, Any]:
    """The demo model's greedy tokens on the CPU in float32 against the device in its dtype."""
    assert c.demo_model is not None
    vocab = model_config.load(c.demo_model).text.vocab_size
    prompts = _prompts(4, 48, vocab, seed=11)
    runs = []
    for device, dtype in (("cpu", "float32"), c._placement().values()):
        engine = Engine(c.demo_model, "gpu-check", c.threads, device=device, dtype=dtype)
        try:
            runs.append([asyncio.run(_tokens(engine, p, c.sizes.parity_new)) for p in prompts])
        finally:
            engine.close()
    same, diverge, worst = 0, [], 0.0
    for ref, got in zip(*runs, strict=True):
        n = next(
            (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a[0] != b[0]), len(ref)
        )
        same += n == len(ref) == len(got)
        diverge.append(n)
        worst = max([worst, *(abs(a[1] - b[1]) for a, b in zip(ref[:n], got[:n], strict=True))])
    return {
        "reference": "cpu float32",
        "candidate": " ".join(c._placement().values()),
        "prompts": len(prompts),
        "new_tokens": c.sizes.parity_new,
        "identical": same,
        "first_divergence": diverge,
        "max_abs_logprob_diff": round(worst, 6),
    }


async def _generate_all(engine: Engine, prompts: list[list[int]], new: int) -> int:
    async def one(ids: list[int]) -> int:
        async for out in engine.generate_ids(ids, SamplingParams(new, min_new_tokens=new)):
            if isinstance(out, Result):
                return out.output_tokens
        return 0

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


def _decode_rate(log: list[tuple[float, int, int]]) -> float:
    """Tokens per second over the decode-only steps (one token per sequence), each step timed
    from the end of the one before."""
    tokens, seconds = 0, 0.0
    for (t_prev, _, _), (t, n, seqs) in itertools.pairwise(log):
        if n == seqs:
            tokens, seconds = tokens + n, seconds + (t - t_prev)
    return tokens / seconds if seconds else 0.0


def decode(c: Check) -> dict[str, Any]:
    """Output tokens/s of our engine at each batch, against the HBM roofline: a decode step reads
    every decoder weight once and each sequence's keys and values once."""
    assert c.model is not None
    s, cfg = c.sizes, model_config.load(c.model)
    text, batch = cfg.text, max(s.decode_batches)
    per_token = 2 * text.num_layers * text.num_kv_heads * text.head_dim  # K and V elements
    c.engine = engine = c.engine_for(**_decode_scheduler(c))
    size = torch.empty((), dtype=c.dtype).element_size()
    bandwidth = hbm_bandwidth(gpu_name(c.device))
    out: dict[str, Any] = {
        "language_model_on": str(engine.model.lm_head.weight.device),
        "prompt_tokens": s.prompt_tokens,
        "new_tokens": s.new_tokens,
        "hbm_bytes_per_s": bandwidth,
    }
    if c.device.type == "cuda" and engine.model.lm_head.weight.device.type != "cuda":
        out["skipped"] = "the engine's language model is not on the GPU (issue 21 items 2-3)"
        return out
    asyncio.run(_generate_all(engine, _prompts(batch, s.prompt_tokens, text.vocab_size, 1), 4))
    for b in s.decode_batches:
        prompts = _prompts(b, s.prompt_tokens, text.vocab_size, seed=100 + b)
        engine.step_log = []
        t0 = time.perf_counter()
        tokens = asyncio.run(_generate_all(engine, prompts, s.new_tokens))
        wall = time.perf_counter() - t0
        context = s.prompt_tokens + s.new_tokens / 2  # mean keys and values read per sequence
        step_bytes = (decoder_params(text) + b * context * per_token) * size
        row = {
            "output_tok_per_s": round(tokens / wall, 2),
            "decode_tok_per_s": round(_decode_rate(engine.step_log), 2),
            "bytes_per_step": int(step_bytes),
        }
        if bandwidth:
            row["roofline_tok_per_s"] = round(b * bandwidth / step_bytes, 1)
            row["decode_vs_roofline"] = round(
                row["decode_tok_per_s"] / row["roofline_tok_per_s"], 3
            )
        out[f"batch{b}"] = row
    engine.step_log = None
    if c.device.type == "cuda":
        out["cuda_graphs"] = graphs_on_off(c)
    return out


def _decode_scheduler(c: Check) -> dict[str, Any]:
    """The decode engine's [scheduler]: every sequence of the largest batch at once."""
    s, text = c.sizes, model_config.load(c.model or Path()).text
    batch = max(s.decode_batches)
    per_token = 2 * text.num_layers * text.num_kv_heads * text.head_dim  # K and V elements
    blocks = batch * -(-(s.prompt_tokens + s.new_tokens + 16) // 16) + 16
    kv_mb = blocks * 16 * per_token * 4 >> 20  # [scheduler] kv_cache_mb counts float32 bytes
    return {
        "max_num_seqs": batch,
        "max_batch_tokens": max(2048, batch),
        "kv_cache_mb": max(64, kv_mb + 1),
    }


def graphs_on_off(c: Check) -> dict[str, Any]:
    """Decode tokens/s in fast mode, CUDA graphs off then on (an engine each, the same prompts;
    each batch first runs 4 tokens so that its graphs are captured before the timed run)."""
    c.release()  # one 7B engine on the device at a time
    s, vocab = c.sizes, model_config.load(c.model or Path()).text.vocab_size
    out: dict[str, Any] = {}
    for on in (False, True):
        engine = c.engine_for(False, on, **_decode_scheduler(c))
        try:
            for b in s.decode_batches:
                prompts = _prompts(b, s.prompt_tokens, vocab, seed=100 + b)
                asyncio.run(_generate_all(engine, prompts, 4))
                engine.step_log = []
                asyncio.run(_generate_all(engine, prompts, s.new_tokens))
                row = out.setdefault(f"batch{b}", {})
                row[f"graphs_{'on' if on else 'off'}_tok_per_s"] = round(
                    _decode_rate(engine.step_log), 2
                )
            if on:
                out["graphs_effective"] = engine.cuda_graphs  # false: they could not be used
        finally:
            engine.close()
    for b in s.decode_batches:
        row = out[f"batch{b}"]
        row["on_vs_off"] = round(row["graphs_on_tok_per_s"] / row["graphs_off_tok_per_s"], 3)
    return out


def _question(engine: Engine, tokens: int) -> str:
    """A question of about `tokens` tokens in the checkpoint's tokenizer."""
    words, text = itertools.cycle(("what", "colour", "is", "the", "circle", "left", "of")), ""
    while len(engine.tokenizer.tok.encode(text).ids) < tokens:
        text = f"{text} {next(words)}".strip()
    return text + "?"


def ttft(c: Check) -> dict[str, Any]:
    """One image (576 tokens on the 7B shape) and a 30-token question, one request at a time:
    encode + prefill + first token, the median of the timed repeats after one warm-up."""
    engine = c.engine or c.engine_for()
    c.engine = engine
    size, question = engine.info.image_size, _question(engine, 30)
    rows, encode_ms, first_ms = [], [], []
    for i in range(c.sizes.ttft_repeats + 1):
        pixels = np.random.default_rng(500 + i).integers(0, 256, (1, 3, size, size), np.uint8)
        t0 = time.perf_counter()
        feats = engine.encoder.encode(pixels)[0]
        t1 = time.perf_counter()
        turn = ChatTurn("user", question, 1)
        req = InferRequest("bench", f"ttft{i}", (turn,), SamplingParams(1), (), "none")
        first, _, result = asyncio.run(timed(engine, req, [feats[0]]))
        if i:  # the first is the warm-up
            encode_ms.append((t1 - t0) * 1000)
            first_ms.append(first * 1000)
            rows.append((t1 - t0 + first) * 1000)
    return {
        "image_tokens": engine.info.tokens_per_tile,
        "question_tokens": len(engine.tokenizer.tok.encode(question).ids),
        "prompt_text_tokens": result.text_tokens,
        "encode_ms_p50": round(float(np.median(encode_ms)), 2),
        "prefill_first_token_ms_p50": round(float(np.median(first_ms)), 2),
        "ttft_ms_p50": round(float(np.median(rows)), 2),
    }


def transformers_peer(c: Check) -> dict[str, Any]:
    """transformers' continuous batching on the same device, dtype and prompts as `decode`."""
    c.release()  # its memory goes to transformers' cache
    import transformers

    if not hasattr(transformers.GenerationMixin, "generate_batch"):
        return {"skipped": f"transformers {transformers.__version__} has no generate_batch"}
    assert c.model is not None
    s, vocab = c.sizes, model_config.load(c.model).text.vocab_size
    causal = batching.decoder_of(c.model, c.device, c.dtype)
    out: dict[str, Any] = {"version": transformers.__version__}
    ours = c.out.get("decode", {})
    for b in s.decode_batches:
        prompts = _prompts(b, s.prompt_tokens, vocab, seed=100 + b)
        tok_s, _ = batching.generate_batch_rate(causal, prompts, s.new_tokens, c.device)
        row: dict[str, Any] = {"output_tok_per_s": tok_s}
        if f"batch{b}" in ours:
            row["ours_vs_transformers"] = round(ours[f"batch{b}"]["output_tok_per_s"] / tok_s, 3)
        out[f"batch{b}"] = row
    del causal
    return out


def mixed_workload(c: Check) -> dict[str, Any]:
    """bench/batching's saturated replay: requests/s per policy on the same seeded workload."""
    c.release()
    assert c.model is not None
    specs = mixed(c.sizes.mixed_n, 0, mean_gap_s=SATURATED_GAP_S)
    small = c.device.type == "cpu"  # the CPU-sized step budget there, deployment defaults here
    kv = {} if small else {"kv_cache_mb": 24576, "max_request_tokens": 4096}
    rows = {}
    for policy in batching.POLICIES:
        rows[policy], _ = batching.run_policy(
            c.model, policy, specs, c.threads, quiet=True, latency=small, overrides=kv,
            **c._placement(),
        )  # fmt: skip
    tb, rc, none = (rows[p]["req_per_s"] for p in batching.POLICIES)
    return {
        "requests": len(specs),
        "req_per_s": {p: rows[p]["req_per_s"] for p in batching.POLICIES},
        "policies": rows,
        "token_budget_vs_none": round(tb / none, 3),
        "token_budget_vs_request_count": round(tb / rc, 3),
    }


def encoder(c: Check) -> dict[str, Any]:
    """The torch encoder on the device in each half type (the CPU's float32 in --small) and
    TensorRT where it is installed, each against the torch float32 encoder on the CPU."""
    c.release()
    assert c.model is not None
    size = llava.load(c.model).cfg.vision.image_size
    pixels = {
        b: np.random.default_rng(b).integers(0, 256, (b, 3, size, size), dtype=np.uint8)
        for b in c.sizes.encoder_batches
    }
    probe = pixels[max(pixels)]
    ref = encoders.TorchEncoder(llava.load(c.model)).encode(probe)[0]  # float32 on the CPU
    dtypes = (torch.bfloat16, torch.float16) if c.device.type == "cuda" else (torch.float32,)
    candidates: dict[str, encoders.Encoder] = {
        f"torch_{str(d).removeprefix('torch.')}": encoders.TorchEncoder(
            llava.load(c.model), c.device, d
        )
        for d in dtypes
    }
    out: dict[str, Any] = {}
    try:
        trt = import_tensorrt(c.device)
        t0 = time.perf_counter()
        candidates["tensorrt"] = encoders.build(
            "tensorrt", llava.load(c.model), c.workdir / "trt", device=c.device, dtype=torch.float16
        )
        out["tensorrt"] = {"version": str(trt.__version__), "build_s": time.perf_counter() - t0}
        out["tensorrt"]["served_by"] = candidates["tensorrt"].name  # torch = it fell back
    except TensorRTUnavailable as exc:
        out["tensorrt"] = {"absent": exc.reason}
    for name, enc in candidates.items():
        row: dict[str, Any] = {"parity_vs_cpu_fp32": _parity(ref, enc.encode(probe)[0])}
        for batch, px in pixels.items():
            row[f"batch{batch}_ms"] = round(_time(c.device, partial(enc.encode, px)), 3)
        out[name] = row
    return out


def _time(device: torch.device, fn: Callable[[], object], repeats: int = 10) -> float:
    fn()  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1000 / repeats


def _parity(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    a, b = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return {"min_cosine": round(float(cosine.min()), 6), "max_abs": float(np.abs(a - b).max())}


SECTIONS: tuple[tuple[str, Callable[[Check], dict[str, Any]]], ...] = (
    ("checkpoint", checkpoint),
    ("parity", parity),
    ("decode", decode),
    ("ttft", ttft),
    ("transformers", transformers_peer),
    ("mixed", mixed_workload),
    ("encoder", encoder),
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = resolve(args.device, args.dtype)
    sizes = SMALL if args.small else FULL
    budget = min(BUDGET_S, args.budget_s)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="visor-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "bench": "gpu_check",
        "device": gpu_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "sizes": "small" if args.small else "full",
        "budget_s": budget,
    }
    check = Check(device, dtype, sizes, workdir, args.threads, time.monotonic() + budget, out,
                  args.result_file)  # fmt: skip
    signal.signal(signal.SIGALRM, _alarm)
    t0 = time.monotonic()
    try:
        for name, fn in SECTIONS:
            check.section(name, fn)
    finally:
        check.release()
    out["total_s"] = round(time.monotonic() - t0, 2)
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA) | float32 | bfloat16 ...")
    p.add_argument("--small", action="store_true", help="tiny shapes (the CPU test)")
    p.add_argument("--workdir", type=Path, help="checkpoints and engines (default: a temp dir)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="at most 480")
    p.add_argument("--result-file", type=Path, help="rewritten after each section")
    return p.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(run(parse(sys.argv[1:]))))

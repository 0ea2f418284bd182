"""`visor eval`: accuracy per scenario, visual tokens and TTFT per compression profile (and, with
`--sweep`, per pruning method and fraction, merging and pooling).

In-process by default: the gateway's own decode/preprocess step (`gateway.decode`, run here
without the sandbox: the suite's media is ours), the core's encoder backend, the core's
compression (`compress_item`, seeded from the request id as the core seeds it) and the core's
`Engine.generate`. With `--target`, every case goes through a running gateway and core instead.
Each item is encoded once and its features reused across profiles, as the core's feature cache
reuses them; its encode time is counted in every profile's TTFT.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.quality import suite
from core import compression
from core.compression import Profile, Step

SWEEP_METHODS = ("random", "attention", "entropy", "adaptive", "merge")
SWEEP_PRUNED = (30, 50, 70, 80)  # percent of visual tokens removed
MAX_NEW_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Case:
    scenario: str  # the task type the accuracy is grouped by
    question: str  # the prompt
    answer: str  # expected answer (compared after `normalise`)
    media: bytes  # the encoded image


@dataclass(frozen=True, slots=True)
class Outcome:
    correct: bool  # normalised exact match
    visual_tokens: int  # tokens that reached the LLM
    ttft_ms: float  # encode + compress + prefill + first token


class Runner(Protocol):
    async def prepare(self, case: Case) -> object: ...

    async def answer(self, case: Case, prepared: object, chosen: Profile) -> Outcome: ...


def normalise(text: str) -> str:
    return text.strip().strip(".!").strip().lower()


def load_cases(spec: str, seed: int, n: int) -> list[Case]:
    """`synthetic`: `n` held-out items (scenarios rotate); `jsonl:FILE`: one JSON object per
    line with `image` (a path, relative to the file's folder), `question`, `answer`, `scenario`;
    `n` > 0 keeps the first `n`."""
    if spec == "synthetic":
        return [
            Case(it.scenario, it.question, it.answer, it.png())
            for it in suite.items(suite.Split.EVAL, seed, n)
        ]
    if spec.startswith("jsonl:"):
        path = Path(spec[len("jsonl:") :])
        cases = []
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                cases.append(
                    Case(
                        str(row.get("scenario", "all")),
                        str(row["question"]),
                        str(row["answer"]),
                        (path.parent / str(row["image"])).read_bytes(),
                    )
                )
        return cases[:n] if n > 0 else cases
    raise ValueError(f"unknown suite {spec!r}: synthetic or jsonl:FILE")


def sweep_profiles() -> dict[str, Profile]:
    out = {
        f"{m}@{p}": Profile(f"{m}@{p}", (Step(m, 1 - p / 100),))
        for m in SWEEP_METHODS
        for p in SWEEP_PRUNED
    }
    out["pool@75"] = Profile("pool@75", (Step("pool", 0.25),))
    return out


def request_seed(request_id: str) -> int:
    """The compression seed the core derives from a request id (core.servicer)."""
    return int.from_bytes(request_id.encode()[:8].ljust(8, b"\0"))


@dataclass(frozen=True, slots=True)
class _Prepared:
    features: np.ndarray  # (tokens, hidden) projected visual tokens
    importance: np.ndarray  # (tokens,) pruning scores
    item: Any  # core.types.ItemSpec
    encode_ms: float  # decode-free encode time (features are reused across profiles)


class InProcess:
    """The core's engine and compression, in this process."""

    def __init__(self, model_dir: Path, encoder: str = "torch") -> None:
        from core.engine import Engine

        self.engine = Engine(model_dir, "eval", encoder=encoder)
        info = self.engine.info
        r, g, b = (round(m * 255) for m in info.image_mean[:3])
        self.fill = (r, g, b)

    def pixels(self, media: bytes) -> np.ndarray:
        """(1, 3, S, S) uint8: the gateway's preprocessing for one `detail=auto` image."""
        from gateway import decode, sniff

        size = self.engine.info.image_size
        spec = decode.Spec(sniff.sniff(media), size, self.fill, 1, 1, (0,), 1 << 26, 1 << 14)
        return decode.decode(media, spec).items[0]

    async def prepare(self, case: Case) -> object:
        from core.types import ItemSpec

        pixels = self.pixels(case.media)
        t0 = time.perf_counter()
        feats, scores = await self.engine.run(self.engine.encoder.encode, pixels)
        encode_ms = (time.perf_counter() - t0) * 1000
        info = self.engine.info
        item = ItemSpec(
            hashlib.sha256(case.media).hexdigest(),
            info.preprocess_version,
            info.image_size,
            1,
            1,
            "uint8",
            tuple(pixels.shape),
        )
        return _Prepared(feats.reshape(-1, feats.shape[-1]), scores.reshape(-1), item, encode_ms)

    async def answer(self, case: Case, prepared: object, chosen: Profile) -> Outcome:
        from core.model.tokenizer import ChatTurn
        from core.types import InferRequest, Result, SamplingParams

        assert isinstance(prepared, _Prepared)
        req = InferRequest(
            tenant="eval",
            request_id=f"eval-{prepared.item.content_hash[:16]}",
            turns=(ChatTurn("user", case.question, 1),),
            params=SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
            items=(prepared.item,),
            profile=chosen.name,
        )
        t0 = time.perf_counter()
        feats = compression.compress_item(
            prepared.features, prepared.importance, 1, chosen, request_seed(req.request_id)
        )
        first: float | None = None
        text, visual = "", int(feats.shape[0])
        async for out in self.engine.generate(req, [feats], {}, prepared.features.shape[0]):
            first = first or time.perf_counter()
            if isinstance(out, Result):
                text, visual = out.text, out.visual_tokens_after
        ttft = prepared.encode_ms + ((first or time.perf_counter()) - t0) * 1000
        return Outcome(normalise(text) == normalise(case.answer), visual, ttft)

    def close(self) -> None:
        self.engine.close()


class Remote:
    """A running gateway (and the core behind it), through the Python client."""

    def __init__(self, target: str, key: str, timeout_s: float = 60.0) -> None:
        from visor.client import Client

        self.client = Client(target, key, timeout=timeout_s)

    async def prepare(self, case: Case) -> object:
        return None

    async def answer(self, case: Case, prepared: object, chosen: Profile) -> Outcome:
        t0 = time.perf_counter()
        got = await asyncio.to_thread(
            self.client.ask,
            case.question,
            [case.media],
            profile=chosen.name,
            max_new_tokens=MAX_NEW_TOKENS,
        )
        wall = (time.perf_counter() - t0) * 1000
        return Outcome(
            normalise(got.text) == normalise(case.answer),
            got.usage["visual_tokens_after"],
            got.timings_ms.get("ttft", wall),
        )

    def close(self) -> None:
        self.client.close()


def summarise(cases: list[Case], outcomes: list[Outcome]) -> dict[str, Any]:
    by: dict[str, list[bool]] = {}
    for case, o in zip(cases, outcomes, strict=True):
        by.setdefault(case.scenario, []).append(o.correct)
    return {
        "accuracy": {s: round(float(np.mean(v)), 4) for s, v in sorted(by.items())},
        "visual_tokens": round(float(np.mean([o.visual_tokens for o in outcomes])), 2),
        "ttft_ms": round(statistics.median(o.ttft_ms for o in outcomes), 2),
    }


async def evaluate(
    runner: Runner, cases: list[Case], profiles: dict[str, Profile], progress: bool
) -> dict[str, dict[str, Any]]:
    """Every case under every profile; returns the summary per profile name."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    outcomes: dict[str, list[Outcome]] = {name: [] for name in profiles}
    bar = tqdm(total=len(cases) * len(profiles), disable=not progress, unit="answer")
    try:
        for case in cases:
            prepared = await runner.prepare(case)
            for name, chosen in profiles.items():
                outcomes[name].append(await runner.answer(case, prepared, chosen))
                bar.update()
    finally:
        bar.close()
    return {name: summarise(cases, got) for name, got in outcomes.items()}


def split_sweep(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{"attention@50": r, ...} -> {"attention": {"50": r, ...}, ...}."""
    methods: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        method, pruned = name.split("@")
        methods.setdefault(method, {})[pruned] = r
    return methods


def run(
    *,
    model: Path,
    suite_spec: str,
    profile_names: Iterable[str],
    seed: int,
    n: int,
    sweep: bool,
    target: str | None,
    key: str,
    progress: bool,
) -> dict[str, Any]:
    """The whole evaluation as the one JSON-ready object `visor eval --json` prints."""
    chosen = {name: compression.profile(name) for name in profile_names}
    if sweep and target:
        raise ValueError("--sweep runs in-process only: requests cannot pick a method")
    extra = sweep_profiles() if sweep else {}
    cases = load_cases(suite_spec, seed, n)
    runner: InProcess | Remote = Remote(target, key) if target else InProcess(model)
    try:
        results = asyncio.run(evaluate(runner, cases, {**chosen, **extra}, progress))
    finally:
        runner.close()
    out: dict[str, Any] = {"profiles": {name: results[name] for name in chosen}}
    if sweep:
        out["methods"] = split_sweep({name: results[name] for name in extra})
    out["suite"] = {"spec": suite_spec, "seed": seed, "n": len(cases)}
    out["via"] = target or "in-process"
    return out

"""`visor eval`: accuracy per scenario, visual tokens and TTFT per compression profile (and, with
`--sweep`, per pruning method and fraction, merging and pooling; with `--details`, per detail
level, uncompressed).

In-process by default: the gateway's own decode/preprocess step (`gateway.decode`, run here
without the sandbox: the suite's media is ours), the core's encoder backend, the core's
compression (`compress_item`, seeded from the request id as the core seeds it) and the core's
`Engine.generate`. With `--target`, every case goes through a running gateway and core instead.
Each item is encoded once per detail level (profiles run at `auto`) and its features reused across
profiles, as the core's feature cache reuses them; its encode time is counted in every TTFT.
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
DETAIL_ORDER = ("low", "auto", "high")  # the request's `detail` levels
PROFILE_DETAIL = "auto"  # compression profiles are measured at the gateway's default detail
DETAIL_PROFILE = "none"  # detail levels are measured uncompressed


@dataclass(frozen=True, slots=True)
class Case:
    scenario: str  # the task type the accuracy is grouped by
    question: str  # the prompt
    answer: str  # expected answer (compared after `normalise`)
    media: tuple[bytes, ...]  # the encoded images, in the order the question shows them


@dataclass(frozen=True, slots=True)
class Outcome:
    correct: bool  # normalised exact match
    visual_tokens: int  # tokens that reached the LLM
    ttft_ms: float  # encode + compress + prefill + first token


@dataclass(frozen=True, slots=True)
class Setting:
    """One evaluated configuration: a compression profile at a detail level."""

    profile: Profile  # compression
    detail: str  # "low", "auto" or "high"


class Runner(Protocol):
    async def prepare(self, case: Case, detail: str) -> object: ...

    async def answer(self, case: Case, prepared: object, chosen: Setting) -> Outcome: ...


def normalise(text: str) -> str:
    return text.strip().strip(".!").strip().lower()


def load_cases(spec: str, seed: int, n: int) -> list[Case]:
    """`synthetic`: `n` held-out items (scenarios rotate); `jsonl:FILE`: one JSON object per
    line with `image` (a path, relative to the file's folder, or a list of them), `question`,
    `answer`, `scenario`; `n` > 0 keeps the first `n`."""
    if spec == "synthetic":
        return [
            Case(it.scenario, it.question, it.answer, it.pngs())
            for it in suite.items(suite.Split.EVAL, seed, n)
        ]
    if spec.startswith("jsonl:"):
        path = Path(spec[len("jsonl:") :])
        cases = []
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                images = row["image"] if isinstance(row["image"], list) else [row["image"]]
                cases.append(
                    Case(
                        str(row.get("scenario", "all")),
                        str(row["question"]),
                        str(row["answer"]),
                        tuple((path.parent / str(name)).read_bytes() for name in images),
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
    features: list[np.ndarray]  # per image: (tokens, hidden) projected visual tokens
    importance: list[np.ndarray]  # per image: (tokens,) pruning scores
    items: tuple[Any, ...]  # core.types.ItemSpec per image
    encode_ms: float  # decode-free encode time (features are reused across profiles)


class InProcess:
    """The core's engine and compression, in this process."""

    def __init__(self, model_dir: Path, encoder: str = "torch") -> None:
        from core.engine import Engine
        from gateway.config import LimitsConfig

        self.engine = Engine(model_dir, "eval", encoder=encoder)
        info = self.engine.info
        r, g, b = (round(m * 255) for m in info.image_mean[:3])
        self.fill = (r, g, b)
        self.max_tiles = LimitsConfig().max_tiles  # the gateway's default grid bound

    def pixels(
        self, media: bytes, detail: str = "auto", question: str = ""
    ) -> tuple[np.ndarray, Any]:
        """(tiles, 3, S, S) uint8 and its `gateway.tiling.Grid`: the gateway's grid choice and
        preprocessing for one image."""
        from gateway import decode, sniff, tiling

        info = self.engine.info
        fmt = sniff.sniff(media)
        probe = decode.probe(media, fmt, 1 << 26, 1 << 14, 1)
        budget = tiling.Budget(info.image_size, self.max_tiles, info.tokens_per_tile)
        grid = tiling.grid_for(detail, probe.width, probe.height, budget, question)
        spec = decode.Spec(
            fmt, info.image_size, self.fill, grid.rows, grid.cols, (0,), 1 << 26, 1 << 14
        )
        return decode.decode(media, spec).items[0], grid

    async def prepare(self, case: Case, detail: str) -> object:
        from core.types import ItemSpec

        info = self.engine.info
        feats, scores, items, encode_ms = [], [], [], 0.0
        for media in case.media:
            pixels, grid = self.pixels(media, detail, case.question)
            t0 = time.perf_counter()
            f, sc = await self.engine.run(self.engine.encoder.encode, pixels)
            encode_ms += (time.perf_counter() - t0) * 1000
            feats.append(f.reshape(-1, f.shape[-1]))
            scores.append(sc.reshape(-1))
            items.append(
                ItemSpec(
                    hashlib.sha256(media).hexdigest(),
                    info.preprocess_version,
                    info.image_size,
                    grid.rows,
                    grid.cols,
                    "uint8",
                    tuple(pixels.shape),
                )
            )
        return _Prepared(feats, scores, tuple(items), encode_ms)

    async def answer(self, case: Case, prepared: object, chosen: Setting) -> Outcome:
        from core.model.tokenizer import ChatTurn
        from core.types import InferRequest, Result, SamplingParams

        assert isinstance(prepared, _Prepared)
        req = InferRequest(
            tenant="eval",
            request_id=f"eval-{prepared.items[0].content_hash[:16]}",
            turns=(ChatTurn("user", case.question, len(case.media)),),
            params=SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
            items=prepared.items,
            profile=chosen.profile.name,
        )
        t0 = time.perf_counter()
        seed = request_seed(req.request_id)
        feats = [
            compression.compress_item(f, imp, item.shape[0], chosen.profile, seed)[0]
            for f, imp, item in zip(
                prepared.features, prepared.importance, prepared.items, strict=True
            )
        ]
        first: float | None = None
        text, visual = "", sum(int(f.shape[0]) for f in feats)
        before = sum(int(f.shape[0]) for f in prepared.features)
        async for out in self.engine.generate(req, feats, {}, before):
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

    async def prepare(self, case: Case, detail: str) -> object:
        return None

    async def answer(self, case: Case, prepared: object, chosen: Setting) -> Outcome:
        t0 = time.perf_counter()
        got = await asyncio.to_thread(
            self.client.ask,
            case.question,
            list(case.media),
            profile=chosen.profile.name,
            detail=chosen.detail,
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
    runner: Runner, cases: list[Case], settings: dict[str, Setting], progress: bool
) -> dict[str, dict[str, Any]]:
    """Every case under every setting (prepared once per detail level); returns the summary
    per setting name."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    outcomes: dict[str, list[Outcome]] = {name: [] for name in settings}
    levels = sorted({s.detail for s in settings.values()}, key=DETAIL_ORDER.index)
    bar = tqdm(total=len(cases) * len(settings), disable=not progress, unit="answer")
    try:
        for case in cases:
            for level in levels:
                prepared = await runner.prepare(case, level)
                for name, chosen in settings.items():
                    if chosen.detail == level:
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


def settings_for(
    profile_names: Iterable[str], detail_levels: Iterable[str], sweep: bool
) -> dict[str, Setting]:
    """Named settings: each profile (and sweep point) at `PROFILE_DETAIL`, and each detail level
    as `detail:<level>` at `DETAIL_PROFILE`."""
    out = {name: Setting(compression.profile(name), PROFILE_DETAIL) for name in profile_names}
    if sweep:
        out.update({n: Setting(p, PROFILE_DETAIL) for n, p in sweep_profiles().items()})
    for level in detail_levels:
        if level not in DETAIL_ORDER:
            raise ValueError(f"unknown detail {level!r}: low, auto or high")
        out[f"detail:{level}"] = Setting(compression.profile(DETAIL_PROFILE), level)
    return out


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
    detail_levels: Iterable[str] = (),
) -> dict[str, Any]:
    """The whole evaluation as the one JSON-ready object `visor eval --json` prints."""
    if sweep and target:
        raise ValueError("--sweep runs in-process only: requests cannot pick a method")
    profile_names, detail_levels = list(profile_names), list(detail_levels)
    settings = settings_for(profile_names, detail_levels, sweep)
    cases = load_cases(suite_spec, seed, n)
    runner: InProcess | Remote = Remote(target, key) if target else InProcess(model)
    try:
        results = asyncio.run(evaluate(runner, cases, settings, progress))
    finally:
        runner.close()
    out: dict[str, Any] = {"profiles": {name: results[name] for name in profile_names}}
    if sweep:
        out["methods"] = split_sweep({name: results[name] for name in sweep_profiles()})
    if detail_levels:
        out["details"] = {level: results[f"detail:{level}"] for level in detail_levels}
    out["suite"] = {"spec": suite_spec, "seed": seed, "n": len(cases)}
    out["via"] = target or "in-process"
    return out

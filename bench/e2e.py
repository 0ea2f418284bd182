"""`visor bench e2e`: the optimisations measured together, through a real gateway and core.

One seeded workload of the synthetic suite (`bench.quality.suite`, held-out split): single
questions, several questions about the same image, multi-turn conversations and a few large
images. It is replayed once per row, each row on a freshly started gateway + core whose
configuration names what is switched on: `none` (no feature cache, no prefix reuse, profile
`none`, `detail=high`, scheduler policy `none`), then each optimisation alone on top of `none`,
then `all`. Arrivals are a closed loop: `concurrency` clients, each taking the next session of the
workload when its previous one is answered (a session's requests go in order: a conversation's
next turn carries the model's previous answer). Per row: mean visual tokens per request (the
core's `visual_tokens_after`), p50 latency (client send to final event), requests per second over
the replay, and accuracy per scenario, scored as `visor eval` scores (normalised exact match).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.quality import suite
from bench.quality.evaluate import MAX_NEW_TOKENS, normalise
from shared import procs
from shared.net import free_port

# The profile of the `+compression` row: the cheapest in docs/quality.md whose mean accuracy
# over the six scenarios stays within the seed table's 2.2 points of `none` (0.7 points there).
PROFILE = "low-latency"
KEY = "visor-dev-key"  # the gateway's built-in development tenant (no [[tenants]] configured)
QUESTIONS_PER_IMAGE = 3  # questions of a same-image or multi-turn session
# Session kinds and their share of the workload ("a few large images").
MIX = (("single", 0.4), ("same-image", 0.2), ("multi-turn", 0.2), ("large", 0.2))
MULTI = ("counting", "spatial", "attribute")  # scenes several questions can be asked about
REQUEST_TIMEOUT_S = 600.0  # a request under policy `none` waits for every one queued before it
TARGETS = {  # the seed's "all optimisations" row, as ratios against `none`
    "visual_tokens_change": -0.70,
    "latency_p50_speedup": 3.5,
    "req_per_s_speedup": 4.5,
    "accuracy_change_points": -2.2,
}


@dataclass(frozen=True, slots=True)
class Settings:
    """What `visor bench e2e` runs."""

    model: Path  # the checkpoint every core serves
    n: int = 200  # sessions in the workload
    seed: int = 0  # the workload's items and mix
    concurrency: int = 16  # closed-loop clients
    threads: int = 1  # the core's torch threads
    rounds: int = 2  # replays of every row, in turn
    logs: Path = Path(".visor/bench-e2e")  # service logs and caches, one folder per row


@dataclass(frozen=True, slots=True)
class Row:
    """One configuration; every optimisation is one field, off in `none`."""

    name: str  # the row's name in the table
    detail: str  # the requests' detail level: "high" (off) or "auto" (dynamic resolution)
    profile: str  # the requests' compression profile: "none" (off) or PROFILE
    feature_cache: bool  # [cache] enabled
    prefix_caching: bool  # [scheduler] prefix_caching
    policy: str  # [scheduler] policy: "none" (one request at a time) or "token-budget"

    def env(self) -> dict[str, str]:
        """The services' settings this row switches."""
        return {
            "VISOR_CACHE_ENABLED": str(self.feature_cache).lower(),
            "VISOR_SCHEDULER_PREFIX_CACHING": str(self.prefix_caching).lower(),
            "VISOR_SCHEDULER_POLICY": self.policy,
        }


NONE = Row("none", "high", "none", False, False, "none")
ROWS = (
    NONE,
    replace(NONE, name="+dynamic resolution", detail="auto"),
    replace(NONE, name="+compression", profile=PROFILE),
    replace(NONE, name="+caches", feature_cache=True, prefix_caching=True),
    replace(NONE, name="+token-budget batching", policy="token-budget"),
    Row("all", "auto", PROFILE, True, True, "token-budget"),
)


@dataclass(frozen=True, slots=True)
class Session:
    """What one client does in turn: one image set, one or more questions about it."""

    kind: str  # one of MIX's kinds
    media: tuple[bytes, ...]  # PNGs, shown with the first question
    questions: tuple[suite.Question, ...]  # asked in order
    conversation: bool  # True: each question is the next turn of one conversation


def workload(n: int, seed: int) -> list[Session]:
    """`n` sessions drawn from the held-out split; the same (n, seed) gives the same bytes.
    Each kind rotates through its scenarios; a several-question session asks about as many
    scenarios as its scene answers."""
    rng = np.random.default_rng([seed, 0xE2E])
    kinds, shares = [k for k, _ in MIX], [share for _, share in MIX]
    seen: dict[str, int] = {}
    out = []
    for i in range(n):
        kind = str(rng.choice(kinds, p=shares))
        turn = seen[kind] = seen.get(kind, -1) + 1
        if kind in ("single", "large"):
            pool = suite.SINGLE if kind == "single" else suite.DETAIL
            it = suite.item(suite.Split.EVAL, seed, i, pool[turn % len(pool)])
            asked = suite.questions(it)[:1]
        else:
            it, asked = _several(rng, seed, i, n, MULTI[turn % len(MULTI)])
        out.append(Session(kind, it.pngs(), tuple(asked), kind == "multi-turn"))
    return out


def _several(
    rng: np.random.Generator, seed: int, i: int, n: int, scenario: str
) -> tuple[suite.Item, list[suite.Question]]:
    """The first scene (items i, i + n, i + 2n, ...: never another session's) that answers
    QUESTIONS_PER_IMAGE questions: its own, then one per other scenario in a seeded order."""
    for index in range(i, i + 64 * n, n):
        it = suite.item(suite.Split.EVAL, seed, index, scenario)
        own, *rest = suite.questions(it)
        by: dict[str, list[suite.Question]] = {}
        for q in rest:
            by.setdefault(q.scenario, []).append(q)
        order = sorted(by, key=lambda sc: (sc == own.scenario, rng.random()))
        asked = [own] + [by[sc][int(rng.integers(len(by[sc])))] for sc in order]
        if len(asked) >= QUESTIONS_PER_IMAGE:
            return it, asked[:QUESTIONS_PER_IMAGE]
    raise AssertionError(f"no {scenario} scene answers {QUESTIONS_PER_IMAGE} questions")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's record."""

    kind: str  # the session's kind
    scenario: str  # the question's scenario
    correct: bool  # normalised exact match (False when refused)
    visual_tokens: int  # visual tokens that reached the LLM
    latency_s: float  # client send to the final event
    hits: int  # media items whose features came from the cache
    stages_ms: tuple[tuple[str, float], ...] = ()  # the answer's stage timings
    error: str = ""  # the refusal's reason, when refused


async def _session(client: Any, row: Row, s: Session) -> list[Outcome]:
    from visor.errors import VisorError
    from visor.request import Turn

    out: list[Outcome] = []
    history: list[Turn] = []
    for i, q in enumerate(s.questions):
        first = i == 0 or not s.conversation
        media, turns = (list(s.media), []) if first else ([], history)
        t0 = time.perf_counter()
        try:
            got = await client.ask(
                q.question,
                media,
                turns=turns,
                detail=row.detail,
                profile=row.profile,
                max_new_tokens=MAX_NEW_TOKENS,
            )
        except VisorError as err:
            latency = time.perf_counter() - t0
            out.append(Outcome(s.kind, q.scenario, False, 0, latency, 0, (), err.reason.value))
            continue
        latency = time.perf_counter() - t0
        ok = normalise(got.text) == normalise(q.answer)
        hits = sum(bool(c["hit"]) for c in got.cache)
        visual = got.usage["visual_tokens_after"]
        stages = tuple(got.timings_ms.items())
        out.append(Outcome(s.kind, q.scenario, ok, visual, latency, hits, stages))
        if s.conversation:
            shown = tuple(s.media) if first else ()
            history = [*history, Turn("user", q.question, shown), Turn("assistant", got.text)]
    return out


async def replay(
    gateway: str, row: Row, sessions: list[Session], concurrency: int, tick: Callable[[int], None]
) -> tuple[list[Outcome], float]:
    """Every session through `concurrency` closed-loop clients; (outcomes, makespan)."""
    from visor.aio import AsyncClient

    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    outcomes: list[Outcome] = []

    async def client_loop() -> None:
        async with AsyncClient(gateway, KEY, timeout=REQUEST_TIMEOUT_S) as client:
            while not queue.empty():
                got = await _session(client, row, queue.get_nowait())
                outcomes.extend(got)
                tick(len(got))

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - t0


@dataclass(slots=True)
class Stack:
    gateway: str  # the gateway's address
    procs: list[Any]  # core, then gateway


def start(model: Path, row: Row, logs: Path, threads: int) -> Stack:
    """A core and a gateway on free loopback ports, configured by `row.env()`; `logs` is
    emptied first, so that no feature cache outlives its run."""
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    core, gateway = (f"127.0.0.1:{free_port()}" for _ in range(2))
    env = {
        "VISOR_CORE_LISTEN": core,
        "VISOR_CORE_MODEL": str(model),
        "VISOR_CORE_NUM_THREADS": str(threads),
        "VISOR_CORE_METRICS_LISTEN": "",
        "VISOR_CACHE_PATH": str(logs / "cache"),
        "VISOR_DEPLOYMENT_SECRET_FILE": str(logs / "deployment.secret"),
        "VISOR_GATEWAY_LISTEN": gateway,
        "VISOR_GATEWAY_CORES": core,
        "VISOR_GATEWAY_METRICS_LISTEN": "",
        "VISOR_LOG_LEVEL": "warning",
        **row.env(),
    }
    started = [procs.start("core", env, log_path=logs / "core.log")]
    try:
        procs.wait_healthy(core, started[0], timeout_s=180)
        started.append(procs.start("gateway", env, log_path=logs / "gateway.log"))
        procs.wait_healthy(gateway, started[1], timeout_s=60)
    except BaseException:
        stop(Stack(gateway, started))
        raise
    return Stack(gateway, started)


def stop(stack: Stack) -> None:
    for proc in reversed(stack.procs):
        procs.stop(proc)


def warm_up(seed: int) -> list[Session]:
    """A small and a large image from the training split: the first requests of a fresh core
    pay one-off costs (lazy initialisation, first shapes), and none of these images is in the
    workload, so no cache is warmed for it."""
    small = suite.item(suite.Split.TRAIN, seed, 0, "attribute")
    large = suite.item(suite.Split.TRAIN, seed, 1, "fine_detail")
    return [
        Session("warm-up", it.pngs(), tuple(suite.questions(it)[:1]), False)
        for it in (small, large)
    ]


@dataclass(frozen=True, slots=True)
class Measured:
    """One replay of the workload on one row's services."""

    outcomes: list[Outcome]  # every request's record
    makespan_s: float  # first request sent to last answer received
    cpu_s: dict[str, float]  # CPU seconds each service spent in the replay (Linux; else empty)


def run_row(
    s: Settings, row: Row, sessions: list[Session], logs: Path, tick: Callable[[int], None]
) -> Measured:
    stack = start(s.model, row, logs, s.threads)
    try:
        asyncio.run(replay(stack.gateway, row, warm_up(s.seed), 1, lambda _: None))
        before = _cpu(stack)
        outcomes, makespan = asyncio.run(replay(stack.gateway, row, sessions, s.concurrency, tick))
        after = _cpu(stack)
    finally:
        stop(stack)
    return Measured(outcomes, makespan, {k: after[k] - before[k] for k in after})


def _cpu(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of the core and of the gateway with its decode workers (the live ones
    and those it has replaced); empty where /proc is not there to read."""
    core, gateway = stack.procs
    try:
        fields = {pid: _stat(pid) for pid in (core.pid, gateway.pid)}
        workers = [_stat(pid) for pid in _children(gateway.pid)]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    own = sum(fields[gateway.pid][11:15])  # utime, stime, and reaped children's
    return {
        "core": sum(fields[core.pid][11:13]) / tick,
        "gateway": (own + sum(sum(w[11:13]) for w in workers)) / tick,
    }


def _stat(pid: int) -> list[int]:
    """/proc/PID/stat's numeric fields after the command name (index 11 = utime)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return [int(v) if v.lstrip("-").isdigit() else 0 for v in text.rsplit(")", 1)[1].split()]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if _stat(int(entry.name))[1] == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError):
                continue  # exited while we looked
    return out


def summarise_row(row: Row, runs: list[Measured]) -> dict[str, Any]:
    """A row over its rounds: every request pooled; req/s = requests / summed makespans."""
    outcomes = [o for m in runs for o in m.outcomes]
    makespan = sum(m.makespan_s for m in runs)
    out = {"name": row.name, **summarise(outcomes, makespan)}
    if all(m.cpu_s for m in runs):
        out["cpu_ms_per_request"] = {
            k: round(1000 * sum(m.cpu_s[k] for m in runs) / len(outcomes), 2) for k in runs[0].cpu_s
        }
    out["req_per_s_by_round"] = [round(len(m.outcomes) / m.makespan_s, 3) for m in runs]
    out["config"] = asdict(row)
    return out


def summarise(outcomes: list[Outcome], makespan: float) -> dict[str, Any]:
    by: dict[str, list[bool]] = {}
    for o in outcomes:
        by.setdefault(o.scenario, []).append(o.correct)
    latencies = sorted(o.latency_s for o in outcomes)
    return {
        "visual_tokens": round(statistics.mean(o.visual_tokens for o in outcomes), 2),
        "latency_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "req_per_s": round(len(outcomes) / makespan, 3),
        "accuracy": {s: round(float(np.mean(v)), 4) for s, v in sorted(by.items())},
        "accuracy_overall": round(float(np.mean([o.correct for o in outcomes])), 4),
        "latency_p90_ms": round(latencies[int(0.9 * (len(latencies) - 1))] * 1000, 1),
        "requests": len(outcomes),
        "errors": sum(bool(o.error) for o in outcomes),
        "cache_hits": sum(o.hits for o in outcomes),
        "makespan_s": round(makespan, 2),
        "stages_p50_ms": _stages(outcomes),
    }


def _stages(outcomes: list[Outcome]) -> dict[str, float]:
    """Median of each stage the gateway reports, over the requests that report it."""
    by: dict[str, list[float]] = {}
    for o in outcomes:
        for name, ms in o.stages_ms:
            by.setdefault(name, []).append(ms)
    return {name: round(statistics.median(v), 2) for name, v in by.items()}


def versus(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """A row against `none`, in the seed table's terms."""
    return {
        "visual_tokens_change": round(row["visual_tokens"] / base["visual_tokens"] - 1, 4),
        "latency_p50_speedup": round(base["latency_p50_ms"] / row["latency_p50_ms"], 3),
        "req_per_s_speedup": round(row["req_per_s"] / base["req_per_s"], 3),
        "accuracy_change_points": round(
            100 * (row["accuracy_overall"] - base["accuracy_overall"]), 2
        ),
    }


def targets(all_vs_none: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each seed figure against the measured one: lower is better for the token change, higher
    for the rest (the accuracy change is a floor)."""
    out = {}
    for key, seed_figure in TARGETS.items():
        got = all_vs_none[key]
        met = got <= seed_figure if key == "visual_tokens_change" else got >= seed_figure
        out[key] = {"seed": seed_figure, "measured": got, "met": met}
    return out


def table(result: dict[str, Any]) -> str:
    """The rows as Markdown: tokens, p50, req/s, accuracy per scenario, each against `none`."""
    scenarios = sorted({s for r in result["rows"] for s in r["accuracy"]})
    head = ["row", "visual tokens", "p50 latency", "req/s", *scenarios, "all scenarios"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in result["rows"]:
        v = r["vs_none"]
        cells = [
            r["name"],
            f"{r['visual_tokens']:.1f} ({v['visual_tokens_change']:+.0%})",
            f"{r['latency_p50_ms']:.0f} ms ({v['latency_p50_speedup']:.2f}x)",
            f"{r['req_per_s']:.2f} ({v['req_per_s_speedup']:.2f}x)",
            *(f"{100 * r['accuracy'].get(s, 0.0):.1f}" for s in scenarios),
            f"{100 * r['accuracy_overall']:.1f} ({v['accuracy_change_points']:+.1f})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"].lstrip("+").replace(" ", "\n", 1) for r in rows]
    panels = (
        ("visual tokens per request", "visual_tokens", "tab:purple"),
        ("p50 latency (ms)", "latency_p50_ms", "tab:red"),
        ("throughput (req/s)", "req_per_s", "tab:blue"),
        ("accuracy, all scenarios (%)", "accuracy_overall", "tab:green"),
    )
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for ax, (title, key, colour) in zip(axes, panels, strict=True):
        scale = 100 if key == "accuracy_overall" else 1
        ax.bar(names, [scale * r[key] for r in rows], color=colour)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _progress(total: int, label: str, quiet: bool) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, desc=label, disable=quiet or not sys.stderr.isatty(), leave=False)


def run(s: Settings, quiet: bool = True, rows: tuple[Row, ...] = ROWS) -> dict[str, Any]:
    """Every row on the same workload, `rounds` times in turn (so that a change in the shared
    machine's load falls on every row alike, the order reversed every other round); the one
    JSON-ready object `--json` prints."""
    sessions = workload(s.n, s.seed)
    total = sum(len(x.questions) for x in sessions)
    t0 = time.perf_counter()
    runs: list[list[Measured]] = [[] for _ in rows]
    for r in range(s.rounds):
        order = list(enumerate(rows))  # every other round backwards: no row always goes first
        for i, row in order if r % 2 == 0 else order[::-1]:
            bar = _progress(total, f"{row.name} ({r + 1}/{s.rounds})", quiet)
            try:
                runs[i].append(run_row(s, row, sessions, s.logs / f"row{i}", bar.update))
            finally:
                bar.close()
    measured = [summarise_row(row, got) for row, got in zip(rows, runs, strict=True)]
    for summary in measured:
        summary["vs_none"] = versus(summary, measured[0])
    kinds: dict[str, int] = {}
    for x in sessions:
        kinds[x.kind] = kinds.get(x.kind, 0) + len(x.questions)
    out: dict[str, Any] = {
        "bench": "e2e",
        "model": s.model.resolve().name,
        "workload": {
            "sessions": s.n,
            "requests": total,
            "seed": s.seed,
            "requests_by_kind": kinds,
            "arrivals": f"closed loop, {s.concurrency} concurrent clients",
            "rounds": s.rounds,
            "max_new_tokens": MAX_NEW_TOKENS,
        },
        "threads": s.threads,
        "rows": measured,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if measured[-1]["name"] == "all" and measured[0]["name"] == "none":
        out["targets"] = targets(measured[-1]["vs_none"])
    return out


def main(settings: Settings, as_json: bool, plot_path: Path | None) -> int:
    result = run(settings, quiet=as_json)
    if plot_path is not None:
        plot(plot_path, result["rows"])
        result["plot"] = str(plot_path)
    if as_json:
        print(json.dumps(result))
    else:
        print(table(result))
        for key, t in result.get("targets", {}).items():
            verdict = "met" if t["met"] else "NOT met"
            print(f"{key}: seed {t['seed']}, measured {t['measured']}: {verdict}")
    return 0

"""`visor bench e2e`: its arguments, that each row switches exactly what it names (through the
services' own config parsing), the seeded workload, the seed-table arithmetic, and one tiny run
of every row through real gateways and cores (the JSON shape, and that each row's switch shows
in what the services report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from bench import e2e
from bench.quality import suite
from core.config import CacheConfig, SchedulerConfig
from shared.config import build
from visor import cli

ROOT = Path(__file__).resolve().parents[2]
SWITCHES = {  # what each row's name promises to switch on, and nothing else
    "+dynamic resolution": {"detail"},
    "+compression": {"profile"},
    "+caches": {"feature_cache", "prefix_caching"},
    "+token-budget batching": {"policy"},
}


def test_arguments_and_defaults() -> None:
    args = cli.parser().parse_args(
        ["bench", "e2e", "--n", "7", "--seed", "3", "--json", "--plot", "out.png"]
    )
    assert args.fn is cli._bench_e2e
    assert (args.n, args.seed, args.json, args.plot) == (7, 3, True, Path("out.png"))
    assert (args.concurrency, args.threads, args.rounds) == (16, 1, 2)
    assert args.model == "models/demo"
    plain = cli.parser().parse_args(["bench", "e2e"])
    assert (plain.n, plain.seed, plain.json, plain.plot) == (200, 0, False, None)
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["bench", "e2e", "--n", "many"])


def _differs(row: e2e.Row) -> set[str]:
    return {
        f.name
        for f in fields(e2e.Row)
        if f.name != "name" and getattr(row, f.name) != getattr(e2e.NONE, f.name)
    }


def test_each_row_switches_exactly_what_it_names() -> None:
    names = [r.name for r in e2e.ROWS]
    assert names == ["none", *SWITCHES, "all"]
    by = {r.name: r for r in e2e.ROWS}
    for name, switched in SWITCHES.items():
        assert _differs(by[name]) == switched, name
    assert _differs(by["all"]) == set().union(*SWITCHES.values())
    off = by["none"]
    assert (off.detail, off.profile, off.policy) == ("high", "none", "none")
    assert not off.feature_cache and not off.prefix_caching
    assert by["all"].profile == e2e.PROFILE == "low-latency"


def test_row_env_reaches_the_services_config() -> None:
    """Each row's environment, read by the core's own config parsing, gives what the row says,
    and every other key keeps its default."""
    for row in e2e.ROWS:
        env = row.env()
        assert all(k.startswith("VISOR_") for k in env)
        cache = build(CacheConfig, "cache", {}, env)
        sched = build(SchedulerConfig, "scheduler", {}, env)
        assert cache.enabled is row.feature_cache
        assert sched.prefix_caching is row.prefix_caching
        assert sched.policy == row.policy
        defaults = asdict(SchedulerConfig())
        changed = {k for k, v in asdict(sched).items() if v != defaults[k]}
        assert changed <= {"policy", "prefix_caching"}
    assert e2e.NONE.env() != e2e.ROWS[-1].env()


def test_workload_is_seeded_and_mixed() -> None:
    a, b = e2e.workload(40, 1), e2e.workload(40, 1)
    assert a == b
    assert a != e2e.workload(40, 2)
    kinds = {s.kind for s in a}
    assert kinds == {k for k, _ in e2e.MIX}
    for s in a:
        if s.kind in ("same-image", "multi-turn"):
            assert len(s.questions) == e2e.QUESTIONS_PER_IMAGE
            assert len({q.question for q in s.questions}) == len(s.questions)
        else:
            assert len(s.questions) == 1
        assert s.conversation == (s.kind == "multi-turn")
        large = s.questions[0].scenario in suite.DETAIL
        assert large == (s.kind == "large")
    media = [m for s in a for m in s.media]
    assert len(set(media)) == len(media)  # no two sessions share an image


def test_seed_table_arithmetic() -> None:
    base = {"visual_tokens": 100.0, "latency_p50_ms": 400.0, "req_per_s": 10.0}
    row = {"visual_tokens": 25.0, "latency_p50_ms": 100.0, "req_per_s": 30.0}
    vs = e2e.versus({**row, "accuracy_overall": 0.9}, {**base, "accuracy_overall": 0.95})
    assert vs == {
        "visual_tokens_change": -0.75,
        "latency_p50_speedup": 4.0,
        "req_per_s_speedup": 3.0,
        "accuracy_change_points": -5.0,
    }
    got = e2e.targets(vs)
    assert {k: t["met"] for k, t in got.items()} == {
        "visual_tokens_change": True,
        "latency_p50_speedup": True,
        "req_per_s_speedup": False,
        "accuracy_change_points": False,
    }


@pytest.mark.timeout(600)
def test_tiny_run_json(model_dir: Path, tmp_path: Path) -> None:
    """Every row on a 4-session workload (seed 4: a fine_detail and a compare image, a
    single question, a three-turn conversation)."""
    plot = tmp_path / "e2e.png"
    cmd = [sys.executable, "-m", "visor.cli", "bench", "e2e", "--model", str(model_dir)]
    cmd += ["--n", "4", "--seed", "4", "--rounds", "1", "--concurrency", "2", "--json"]
    cmd += ["--plot", str(plot), "--logs", str(tmp_path / "logs")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # one JSON object, nothing else on stdout
    requests = sum(len(s.questions) for s in e2e.workload(4, 4))
    assert out["workload"]["requests"] == requests
    rows = {r["name"]: r for r in out["rows"]}
    assert list(rows) == [r.name for r in e2e.ROWS]
    scenarios = {q.scenario for s in e2e.workload(4, 4) for q in s.questions}
    for r in rows.values():
        assert r["requests"] == requests and r["errors"] == 0
        assert r["visual_tokens"] > 0 and r["latency_p50_ms"] > 0 and r["req_per_s"] > 0
        assert set(r["accuracy"]) == scenarios
        assert all(0 <= v <= 1 for v in r["accuracy"].values())
    none = rows["none"]
    # What each switch changes shows in what the services report.
    assert rows["+dynamic resolution"]["visual_tokens"] < none["visual_tokens"]  # fine_detail
    assert rows["+compression"]["visual_tokens"] < 0.5 * none["visual_tokens"]
    assert none["cache_hits"] == 0 and rows["+token-budget batching"]["cache_hits"] == 0
    assert rows["+caches"]["cache_hits"] > 0 and rows["all"]["cache_hits"] > 0
    assert set(out["targets"]) == set(e2e.TARGETS)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

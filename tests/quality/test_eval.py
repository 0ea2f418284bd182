"""`visor eval`: reproduces the baseline of docs/quality.md on a held-out sample, reads a JSONL
suite, plots, and gives the same answers through a running gateway as in-process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.quality import evaluate, suite
from tests.conftest import ROOT, Stack

MODEL = ROOT / "models" / "demo"
BASELINE_N = 600  # 100 per scenario: one item is one point
PER_TILE = 64  # the demo encoder's visual tokens per tile
# Tiles per item of each scenario at each detail level (fine_detail: one 448 px image, a 2 x 2
# grid and its thumbnail where the question asks to read; compare: two 448 px images, one tile
# each for its colour question at `auto`).
TILES = {
    "low": {"fine_detail": 1, "compare": 2},
    "auto": {"fine_detail": 5, "compare": 2},
    "high": {"fine_detail": 5, "compare": 10},
}


def _mean_tokens(scenarios: list[str], level: str, kept: int = PER_TILE) -> float:
    """Mean visual tokens per item over `scenarios` (one per item) when each tile keeps `kept`."""
    tiles = [TILES[level].get(s, 1) for s in scenarios]
    return round(sum(tiles) * kept / len(tiles), 2)


def _eval(*args: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "visor.cli", "eval", "--json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1  # --json: one object, no progress bars
    result: dict[str, Any] = json.loads(lines[0])
    return result


def _documented_baseline() -> dict[str, float]:
    """The `none` row of the measured table in docs/quality.md, as fractions."""
    text = (ROOT / "docs" / "quality.md").read_text()
    text = text[text.index("\n## Measured") :]
    head = re.search(r"^\| setting \| visual tokens \| (.+) \| TTFT", text, re.M)
    row = re.search(r"^\| none \| [\d.]+ \| (.+?) \| [\d.]+ \|$", text, re.M)
    assert head and row, "docs/quality.md has no measured table with a `none` row"
    scenarios = [s.strip() for s in head.group(1).split("|")]
    values = [float(v) / 100 for v in row.group(1).split("|")]
    return dict(zip(scenarios, values, strict=True))


def test_committed_model_is_the_trained_one() -> None:
    block = json.loads((MODEL / "config.json").read_text())["visor_demo"]
    assert block["trained"] is True and block["steps"] > 0 and "seed" in block


def test_eval_reproduces_the_documented_baseline() -> None:
    result = _eval("--model", str(MODEL), "--profiles", "none", "--n", str(BASELINE_N))
    got = result["profiles"]["none"]
    expected = _documented_baseline()
    assert set(got["accuracy"]) == set(expected) == set(suite.SCENARIOS)
    for scenario, accuracy in expected.items():
        assert abs(got["accuracy"][scenario] - accuracy) <= 0.03, (scenario, got, expected)
    assert got["visual_tokens"] == _mean_tokens(list(suite.SCENARIOS), "auto")
    assert got["ttft_ms"] > 0
    assert result["suite"] == {"spec": "synthetic", "seed": 0, "n": BASELINE_N}


def _write_jsonl(folder: Path, n: int) -> Path:
    rows = []
    for i, it in enumerate(suite.items(suite.Split.EVAL, 9, n)):
        names = [f"img{i}-{k}.png" for k in range(len(it.images))]
        for name, png in zip(names, it.pngs(), strict=True):
            (folder / name).write_bytes(png)
        image: str | list[str] = names[0] if len(names) == 1 else names
        rows.append(
            {"image": image, "question": it.question, "answer": it.answer, "scenario": it.scenario}
        )
    path = folder / "cases.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_suite_matches_the_synthetic_path_and_plots(tmp_path: Path) -> None:
    cases = _write_jsonl(tmp_path, 8)  # the first 8 held-out items of seed 9, as files
    plot = tmp_path / "plot.png"
    result = _eval(
        "--model",
        str(MODEL),
        "--suite",
        f"jsonl:{cases}",
        "--profiles",
        "none,balanced",
        "--plot",
        str(plot),
    )
    same = _eval("--model", str(MODEL), "--seed", "9", "--n", "8", "--profiles", "none,balanced")
    none, balanced = result["profiles"]["none"], result["profiles"]["balanced"]
    assert set(none["accuracy"]) == set(suite.SCENARIOS)
    for name in ("none", "balanced"):  # files on disk answer exactly as the rendered items
        assert result["profiles"][name]["accuracy"] == same["profiles"][name]["accuracy"]
    scenarios = [suite.SCENARIOS[i % len(suite.SCENARIOS)] for i in range(8)]
    assert none["visual_tokens"] == _mean_tokens(scenarios, "auto")
    assert balanced["visual_tokens"] == _mean_tokens(scenarios, "auto", PER_TILE // 2)
    assert set(result["methods"]) == {*evaluate.SWEEP_METHODS, "pool"}
    attention = result["methods"]["attention"]["80"]["visual_tokens"]
    assert attention == _mean_tokens(scenarios, "auto", 13)
    assert result["methods"]["pool"]["75"]["visual_tokens"] == _mean_tokens(scenarios, "auto", 16)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_through_a_gateway_is_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "visor.cli", "eval", "--target", "127.0.0.1:1", "--sweep"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "in-process only" in done.stderr


@pytest.mark.timeout(300)
def test_target_path_answers_as_in_process(stack: Stack, tmp_path: Path) -> None:
    if Path(stack.env["VISOR_CORE_MODEL"]).resolve() != MODEL.resolve():
        pytest.skip("the stack serves a freshly built model, not the committed one")
    cases = _write_jsonl(tmp_path, 8)
    common = ("--suite", f"jsonl:{cases}", "--profiles", "none,balanced")
    remote = _eval("--target", stack.gateway, *common)
    local = _eval("--model", str(MODEL), *common)
    assert remote["via"] == stack.gateway and local["via"] == "in-process"
    for name in ("none", "balanced"):
        assert remote["profiles"][name]["accuracy"] == local["profiles"][name]["accuracy"]
        assert remote["profiles"][name]["visual_tokens"] == local["profiles"][name]["visual_tokens"]


def test_details_report_accuracy_and_visual_tokens_per_level() -> None:
    result = _eval(
        "--model", str(MODEL), "--n", "6", "--profiles", "", "--details", "low,auto,high"
    )
    assert result["profiles"] == {} and list(result["details"]) == ["low", "auto", "high"]
    for level, got in result["details"].items():
        assert set(got["accuracy"]) == set(suite.SCENARIOS)
        assert all(0 <= v <= 1 for v in got["accuracy"].values())
        assert got["visual_tokens"] == _mean_tokens(list(suite.SCENARIOS), level), level
    # The four encoder-sized scenarios are one tile at every level: same answers.
    for scenario in suite.SINGLE:
        assert len({r["accuracy"][scenario] for r in result["details"].values()}) == 1


def test_details_argument_is_checked() -> None:
    cmd = [sys.executable, "-m", "visor.cli", "eval", "--n", "1", "--details", "low,ultra"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "unknown detail" in done.stderr

"""`visor bench gateway --json` runs end to end and prints one JSON object with every path and
ratio (speed targets are judged from its output, never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import PIL

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gateway_prints_one_json_object() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "visor.cli", "bench", "gateway", "--json", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["bench"] == "gateway" and out["pillow"]["backend"] in ("pillow-simd", "Pillow")
    assert out["pillow"]["simd"] == str(out["pillow"]["backend"] == "pillow-simd").lower()
    # The reported build is the one whose files are loaded (both may be installed).
    assert out["pillow"]["version"].startswith(PIL.__version__ + " ")
    assert metadata.version(out["pillow"]["backend"]) == PIL.__version__
    for size in ("1080p", "4k"):
        row = out[size]
        for path in ("sandboxed", "a_in_process", "b_pillow_full"):
            assert row[path]["p50_ms"] > 0 and row[path]["images_per_s"] > 0
        assert "p50_ms" in row["c_djpeg"] or "skipped" in row["c_djpeg"]
        assert {"sandbox_overhead_vs_a", "speedup_a_vs_b"} <= set(row)

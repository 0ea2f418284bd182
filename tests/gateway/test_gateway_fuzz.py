"""A short, bounded fuzz run over sniff -> probe -> decode (part of `make test`; `make fuzz
SECONDS=N` runs the same harness for longer). Any exception that is not a typed refusal, a hang
past libFuzzer's per-input timeout or a native crash fails it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gateway import fuzz_media

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 15


def test_bounded_fuzz_run_finds_nothing(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.gateway.fuzz_media",
            "--seconds",
            str(SECONDS),
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS + 90,
        cwd=ROOT,
    )
    output = run.stdout + run.stderr
    found = sorted(
        p.name
        for p in tmp_path.iterdir()
        if p.name.split("-")[0] in ("crash", "timeout", "oom", "leak")
    )
    assert run.returncode == 0 and not found, (found, output[-3000:])
    assert "Done" in output or "mutation loop" in output, output[-3000:]
    seeds = {p.name for p in (tmp_path / "seeds").iterdir()}
    assert {"gen-rgb.jpg", "gen-anim.gif", "gen-h264.mp4"} <= seeds


def test_the_harness_accepts_its_seeds_and_refuses_garbage_cleanly() -> None:
    for name, data in fuzz_media.generated_seeds().items():
        fuzz_media.one_input(data)  # raises on anything but a clean decode or a typed refusal
        assert name
    for data in (b"", b"\xff\xd8\xff", b"\x1a\x45\xdf\xa3" * 8, b"\x00\x00\x00\x10ftypisom"):
        fuzz_media.one_input(data)

"""`visor model init-demo` from nothing: deterministic, loadable, llava-hf layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

from core.model import llava


def test_init_demo_builds_a_loadable_deterministic_checkpoint(tmp_path: Path) -> None:
    for name in ("a", "b"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "visor.cli",
                "model",
                "init-demo",
                "--out",
                str(tmp_path / name),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
    a, b = llava.load(tmp_path / "a"), llava.load(tmp_path / "b")
    assert a.encoder_digest() == b.encoder_digest()  # fixed seed: the same weights every time
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.embed_tokens.weight" in names  # public llava-hf layout
    assert "vision_tower.vision_model.embeddings.class_embedding" in names
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["model_type"] == "llava" and cfg["visor_demo"]["trained"] is False


def test_every_preset_names_what_build_reads() -> None:
    # The bench preset (650 MB, too big to build here) must carry every key the demo one does;
    # a key added to one preset only breaks `init-demo --preset bench` long after the change.
    from core.model import demo

    want = set(demo.PRESETS["demo"])
    for name, spec in demo.PRESETS.items():
        assert set(spec) == want, name
        assert set(spec["vision"]) == set(demo.PRESETS["demo"]["vision"]), name
        assert set(spec["text"]) == set(demo.PRESETS["demo"]["text"]), name

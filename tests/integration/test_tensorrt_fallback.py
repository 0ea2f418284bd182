"""A TensorRT encoder that cannot be had does not stop the core (issue 21, item 7): with the
`tensorrt` module made absent (a package on PYTHONPATH that fails to import, shadowing any real
one), a core asked for `encoder = "tensorrt"` logs one `tensorrt_fallback` line with its reason,
starts with the torch encoder and serves an image request through the gateway."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc

from tests.conftest import SAMPLES, start_stack, stop_stack
from tests.helpers import generate, request


def test_an_absent_tensorrt_falls_back_to_torch(model_dir: Path, tmp_path: Path) -> None:
    shadow = tmp_path / "no-tensorrt" / "tensorrt"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("TensorRT made absent by the test")\n')
    path = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH")) if p)
    stack = start_stack(model_dir, tmp_path, VISOR_CORE_ENCODER="tensorrt", PYTHONPATH=path)
    try:
        png = (SAMPLES / "shapes.png").read_bytes()
        out = generate(stack.gateway, request(media=(png,), max_new_tokens=2))
        assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
        assert out.final is not None and [c.hit for c in out.final.cache] == [False]
    finally:
        stop_stack(stack)
    text = (tmp_path / "core.log").read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    fallback = [r for r in lines if r.get("event") == "tensorrt_fallback"]
    assert len(fallback) == 1, text[-3000:]
    assert fallback[0]["level"] == "warning" and fallback[0]["backend"] == "torch"
    assert fallback[0]["reason"].startswith("tensorrt is not installed")
    started = [r for r in lines if r.get("event") == "core_started"]
    assert started and started[0]["backend"] == "torch", started
    assert "Traceback" not in text

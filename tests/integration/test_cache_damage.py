"""A damaged or unwritable feature cache disables itself (issue 24, item 7): the core starts, logs
one `feature_cache_disabled` line with a reason code (and no path), and serves requests through
the gateway with the cache off, instead of dying of SIGBUS or exiting with a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from tests.conftest import SAMPLES, start_stack, stop_stack
from tests.core.test_cache import truncated_cache
from tests.helpers import generate, request


def _damaged(kind: str, root: Path) -> Path:
    if kind == "truncated":
        truncated_cache(root / "cache")
        return root / "cache"
    (root / "not-a-directory").write_bytes(b"")  # tests run as root: chmod would not stop us
    return root / "not-a-directory" / "cache"


@pytest.mark.parametrize("kind,reason", [("truncated", "truncated"), ("unwritable", "unwritable")])
def test_a_damaged_cache_disables_itself_and_the_core_serves(
    model_dir: Path, tmp_path: Path, kind: str, reason: str
) -> None:
    path = _damaged(kind, tmp_path)
    stack = start_stack(model_dir, tmp_path, VISOR_CACHE_PATH=str(path))
    try:
        png = (SAMPLES / "shapes.png").read_bytes()
        for _ in range(2):  # the second one would hit a working cache
            out = generate(stack.gateway, request(media=(png,), max_new_tokens=2))
            assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
            assert out.final is not None and [c.hit for c in out.final.cache] == [False]
    finally:
        stop_stack(stack)
    text = (tmp_path / "core.log").read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    disabled = [r for r in lines if r.get("event") == "feature_cache_disabled"]
    assert len(disabled) == 1, text[-3000:]
    assert disabled[0]["reason"] == reason and disabled[0]["level"] == "error"
    assert str(path) not in text and "Traceback" not in text
    assert any(r.get("event") == "core_stopped" for r in lines)  # a clean stop, not a crash

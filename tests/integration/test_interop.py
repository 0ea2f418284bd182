"""A second toolchain (Node's grpc-js + proto-loader) builds a client from gateway.proto alone."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

from tests.conftest import ROOT, Stack

CLIENT = ROOT / "tests" / "interop" / "client.js"


def _fresh_png(folder: Path) -> Path:
    """An image no other test sent, so this request decodes and encodes (a cache miss) whatever
    ran before it on the shared stack."""
    pixels = np.random.default_rng().integers(0, 255, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    path = folder / "fresh.png"
    path.write_bytes(buf.getvalue())
    return path


def test_node_client_from_the_proto_alone(stack: Stack, tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node is not None, "Node.js is needed for the interop test"
    assert (CLIENT.parent / "node_modules" / "@grpc" / "grpc-js").exists(), (
        "tests/interop/node_modules missing: `make install` runs npm ci there"
    )
    image = _fresh_png(tmp_path)
    out = subprocess.run(
        [node, str(CLIENT), stack.gateway, str(image), "What?"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert "error" not in body, body
    final = body["final"]
    assert "".join(body["deltas"]) == final["text"]
    assert final["usage"]["visual_tokens_before"] == 64
    assert {"receive", "image_decode", "encode", "generate"} <= set(final["timings_ms"])
    denied = subprocess.run(
        [node, str(CLIENT), stack.gateway, str(image), "What?", "wrong"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(denied.stdout)["error"]["code"] == 16  # UNAUTHENTICATED

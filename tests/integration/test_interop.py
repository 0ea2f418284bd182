"""A second toolchain (Node's grpc-js + proto-loader) builds a client from gateway.proto alone."""

from __future__ import annotations

import json
import shutil
import subprocess

from tests.conftest import ROOT, SAMPLES, Stack

CLIENT = ROOT / "tests" / "interop" / "client.js"


def test_node_client_from_the_proto_alone(stack: Stack) -> None:
    node = shutil.which("node")
    assert node is not None, "Node.js is needed for the interop test"
    assert (CLIENT.parent / "node_modules" / "@grpc" / "grpc-js").exists(), (
        "tests/interop/node_modules missing: `make install` runs npm ci there"
    )
    out = subprocess.run(
        [node, str(CLIENT), stack.gateway, str(SAMPLES / "shapes.png"), "What?"],
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
        [node, str(CLIENT), stack.gateway, str(SAMPLES / "shapes.png"), "What?", "wrong"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(denied.stdout)["error"]["code"] == 16  # UNAUTHENTICATED

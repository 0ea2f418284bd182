"""The cache handshake end to end: hits skip decode, transfer and encode; tenants never share."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
from PIL import Image

from tests.conftest import OTHER_KEY, Stack
from tests.helpers import DEV_KEY, generate, metric, request

MISS_ONLY = {"image_decode", "preprocess", "transfer", "encode"}


def _unique_png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _tensor_bytes(stack: Stack) -> float:
    return metric(stack.core_metrics, "visor_core_tensor_bytes_total")


def _ask(stack: Stack, png: bytes, key: str, prompt: str = "What is it?") -> tuple[bool, set[str]]:
    out = generate(stack.gateway, request(prompt, media=(png,)), key=key)
    assert out.final is not None, (out.code, out.reason)
    return out.final.cache[0].hit, set(out.final.timings_ms)


def test_second_question_hits_and_skips_decode_transfer_encode(stack: Stack) -> None:
    png = _unique_png(1)
    hit, stages = _ask(stack, png, DEV_KEY, "What colour is it?")
    assert not hit and stages >= MISS_ONLY
    sent = _tensor_bytes(stack)
    hit, stages = _ask(stack, png, DEV_KEY, "How many shapes?")
    assert hit and not stages & MISS_ONLY and "cache_lookup" in stages
    assert _tensor_bytes(stack) == sent  # not one tensor byte crossed for the hit


def test_tenants_never_share_features(stack: Stack) -> None:
    png = _unique_png(2)
    assert not _ask(stack, png, DEV_KEY)[0]
    hit_b, _ = _ask(stack, png, OTHER_KEY)
    assert not hit_b  # tenant-b sending tenant dev's exact bytes: a miss
    hit_a, _ = _ask(stack, png, DEV_KEY)
    assert hit_a  # dev's own second request: a hit
    hit_b2, _ = _ask(stack, png, OTHER_KEY)
    assert hit_b2  # and tenant-b now has its own entry


def test_cache_cli_stats_and_purge(stack: Stack) -> None:
    png = _unique_png(3)
    _ask(stack, png, OTHER_KEY)
    env = {"VISOR_CACHE_PATH": stack.env["VISOR_CACHE_PATH"], "PATH": "/usr/bin:/bin"}

    def cli(*args: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, "-m", "visor.cli", "cache", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    stats = cli("stats")
    assert int(stats["entries"]) >= 1 and int(stats["bytes"]) > 0  # type: ignore[call-overload]
    assert "tenant-b" not in json.dumps(stats)
    removed = cli("purge", "--tenant", "tenant-b")
    assert int(removed["entries_removed"]) >= 1  # type: ignore[call-overload]
    hit, stages = _ask(stack, png, OTHER_KEY)
    assert not hit and stages >= MISS_ONLY  # purged: decoded and encoded again

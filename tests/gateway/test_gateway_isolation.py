"""The decode pool through running core + gateway processes: a repeat of bytes already seen runs
no probe job, a request's decode time is bounded as a whole, and a client that cancels during a
decode costs no worker and leaves nothing but JSON lines in the gateway's log."""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from shared.proto import gateway_pb2_grpc
from tests.conftest import OTHER_KEY, Stack, start_stack, stop_stack
from tests.gateway.test_gateway_hostile import assert_workers_steady, gateway_children
from tests.helpers import DEV_KEY, generate, request

BUDGET_S = 1.0  # decode_timeout_s of the stack that checks the per-request budget
NUM_SLOW = 16  # items in its slow request (max_items raised to allow it)


@functools.cache
def _slow_png() -> bytes:
    """7680 x 4320 (the default max_pixels), a few hundred ms to decode, ~100 KB to send."""
    ramp = (np.arange(7680, dtype=np.uint16) * 7 // 211).astype(np.uint8)
    pixels = np.ascontiguousarray(np.broadcast_to(ramp[None, :, None], (4320, 7680, 3)))
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _variant(png: bytes, tag: str) -> bytes:
    """The same pixels with a distinct text chunk: other bytes, so another content hash."""
    body = b"Comment\x00" + f"{tag}-{os.getpid()}-{time.time_ns()}".encode()
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body
    chunk += struct.pack(">I", zlib.crc32(b"tEXt" + body))
    return png[:33] + chunk + png[33:]  # right after IHDR


def _small_png(seed: int) -> bytes:
    rng = np.random.default_rng(seed + os.getpid())
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _json_lines(log: Path, offset: int = 0) -> list[dict[str, object]]:
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode()
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pytest.fail(f"a log line that is not JSON: {line[:200]!r}")
    return out


def _workers(stack: Stack) -> set[int]:
    return {pid for pid, state in gateway_children(stack.gateway_proc.pid) if state != "Z"}


def test_repeated_bytes_run_no_probe_job_and_a_cache_hit_no_job_at_all(stack: Stack) -> None:
    png = _small_png(2401)
    first = generate(stack.gateway, request("What is it?", media=(png,)))
    assert first.final is not None, (first.code, first.reason)
    assert {"probe", "image_decode"} <= set(first.final.timings_ms)
    again = generate(stack.gateway, request("And its colour?", media=(png,)))
    assert again.final is not None and again.final.cache[0].hit
    assert not {"probe", "image_decode"} & set(again.final.timings_ms)
    # Probe results are kept per tenant: another tenant's first sight of the bytes is probed.
    other = generate(stack.gateway, request("What is it?", media=(png,)), key=OTHER_KEY)
    assert other.final is not None and "probe" in other.final.timings_ms


def test_a_cancel_during_decode_keeps_every_worker_and_the_log_json(stack: Stack) -> None:
    log = stack.logs / "gateway.log"
    offset = log.stat().st_size
    assert_workers_steady(stack)
    before = _workers(stack)
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for delay in (0.05, 0.15, 0.3):  # before, during and after the decode job starts
            req = request(media=(_variant(_slow_png(), f"cancel-{delay}"),))
            call = stub.Generate(req, metadata=[("authorization", f"Bearer {DEV_KEY}")])
            time.sleep(delay)
            call.cancel()
    time.sleep(1.5)  # any job still running finishes in the background and is dropped
    assert _workers(stack) == before  # no worker was killed for a cancel
    out = generate(stack.gateway, request(media=(_small_png(2402),)))
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason)
    events = [line.get("event") for line in _json_lines(log, offset)]
    assert not {"decoder_crashed", "decode_timeout", "loop_error"} & set(events), events


@pytest.fixture(scope="module")
def tight_stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        model_dir,
        tmp_path_factory.mktemp("tight"),
        VISOR_GATEWAY_DECODE_TIMEOUT_S=str(BUDGET_S),
        VISOR_LIMITS_MAX_ITEMS=str(NUM_SLOW),
    )
    yield s
    stop_stack(s)


def test_a_request_of_many_slow_items_is_cut_off_within_one_budget(tight_stack: Stack) -> None:
    """Sixteen items of a few hundred ms each on two workers: each one alone is well inside
    decode_timeout_s (a budget per job would serve them all), together they are far past it."""
    media = tuple(_variant(_slow_png(), f"budget-{i}") for i in range(NUM_SLOW))
    t0 = time.monotonic()
    out = generate(tight_stack.gateway, request(media=media), timeout=60)
    elapsed = time.monotonic() - t0
    assert out.reason == "DECODE_TIMEOUT", (out.code, out.reason, out.message)
    assert out.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < BUDGET_S + 2.5, elapsed  # not a budget per item
    assert_workers_steady(tight_stack)  # the cut-off workers were replaced
    small = generate(tight_stack.gateway, request(media=(_small_png(2403),)))
    assert small.code == grpc.StatusCode.OK, (small.code, small.reason)
    _json_lines(tight_stack.logs / "gateway.log")

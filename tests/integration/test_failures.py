"""Failure paths that need their own stack: core down and back, a hung core, deadlines
mid-generation."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import SAMPLES, Stack, start_stack, stop_stack
from tests.helpers import Outcome, generate, metric, request


@pytest.fixture()
def own_stack(model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    s = start_stack(model_dir, tmp_path)
    yield s
    stop_stack(s)


def test_core_down_then_back(own_stack: Stack) -> None:
    png = (SAMPLES / "shapes.png").read_bytes()
    assert generate(own_stack.gateway, request(media=(png,))).code == grpc.StatusCode.OK
    time.sleep(0.5)  # the feature write runs in the background after the answer
    own_stack.core_proc.kill()  # SIGKILL: no graceful shutdown, no cache flush
    own_stack.core_proc.wait(10)
    down = generate(own_stack.gateway, request(media=(png,)), timeout=10)
    assert (down.code, down.reason) == (grpc.StatusCode.UNAVAILABLE, "CORE_UNAVAILABLE")
    own_stack.restart_core()
    deadline = time.monotonic() + 15
    while True:  # the gateway reconnects on its own within its back-off (at most 2 s)
        out = generate(own_stack.gateway, request(media=(png,)), timeout=10)
        if out.code == grpc.StatusCode.OK or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason)
    assert out.final is not None and out.final.cache[0].hit  # the LMDB entry survived the kill
    assert own_stack.gateway_proc.poll() is None  # the gateway was never restarted


@pytest.fixture()
def long_stack(model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    s = start_stack(model_dir, tmp_path, VISOR_LIMITS_MAX_NEW_TOKENS="4096")
    yield s
    stop_stack(s)


def test_deadline_mid_generation_stops_the_core(long_stack: Stack) -> None:
    own_stack = long_stack
    before = metric(own_stack.core_metrics, "visor_core_cancelled_generations_total")
    long_req = request("Tell a long story.", max_new_tokens=4000, min_new_tokens=4000)
    out = generate(own_stack.gateway, long_req, timeout=3.0)  # 4000 tokens take ~9 s here
    assert out.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert out.deltas, "generation had started streaming before the deadline"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (
            metric(own_stack.core_metrics, "visor_core_cancelled_generations_total") > before
            and metric(own_stack.core_metrics, "visor_core_active_generations") == 0
        ):
            break
        time.sleep(0.1)
    assert metric(own_stack.core_metrics, "visor_core_cancelled_generations_total") == before + 1
    assert metric(own_stack.core_metrics, "visor_core_active_generations") == 0
    tokens = metric(own_stack.core_metrics, "visor_core_generated_tokens_total")
    time.sleep(0.5)
    assert (
        metric(own_stack.core_metrics, "visor_core_generated_tokens_total") == tokens
    )  # nothing runs on


@pytest.fixture()
def hang_stack(model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    env = {"VISOR_GATEWAY_CORE_ATTEMPT_TIMEOUT_S": "1.0", "VISOR_LIMITS_MAX_NEW_TOKENS": "4096"}
    s = start_stack(model_dir, tmp_path, **env)
    yield s
    stop_stack(s)


def _timed(stack: Stack, req: object, timeout: float = 30.0) -> tuple[Outcome, float]:
    t0 = time.monotonic()
    out = generate(stack.gateway, req, timeout=timeout)  # type: ignore[arg-type]
    return out, time.monotonic() - t0


def test_a_hung_core_fails_fast_and_long_answers_outlive_the_attempt_timeout(
    hang_stack: Stack,
) -> None:
    """SIGSTOP leaves the core's socket open but nothing answers: a new request must get
    CORE_UNAVAILABLE within about core_attempt_timeout_s (1 s), far below its 30 s deadline,
    both before and after the health loop notices; a long answer is not cut by that timeout."""
    png = (SAMPLES / "shapes.png").read_bytes()
    # 3000 tokens: several seconds at the demo model's speed here, whatever the load
    long_req = request("Tell a long story.", max_new_tokens=3000, min_new_tokens=3000)
    long, elapsed = _timed(hang_stack, long_req, timeout=60)
    assert long.code == grpc.StatusCode.OK, (long.code, long.reason)
    assert elapsed > 2.0, elapsed  # tokens flowed well past the 1 s attempt timeout
    os.kill(hang_stack.core_proc.pid, signal.SIGSTOP)
    try:
        unnoticed, first_s = _timed(hang_stack, request(media=(png,)))
        time.sleep(3.0)  # the health loop (every 2 s, 1 s timeout) marks it down
        noticed, second_s = _timed(hang_stack, request(media=(png,)))
    finally:
        os.kill(hang_stack.core_proc.pid, signal.SIGCONT)
    for out, took in ((unnoticed, first_s), (noticed, second_s)):
        assert (out.code, out.reason) == (grpc.StatusCode.UNAVAILABLE, "CORE_UNAVAILABLE"), out
        assert took < 4.0, took
    assert "core_down" in (hang_stack.logs / "gateway.log").read_text()
    deadline = time.monotonic() + 15
    while (back := generate(hang_stack.gateway, request(media=(png,)))).code != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, (back.code, back.reason)
        time.sleep(0.2)

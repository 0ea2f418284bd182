"""gRPC hardening through a real gateway process (attached to the session's core): per-tenant
concurrency and rate quotas, the default deadline for a client that sends none, message and
metadata size limits, and a full decode queue, each a clean status + reason."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from shared import procs
from shared.proto import gateway_pb2_grpc
from tests.conftest import OTHER_KEY, Stack, free_port
from tests.helpers import DEV_KEY, Outcome, generate, request

LONG = {"max_new_tokens": 4000, "min_new_tokens": 4000}  # seconds of streaming (demo model)


@contextmanager
def gateway(stack: Stack, tmp_path: Path, **env: str) -> Iterator[str]:
    """A second gateway in front of the session's core, with `env` overrides."""
    listen = f"127.0.0.1:{free_port()}"
    full = {**stack.env, "VISOR_GATEWAY_LISTEN": listen, "VISOR_GATEWAY_DECODE_WORKERS": "1"}
    full["VISOR_LIMITS_MAX_NEW_TOKENS"] = "4096"
    proc = procs.start("gateway", {**full, **env}, stack.logs / "visor.toml", tmp_path / "gw.log")
    try:
        procs.wait_healthy(listen, proc, timeout_s=60)
        yield listen
    finally:
        procs.stop(proc)
    assert proc.returncode == 0  # a clean shutdown after everything below


def _stream_until_first_token(target: str, started: threading.Event, out: list[Outcome]) -> None:
    deltas: list[str] = []
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = stub.Generate(
            request("Tell a story.", **LONG),
            metadata=[("authorization", f"Bearer {DEV_KEY}")],
            timeout=60,
        )
        for event in call:
            if event.WhichOneof("kind") == "delta":
                deltas.append(event.delta.text)
                started.set()
    out.append(Outcome(deltas, None, grpc.StatusCode.OK, "", ""))


def test_per_tenant_concurrency_quota(stack: Stack, tmp_path: Path) -> None:
    with gateway(stack, tmp_path, VISOR_GATEWAY_MAX_CONCURRENT_PER_TENANT="1") as gw:
        started, done = threading.Event(), []
        first = threading.Thread(target=_stream_until_first_token, args=(gw, started, done))
        first.start()
        assert started.wait(30), "the first request never streamed"
        second = generate(gw, request("me too"))
        other = generate(gw, request("another tenant"), key=OTHER_KEY)
        first.join(60)
        assert (second.code, second.reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "QUOTA_EXCEEDED",
        )
        assert "max_concurrent_per_tenant" in second.message
        assert other.code == grpc.StatusCode.OK  # the cap is per tenant
        assert done and done[0].deltas  # the first one was served in full
        assert generate(gw, request("after")).code == grpc.StatusCode.OK  # the slot is free again


def test_per_tenant_rate_quota(stack: Stack, tmp_path: Path) -> None:
    env = {"VISOR_GATEWAY_RATE_PER_TENANT": "0.2", "VISOR_GATEWAY_BURST_PER_TENANT": "2"}
    with gateway(stack, tmp_path, **env) as gw:
        codes = [generate(gw, request("hi", max_new_tokens=1)) for _ in range(3)]
        assert [o.code for o in codes[:2]] == [grpc.StatusCode.OK] * 2
        assert (codes[2].code, codes[2].reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "QUOTA_EXCEEDED",
        )
        assert "rate_per_tenant" in codes[2].message
        assert (
            generate(gw, request("hi", max_new_tokens=1), key=OTHER_KEY).code == grpc.StatusCode.OK
        )


def test_default_deadline_applies_when_the_client_sends_none(stack: Stack, tmp_path: Path) -> None:
    with gateway(stack, tmp_path, VISOR_GATEWAY_DEFAULT_DEADLINE_S="1.0") as gw:
        t0 = time.monotonic()
        out = generate(gw, request("Tell a long story.", **LONG), timeout=None)  # type: ignore[arg-type]
        elapsed = time.monotonic() - t0
        assert out.code == grpc.StatusCode.DEADLINE_EXCEEDED, (out.code, out.reason, elapsed)
        assert out.reason == "DEADLINE_EXCEEDED"
        assert elapsed < 10
        ok = generate(gw, request("short", max_new_tokens=2), timeout=None)  # type: ignore[arg-type]
        assert ok.code == grpc.StatusCode.OK


def test_message_and_metadata_size_limits_are_clean(stack: Stack, tmp_path: Path) -> None:
    env = {"VISOR_LIMITS_MAX_ITEM_BYTES": str(1 << 20)}
    with gateway(stack, tmp_path, **env) as gw:
        too_big = generate(gw, request(media=(b"\xff\xd8\xff" + b"\x00" * (5 << 20),)))
        assert too_big.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's 4 MiB message cap
        over_item = generate(gw, request(media=(b"\xff\xd8\xff" + b"\x00" * (2 << 20),)))
        assert (over_item.code, over_item.reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "MEDIA_TOO_LARGE",
        )
        assert "max_item_bytes" in over_item.message
        with grpc.insecure_channel(gw) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            metadata = [("authorization", f"Bearer {DEV_KEY}"), ("x-pad", "p" * (64 << 10))]
            try:
                list(stub.Generate(request("hi"), metadata=metadata, timeout=10))
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
        assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL), code
        assert generate(gw, request("still serving", max_new_tokens=2)).code == grpc.StatusCode.OK


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_a_full_decode_queue_is_overloaded(stack: Stack, tmp_path: Path) -> None:
    """One worker, a queue of one: a request whose three items are probed at once has one job
    running, one waiting and one refused, so it is OVERLOADED; the queue then drains."""
    env = {"VISOR_GATEWAY_MAX_DECODE_QUEUE": "1"}
    with gateway(stack, tmp_path, **env) as gw:
        out = generate(gw, request(media=tuple(_png(i) for i in range(3)), max_new_tokens=1))
        assert (out.code, out.reason) == (grpc.StatusCode.UNAVAILABLE, "OVERLOADED")
        assert "retry" in out.message
        one = generate(gw, request(media=(_png(7),), max_new_tokens=1))
        assert one.code == grpc.StatusCode.OK, (one.code, one.reason)

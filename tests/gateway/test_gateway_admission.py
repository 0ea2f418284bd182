"""Admission and receiving through a real gateway process (in front of the session's core):
stalled uploads end at the idle timeout and at the deadline, count against the tenant's
concurrency quota from the moment they open, and against the gateway's caps on bytes held by
unfinished uploads and on requests in flight (OVERLOADED with ErrorInfo); malformed bytes are
refused after authentication; `visor_gateway_requests_total` counts each outcome once, right."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from gateway.server import QUIET_UPLOADS_S
from shared import procs
from shared.proto import gateway_pb2
from tests.conftest import OTHER_KEY, Stack, free_port
from tests.gateway.test_gateway_hardening import gateway
from tests.helpers import DEV_KEY, Outcome, _reason, generate, request
from visor.client import Client

UPLOAD = "/visor.v1.Gateway/GenerateUpload"
GENERATE = "/visor.v1.Gateway/Generate"
KIB = 1024


def _auth(key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key is not None else []


def _header(num_media: int = 1) -> bytes:
    req = request("What is this?", media=(b"",) * num_media, max_new_tokens=1)
    return gateway_pb2.UploadMessage(request=req).SerializeToString()


def _chunk(data: bytes) -> bytes:
    piece = gateway_pb2.MediaChunk(media_index=0, data=data)
    return gateway_pb2.UploadMessage(chunk=piece).SerializeToString()


def _outcome(call: Iterator[bytes]) -> Outcome:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return Outcome([], None, exc.code(), _reason(exc), exc.details() or "")
    return Outcome([], None, grpc.StatusCode.OK, "", "")


class Upload:
    """A raw GenerateUpload whose messages are bytes: it sends `messages`, then (unless told to
    `trickle`) holds the stream open without sending until closed."""

    def __init__(
        self,
        channel: grpc.Channel,
        messages: list[bytes],
        key: str | None = DEV_KEY,
        timeout: float | None = 60.0,
        trickle: Callable[[], bytes] | None = None,
    ) -> None:
        self._release = threading.Event()
        self._messages, self._trickle = messages, trickle
        call = channel.stream_stream(UPLOAD, request_serializer=None, response_deserializer=None)
        self.call = call(self._send(), metadata=_auth(key), timeout=timeout)

    def _send(self) -> Iterator[bytes]:
        yield from self._messages
        while self._trickle is not None and not self._release.wait(0.3):
            yield self._trickle()
        self._release.wait(120)

    def outcome(self) -> Outcome:
        return _outcome(self.call)

    def close(self) -> None:
        self.call.cancel()
        self._release.set()


@contextmanager
def stalled(target: str, count: int, messages: list[bytes], key: str = DEV_KEY) -> Iterator[None]:
    """`count` uploads that send `messages` and then stall; cancelled on exit."""
    with grpc.insecure_channel(target) as channel:
        uploads = [Upload(channel, messages, key) for _ in range(count)]
        time.sleep(1.0)  # let the gateway admit them (and count their bytes)
        try:
            yield
        finally:
            for upload in uploads:
                upload.close()


def test_a_stalled_upload_ends_at_the_idle_timeout(stack: Stack, tmp_path: Path) -> None:
    with gateway(stack, tmp_path, VISOR_GATEWAY_UPLOAD_IDLE_TIMEOUT_S="1.0") as gw:
        with grpc.insecure_channel(gw) as channel:
            t0 = time.monotonic()
            upload = Upload(channel, [_header(), _chunk(b"\x89PNG")], timeout=30)
            out = upload.outcome()
            elapsed = time.monotonic() - t0
            upload.close()
        assert (out.code, out.reason) == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "DEADLINE_EXCEEDED",
        ), out
        assert "upload_idle_timeout_s" in out.message
        assert 0.9 < elapsed < 5, elapsed  # far below the client's 30 s deadline


def test_a_trickling_upload_ends_at_the_default_deadline(stack: Stack, tmp_path: Path) -> None:
    """A chunk every 0.3 s beats the idle timeout; the deadline still bounds the whole receive,
    also when the client sends no deadline of its own."""
    env = {"VISOR_GATEWAY_UPLOAD_IDLE_TIMEOUT_S": "1.0", "VISOR_GATEWAY_DEFAULT_DEADLINE_S": "2.0"}
    with gateway(stack, tmp_path, **env) as gw:
        with grpc.insecure_channel(gw) as channel:
            t0 = time.monotonic()
            messages = [_header(), _chunk(b"\x89PNG")]
            upload = Upload(channel, messages, timeout=None, trickle=lambda: _chunk(b"\0" * 64))
            out = upload.outcome()
            elapsed = time.monotonic() - t0
            upload.close()
        assert (out.code, out.reason) == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "DEADLINE_EXCEEDED",
        ), out
        assert "deadline" in out.message and "upload_idle_timeout_s" not in out.message
        assert 1.9 < elapsed < 6, elapsed


def test_stalled_uploads_count_against_the_tenant_quota(stack: Stack, tmp_path: Path) -> None:
    with gateway(stack, tmp_path, VISOR_GATEWAY_MAX_CONCURRENT_PER_TENANT="2") as gw:
        with stalled(gw, 2, [_header()]):
            mine = generate(gw, request("me too", max_new_tokens=1))
            other = generate(gw, request("another tenant", max_new_tokens=1), key=OTHER_KEY)
        assert (mine.code, mine.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
        assert "max_concurrent_per_tenant" in mine.message
        assert other.code == grpc.StatusCode.OK, other
        deadline = time.monotonic() + 10  # the cancelled uploads give their slots back
        while (
            again := generate(gw, request("again", max_new_tokens=1))
        ).code != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, again
            time.sleep(0.2)


def test_bytes_held_by_unfinished_uploads_are_capped(stack: Stack, tmp_path: Path) -> None:
    env = {
        "VISOR_LIMITS_MAX_ITEM_BYTES": str(1024 * KIB),
        "VISOR_LIMITS_MAX_REQUEST_BYTES": str(1024 * KIB),
        "VISOR_GATEWAY_MAX_UPLOAD_BYTES_IN_FLIGHT": str(1280 * KIB),
    }
    half = [_header(), *(_chunk(b"\0" * 256 * KIB) for _ in range(3))]  # 768 KiB, then stalls
    with gateway(stack, tmp_path, **env) as gw:
        with stalled(gw, 1, half), grpc.insecure_channel(gw) as channel:
            second = Upload(channel, half, key=OTHER_KEY)
            out = second.outcome()
            second.close()
        assert (out.code, out.reason) == (grpc.StatusCode.UNAVAILABLE, "OVERLOADED"), out
        assert "max_upload_bytes_in_flight" in out.message
        # The cancelled uploads gave their bytes back: 768 + 512 KiB fit under the cap.
        with stalled(gw, 1, half), grpc.insecure_channel(gw) as channel:
            third = Upload(channel, half[:3], key=OTHER_KEY)
            time.sleep(1.0)
            third.close()
            assert third.outcome().code == grpc.StatusCode.CANCELLED  # not refused: we closed it


def test_the_gateway_in_flight_cap_is_overloaded_with_error_info(
    stack: Stack, tmp_path: Path
) -> None:
    with gateway(stack, tmp_path, VISOR_GATEWAY_MAX_REQUESTS_IN_FLIGHT="3") as gw:
        with stalled(gw, 3, [_header()]):
            out = generate(gw, request("one more", max_new_tokens=1), key=OTHER_KEY)
        assert (out.code, out.reason) == (grpc.StatusCode.UNAVAILABLE, "OVERLOADED"), out
        assert "max_requests_in_flight" in out.message
        deadline = time.monotonic() + 10
        while (
            again := generate(gw, request("again", max_new_tokens=1))
        ).code != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, again
            time.sleep(0.2)


@pytest.mark.parametrize(
    ("key", "code", "reason"),
    [
        (DEV_KEY, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"),
        (None, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
        ("wrong-key", grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
    ],
)
def test_malformed_bytes_are_refused_after_authentication(
    stack: Stack, key: str | None, code: grpc.StatusCode, reason: str
) -> None:
    garbage = b"\xff\xff\xff\xff\xff"
    with grpc.insecure_channel(stack.gateway) as channel:
        unary = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
        inline = _outcome(unary(garbage, metadata=_auth(key), timeout=10))
        first = Upload(channel, [garbage], key=key, timeout=10)
        later = Upload(channel, [_header(), garbage], key=key, timeout=10)
        outcomes = [inline, first.outcome(), later.outcome()]
        first.close()
        later.close()
    for out in outcomes:
        assert (out.code, out.reason) == (code, reason), out
    if key == DEV_KEY:
        assert "does not parse" in inline.message
    assert generate(stack.gateway, request("still serving", max_new_tokens=1)).code == (
        grpc.StatusCode.OK
    )


def _outcomes(metrics: str) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    prefix = 'visor_gateway_requests_total{outcome="'
    out = {}
    for line in body.splitlines():
        if line.startswith(prefix):
            label, value = line[len(prefix) :].split('"} ')
            out[label] = float(value)
    return out


def _counted(metrics: str, before: dict[str, float], want: dict[str, float]) -> dict[str, float]:
    """Waits (a cancel is counted when the gateway notices it) until the counter moved by at
    least `want`; returns how much every outcome moved."""
    deadline = time.monotonic() + 10
    while True:
        now = _outcomes(metrics)
        moved = {k: v - before.get(k, 0.0) for k, v in now.items() if v != before.get(k, 0.0)}
        if all(moved.get(k, 0.0) >= v for k, v in want.items()) or time.monotonic() > deadline:
            time.sleep(0.3)  # nothing else may arrive late
            now = _outcomes(metrics)
            return {k: v - before.get(k, 0.0) for k, v in now.items() if v != before.get(k, 0.0)}
        time.sleep(0.1)


def test_requests_total_counts_each_outcome_once(stack: Stack, tmp_path: Path) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    with gateway(stack, tmp_path, VISOR_GATEWAY_METRICS_LISTEN=metrics) as gw:
        before = _outcomes(metrics)
        assert generate(gw, request("hi", max_new_tokens=2)).code == grpc.StatusCode.OK
        assert _counted(metrics, before, {"ok": 1}) == {"ok": 1}

        before = _outcomes(metrics)  # a client that closes as soon as it has the final event
        with Client(gw, DEV_KEY, timeout=30) as client:
            for _ in range(5):
                client.ask("hi", max_new_tokens=2)
        assert _counted(metrics, before, {"ok": 5}) == {"ok": 5}

        before = _outcomes(metrics)
        refused = generate(gw, request("x" * (64 * KIB), max_new_tokens=1))
        assert refused.reason == "PROMPT_TOO_LONG"
        assert _counted(metrics, before, {"PROMPT_TOO_LONG": 1}) == {"PROMPT_TOO_LONG": 1}

        before = _outcomes(metrics)
        with grpc.insecure_channel(gw) as channel:
            unary = channel.unary_stream(GENERATE, response_deserializer=None)
            long = request("Tell a story.", max_new_tokens=4000, min_new_tokens=4000)
            call = unary(long.SerializeToString(), metadata=_auth(DEV_KEY), timeout=60)
            next(call)  # the first token streamed
            call.cancel()
        assert _counted(metrics, before, {"cancelled": 1}) == {"cancelled": 1}


def _rss_kib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))


def _settled_rss_kib(pid: int) -> float:
    """The least RSS over a second and a half: the refused streams' transport buffers are freed
    as gRPC tears the streams down, a moment after their statuses reach the client (a sample
    taken then can read 100 MB more than the next); bytes kept stay in every sample."""
    samples = []
    for _ in range(15):
        samples.append(_rss_kib(pid))
        time.sleep(0.1)
    return min(samples)


def test_refused_uploads_get_their_reason_and_do_not_keep_their_bytes(
    stack: Stack, tmp_path: Path
) -> None:
    """An upload refused while the client is still sending gets MEDIA_TOO_LARGE with ErrorInfo
    (not gRPC's reset of a stream closed under its writes: the gateway drains for a moment), and
    the refused bytes are freed: after a warm-up, more rounds of refusals leave the gateway's RSS
    where it was (kept bytes would add 20 MiB a refusal; the allocator's own plateau does not
    grow), and once uploads stop for `QUIET_UPLOADS_S` the RSS is back where it started."""
    listen = f"127.0.0.1:{free_port()}"
    env = {**stack.env, "VISOR_GATEWAY_LISTEN": listen, "VISOR_GATEWAY_DECODE_WORKERS": "1"}
    proc = procs.start("gateway", env, stack.logs / "visor.toml", tmp_path / "gw.log")
    piece = bytes(256 * KIB)
    oversize = [_header(), *[_chunk(piece)] * (24 * 4)]  # 24 MiB against max_item_bytes' 20 MiB
    rss: list[float] = []
    try:
        procs.wait_healthy(listen, proc, timeout_s=60)
        before = _settled_rss_kib(proc.pid) / 1024
        with grpc.insecure_channel(listen) as channel:
            for _ in range(5):
                uploads = [Upload(channel, oversize) for _ in range(8)]
                outcomes = [u.outcome() for u in uploads]
                for u in uploads:
                    u.close()
                assert [o.reason for o in outcomes] == ["MEDIA_TOO_LARGE"] * 8, outcomes
                rss.append(_settled_rss_kib(proc.pid) / 1024)
        time.sleep(QUIET_UPLOADS_S + 1.0)  # uploads have stopped: the gateway trims its heap
        after = _settled_rss_kib(proc.pid) / 1024
    finally:
        procs.stop(proc)
    # Rounds 3 to 5: 24 refusals, ~480 MB if their bytes were kept. While uploads keep coming
    # the heap keeps the pages a round freed, for the next round (reached by the warm-up rounds).
    assert rss[-1] - max(rss[:2]) < 120, f"gateway RSS after each round (MB): {rss}"
    # Once they stop, it hands them back: the gateway is where it was before the first upload.
    assert after - before < 32, f"RSS before uploads {before:.0f} MB, after them {after:.0f} MB"

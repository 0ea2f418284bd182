"""Video through the running gateway: MP4/WebM with H.264, VP9 and AV1 decoded in the sandboxed
workers, sampled frames as image items, header limits, and containers that point elsewhere
refused without any connection being made. Videos are generated here with PyAV's encoders."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway import video
from gateway.sniff import sniff
from shared import procs
from shared.errors import Reason, VisorError
from tests.conftest import Stack, free_port
from tests.gateway import videos
from tests.gateway.test_gateway_hostile import assert_workers_steady
from tests.helpers import generate, request

TOKENS_PER_ITEM = 64  # one 224 px tile of 28 px patches


class Listener:
    """A TCP listener on loopback that records every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    out = Listener()
    yield out
    out.close()


@pytest.mark.parametrize("kind", sorted(videos.CODECS))
def test_a_short_video_yields_one_item_per_sampled_frame(stack: Stack, kind: str) -> None:
    # 3 s at 10 fps, sampled at [limits] video_sample_fps = 1: frames at 0.5, 1.5 and 2.5 s.
    data = videos.video(kind, seconds=3.0, fps=10, size=(96 + len(kind), 64))
    out = generate(stack.gateway, request(media=(data,)), timeout=60)
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
    assert out.final is not None
    assert len(out.final.cache) == 3
    assert [c.hit for c in out.final.cache] == [False] * 3
    assert out.final.usage.visual_tokens_before == 3 * TOKENS_PER_ITEM
    assert {"image_decode", "preprocess", "transfer"} <= set(out.final.timings_ms)


def test_sampling_is_capped_at_max_sampled_frames(stack: Stack) -> None:
    data = videos.video("vp9-webm", seconds=20.0, fps=2, size=(48, 32))
    out = generate(stack.gateway, request(media=(data,)), timeout=60)
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
    assert out.final is not None and len(out.final.cache) == 8  # not 20


def test_a_video_longer_than_the_limit_is_a_frame_limit(stack: Stack) -> None:
    data = videos.video("h264-mp4", seconds=70.0, fps=2, size=(32, 32))  # limit: 60 s
    out = generate(stack.gateway, request(media=(data,)), timeout=60)
    assert (out.code, out.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "FRAME_LIMIT")
    assert "max_video_duration_s" in out.message


def test_too_many_streams_is_a_frame_limit(stack: Stack) -> None:
    data = videos.video("h264-mp4", seconds=1.0, extra_streams=4)  # 5 streams, limit 4
    out = generate(stack.gateway, request(media=(data,)), timeout=60)
    assert (out.code, out.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "FRAME_LIMIT")
    assert "max_video_streams" in out.message


def test_a_codec_outside_the_allow_list_is_unsupported(stack: Stack) -> None:
    out = generate(stack.gateway, request(media=(videos.mpeg4_video(),)), timeout=60)
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "UNSUPPORTED_FORMAT")


EXTERNAL = {
    "mp4-external-data-ref": (videos.mp4_with_external_ref, "UNSUPPORTED_FORMAT"),
    "hls-m3u8": (videos.hls_playlist, "UNSUPPORTED_FORMAT"),
    "ffconcat": (videos.ffconcat, "UNSUPPORTED_FORMAT"),
    "m3u8-behind-mp4-magic": (videos.playlist_behind_mp4_magic, "CORRUPT_MEDIA"),
    "m3u8-behind-webm-magic": (videos.playlist_behind_webm_magic, "CORRUPT_MEDIA"),
}


@pytest.mark.parametrize("name", sorted(EXTERNAL))
def test_a_container_pointing_elsewhere_is_refused_without_a_connection(
    stack: Stack, listener: Listener, name: str
) -> None:
    make, reason = EXTERNAL[name]
    out = generate(stack.gateway, request(media=(make(listener.url),)), timeout=60)
    assert out.reason == reason, (out.code, out.reason, out.message)
    assert listener.url not in out.message and "127.0.0.1" not in out.message
    assert listener.connections == 0
    # FFmpeg's own log (which would print the URL) stays off: nothing of it reaches a log line.
    assert listener.url.split("//")[1] not in (stack.logs / "gateway.log").read_text()
    assert_workers_steady(stack)  # a clean refusal: no worker was killed for it


def test_video_switched_off_is_unsupported(stack: Stack, tmp_path: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    env = {**stack.env, "VISOR_GATEWAY_LISTEN": listen, "VISOR_GATEWAY_VIDEO": "false"}
    env["VISOR_GATEWAY_DECODE_WORKERS"] = "1"
    proc = procs.start("gateway", env, stack.logs / "visor.toml", tmp_path / "gateway.log")
    try:
        procs.wait_healthy(listen, proc, timeout_s=60)
        for kind in ("h264-mp4", "vp9-webm"):
            out = generate(listen, request(media=(videos.video(kind, seconds=1.0),)))
            assert (out.code, out.reason) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "UNSUPPORTED_FORMAT",
            ), kind
            assert "MP4" not in out.message  # the allowed list no longer names video
        ok = generate(listen, request("text still works"))
        assert ok.code == grpc.StatusCode.OK
    finally:
        procs.stop(proc)


def test_max_video_frames_is_a_frame_limit(stack: Stack, tmp_path: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    env = {**stack.env, "VISOR_GATEWAY_LISTEN": listen, "VISOR_GATEWAY_DECODE_WORKERS": "1"}
    env["VISOR_LIMITS_MAX_VIDEO_FRAMES"] = "20"
    proc = procs.start("gateway", env, stack.logs / "visor.toml", tmp_path / "gateway.log")
    try:
        procs.wait_healthy(listen, proc, timeout_s=60)
        for kind in ("h264-mp4", "vp9-webm"):  # MP4 declares its frames; WebM only a rate
            over = generate(listen, request(media=(videos.video(kind, seconds=3.0, fps=10),)))
            assert (over.code, over.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "FRAME_LIMIT")
            assert "max_video_frames" in over.message, kind
        under = generate(listen, request(media=(videos.video("vp9-webm", seconds=1.5, fps=10),)))
        assert under.code == grpc.StatusCode.OK, (under.code, under.reason)
    finally:
        procs.stop(proc)


def test_sample_times_follow_the_rate_up_to_the_cap() -> None:
    lim = video.VideoLimits(60.0, 4, 3600, 1.0, 8)
    assert video.sample_times(3.0, lim) == (0.5, 1.5, 2.5)
    assert len(video.sample_times(20.0, lim)) == 8
    assert video.sample_times(0.2, lim) == (0.1,)  # a clip shorter than one period: one frame
    spread = video.sample_times(40.0, lim)
    assert spread[0] == 2.5 and spread[-1] == 37.5


def test_external_reference_detection() -> None:
    assert not video.has_external_refs(videos.video("h264-mp4", seconds=1.0))
    assert video.has_external_refs(videos.mp4_with_external_ref("http://example.invalid/a"))
    assert not video.has_external_refs(b"\x00\x00\x00\x08moov" * 3)  # malformed: FFmpeg decides


def test_sniffing_video() -> None:
    mp4, webm = videos.video("h264-mp4", seconds=1.0), videos.video("vp9-webm", seconds=1.0)
    assert (sniff(mp4), sniff(webm)) == ("MP4", "WEBM")
    heif = struct.pack(">I4s4sI", 24, b"ftyp", b"heic", 0) + b"mif1heic"
    for data, video_on in ((mp4, False), (webm, False), (heif, True)):
        with pytest.raises(VisorError) as info:
            sniff(data, video_on)
        assert info.value.reason is Reason.UNSUPPORTED_FORMAT

"""Video (MP4 / WebM) probe and frame sampling through PyAV, run only inside a decode worker.

Bytes are read from memory with the one demuxer the sniffer's format allows (never FFmpeg's
guess, so no HLS, concat, image2 or other demuxer that opens further URLs); any nested open a
demuxer attempts goes to a callback that refuses it; MP4 external data references are refused
before FFmpeg sees the file. Demuxer and decoder names are checked against allow-lists, and the
duration, stream count, frame count and frame size come from the header before any frame is
decoded. Decoding is single-threaded: one job per worker, and the seccomp filter forbids clone().
"""

from __future__ import annotations

import contextlib
import io
import math
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from gateway import decode
from shared.errors import Reason, VisorError

try:  # the gateway extra ships PyAV; without it video is UNSUPPORTED_FORMAT
    import av
    import av.logging

    # FFmpeg's log would print paths and URLs from the file: PyAV's default ignores it all.
    av.logging.set_level(None)
    HAS_AV = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_AV = False

# Sniffed format -> the one FFmpeg demuxer forced for it (checked again once opened).
DEMUXERS = {"MP4": "mov", "WEBM": "matroska"}
# Software decoders FFmpeg picks for H.264, VP9 and AV1 (dav1d; "av1" is FFmpeg's own).
DECODERS = frozenset({"h264", "vp9", "libvpx-vp9", "libdav1d", "av1"})
# mov: never follow a data reference to another file, never resolve absolute paths.
MOV_OPTIONS = {"enable_drefs": "0", "use_absolute_path": "0"}
MAX_BOXES = 4096  # boxes walked when looking for data references
CONTAINER_BOXES = (b"moov", b"trak", b"mdia", b"minf", b"dinf")


@dataclass(frozen=True, slots=True)
class VideoLimits:
    """The [limits] a video is held to (crosses the pipe as JSON)."""

    max_duration_s: float  # declared duration
    max_streams: int  # streams of any kind in the container
    max_frames: int  # declared (and then decoded) frames of the video stream
    sample_fps: float  # frames sampled per second of video
    max_samples: int  # cap on sampled frames, one core item each

    def to_json(self) -> dict[str, Any]:
        return {
            "max_duration_s": self.max_duration_s,
            "max_streams": self.max_streams,
            "max_frames": self.max_frames,
            "sample_fps": self.sample_fps,
            "max_samples": self.max_samples,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> VideoLimits:
        return VideoLimits(
            float(d["max_duration_s"]),
            int(d["max_streams"]),
            int(d["max_frames"]),
            float(d["sample_fps"]),
            int(d["max_samples"]),
        )


@dataclass(frozen=True, slots=True)
class Header:
    """What the container declares about its video stream."""

    width: int  # coded frame width
    height: int  # coded frame height
    duration_s: float  # declared duration
    rate: float  # declared frames per second (0 when unknown)


def _refuse_nested_open(url: str, flags: int, options: dict[str, Any]) -> Any:
    raise PermissionError("nested opens are not allowed")


def sample_times(duration_s: float, lim: VideoLimits) -> tuple[float, ...]:
    """`sample_fps` frames per second, spread evenly over the whole video when that is more than
    `max_samples`; each time is the middle of its slice (never past the end)."""
    n = max(1, min(lim.max_samples, math.floor(duration_s * lim.sample_fps)))
    return tuple((i + 0.5) * duration_s / n for i in range(n))


def has_external_refs(data: bytes) -> bool:
    """True when an MP4 `dref` entry lacks the self-contained flag: its samples live in another
    file or URL. Walks moov/trak/mdia/minf/dinf only, with a bound on boxes."""
    budget = [MAX_BOXES]
    return any(_dref_external(data[a:b]) for a, b in _find(data, 0, len(data), budget, b"dref"))


def _find(
    data: bytes, start: int, end: int, budget: list[int], kind: bytes
) -> Iterator[tuple[int, int]]:
    pos = start
    while pos + 8 <= end and budget[0] > 0:
        budget[0] -= 1
        size, box = struct.unpack(">I4s", data[pos : pos + 8])
        header = 8
        if size == 1 and pos + 16 <= end:
            size, header = struct.unpack(">Q", data[pos + 8 : pos + 16])[0], 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            return  # a malformed box: FFmpeg decides what the rest is worth
        if box == kind:
            yield pos + header, pos + size
        elif box in CONTAINER_BOXES:
            yield from _find(data, pos + header, pos + size, budget, kind)
        pos += size


def _dref_external(body: bytes) -> bool:
    if len(body) < 8:
        return False
    (count,) = struct.unpack(">I", body[4:8])
    pos = 8
    for _ in range(min(count, MAX_BOXES)):
        if pos + 12 > len(body):
            return False
        size = struct.unpack(">I", body[pos : pos + 4])[0]
        flags = int.from_bytes(body[pos + 9 : pos + 12], "big")
        if not flags & 1:  # 1 = "media data is in the same file"
            return True
        if size < 12:
            return False
        pos += size
    return False


def _open(data: bytes, fmt: str) -> Any:
    if not HAS_AV or fmt not in DEMUXERS:
        raise VisorError(Reason.UNSUPPORTED_FORMAT, "video is not supported by this gateway")
    if fmt == "MP4" and has_external_refs(data):
        raise VisorError(
            Reason.UNSUPPORTED_FORMAT,
            "the video refers to external data; only self-contained files are allowed",
        )
    options = MOV_OPTIONS if fmt == "MP4" else {}
    with decode.refusals("media could not be parsed"):
        container = av.open(
            io.BytesIO(data),
            "r",
            format=DEMUXERS[fmt],
            container_options=options,
            io_open=_refuse_nested_open,
        )
    if container.format.name != DEMUXERS[fmt]:
        container.close()
        raise VisorError(Reason.UNSUPPORTED_FORMAT, "the container format is not allowed")
    return container


def _video_stream(container: Any, lim: VideoLimits) -> Any:
    if len(container.streams) > lim.max_streams:
        raise VisorError(
            Reason.FRAME_LIMIT, f"the video has more than max_video_streams ({lim.max_streams})"
        )
    if not container.streams.video:
        raise VisorError(Reason.CORRUPT_MEDIA, "the container holds no video stream")
    stream = container.streams.video[0]
    ctx = stream.codec_context  # None when FFmpeg has no decoder for the codec at all
    if ctx is None or ctx.name not in DECODERS:
        raise VisorError(
            Reason.UNSUPPORTED_FORMAT, "the video codec is not allowed; allowed: H.264, VP9, AV1"
        )
    return stream


def _header(
    container: Any, stream: Any, lim: VideoLimits, max_pixels: int, max_side: int
) -> Header:
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    decode.check_pixels(width, height, max_pixels, max_side)
    if stream.duration and stream.time_base:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        duration = container.duration / 1_000_000  # AV_TIME_BASE
    else:
        raise VisorError(
            Reason.FRAME_LIMIT,
            "the video declares no duration, so max_video_duration_s cannot be checked",
        )
    if not 0 < duration <= lim.max_duration_s:
        raise VisorError(
            Reason.FRAME_LIMIT,
            f"the video is longer than max_video_duration_s ({lim.max_duration_s:g})",
        )
    rate = float(stream.average_rate or stream.guessed_rate or 0)
    declared = int(stream.frames) or math.ceil(duration * rate)
    if declared > lim.max_frames:
        raise VisorError(
            Reason.FRAME_LIMIT, f"the video has more than max_video_frames ({lim.max_frames})"
        )
    return Header(width, height, duration, rate)


@contextlib.contextmanager
def _parsing(container: Any) -> Iterator[None]:
    """Closes the container; anything FFmpeg or PyAV raises that is not a refusal of ours is
    corrupt media (only the exception's type name is kept, for the log)."""
    try:
        with decode.refusals("media could not be decoded"):
            yield
    finally:
        container.close()


def probe(data: bytes, fmt: str, lim: VideoLimits, max_pixels: int, max_side: int) -> decode.Probe:
    """Header values only; `num_frames` is the number of frames that will be sampled, and
    `starts_s` their sample times."""
    container = _open(data, fmt)
    with _parsing(container):
        stream = _video_stream(container, lim)
        head = _header(container, stream, lim, max_pixels, max_side)
    times = sample_times(head.duration_s, lim)
    return decode.Probe(head.width, head.height, len(times), times)


def _frames(
    container: Any, stream: Any, lim: VideoLimits, spec: decode.Spec
) -> Iterator[tuple[float, Any]]:
    """(seconds from the stream's start, frame) in presentation order. A header can lie, so each
    frame's size is checked again (a stream may change resolution midway) and the frames are
    counted against max_video_frames."""
    stream.codec_context.thread_count = 1  # frame threads would need clone()
    start = float(stream.start_time * stream.time_base) if stream.start_time else 0.0
    for count, frame in enumerate(container.decode(stream), 1):
        if count > lim.max_frames:
            raise VisorError(
                Reason.FRAME_LIMIT, f"the video has more than max_video_frames ({lim.max_frames})"
            )
        decode.check_pixels(frame.width, frame.height, spec.max_pixels, spec.max_side)
        yield (float(frame.time) - start if frame.time is not None else 0.0), frame


def _rgb(frame: Any) -> Image.Image:
    return Image.fromarray(frame.to_ndarray(format="rgb24", threads=1), "RGB")


def decode_video(data: bytes, spec: decode.Spec, lim: VideoLimits) -> decode.Decoded:
    """Decodes up to the last wanted sample time and keeps, for each wanted sample, the first
    frame at or after it (the last frame when the stream ends early)."""
    t0 = time.perf_counter()
    container = _open(data, spec.fmt)
    with _parsing(container):
        stream = _video_stream(container, lim)
        head = _header(container, stream, lim, spec.max_pixels, spec.max_side)
        times = sample_times(head.duration_s, lim)
        wanted = sorted({i for i in spec.frames if 0 <= i < len(times)})
        if len(wanted) != len(set(spec.frames)):
            raise VisorError(Reason.INVALID_REQUEST, "a sampled frame index is out of range")
        picked: dict[int, Image.Image] = {}
        last: Any = None
        for t, frame in _frames(container, stream, lim, spec):
            last = frame
            while wanted and t >= times[wanted[0]]:
                picked[wanted.pop(0)] = _rgb(frame)
            if not wanted:
                break
        if last is None:
            raise VisorError(Reason.CORRUPT_MEDIA, "the video holds no decodable frame")
        for i in wanted:
            picked[i] = _rgb(last)
    t1 = time.perf_counter()
    items = tuple(decode.preprocess(picked[i], spec) for i in spec.frames)
    return decode.Decoded(items, (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000)


def sample(
    codec: str = "libx264",
    fmt: str = "mp4",
    seconds: float = 1.0,
    fps: int = 10,
    size: tuple[int, int] = (64, 48),
) -> bytes:
    """A small generated video, decoded once by `warm`."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(max(1, round(seconds * fps))):
            shade = np.full((size[1], size[0], 3), (i * 23) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(shade, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def warm() -> None:
    """Opens and decodes one H.264/MP4 and one VP9/WebM before seccomp is loaded, so that FFmpeg's
    lazily initialised tables and CPU detection are done while files may still be opened."""
    if not HAS_AV:
        return
    lim = VideoLimits(10.0, 2, 100, 2.0, 2)
    for codec, fmt, sniffed in (("libx264", "mp4", "MP4"), ("libvpx-vp9", "webm", "WEBM")):
        data = sample(codec, fmt)
        p = probe(data, sniffed, lim, 1 << 20, 1 << 10)
        spec = decode.Spec(
            sniffed, 16, (0, 0, 0), 1, 1, tuple(range(p.num_frames)), 1 << 20, 1 << 10
        )
        decode_video(data, spec, lim)

"""Test videos generated with PyAV's own encoders (libx264, libvpx-vp9, SVT-AV1 in its wheel),
and hostile containers that point at external URLs. Nothing here is a committed binary."""

from __future__ import annotations

import io
import os
import struct

import av
import numpy as np

# Quiet SVT-AV1's banner on stderr (errors still shown).
os.environ.setdefault("SVT_LOG", "1")

CODECS = {  # name -> (encoder, muxer)
    "h264-mp4": ("libx264", "mp4"),
    "vp9-webm": ("libvpx-vp9", "webm"),
    "av1-mp4": ("libsvtav1", "mp4"),
}


def video(
    kind: str = "h264-mp4",
    seconds: float = 3.0,
    fps: int = 10,
    size: tuple[int, int] = (64, 48),
    extra_streams: int = 0,
) -> bytes:
    """A video whose frame i is grey level (i * 23) % 256, plus `extra_streams` more video
    streams carrying the same frames."""
    encoder, muxer = CODECS[kind]
    buf = io.BytesIO()
    with av.open(buf, "w", format=muxer) as out:
        streams = [out.add_stream(encoder, rate=fps) for _ in range(1 + extra_streams)]
        for stream in streams:
            stream.width, stream.height = size
            stream.pix_fmt = "yuv420p"
            if encoder == "libsvtav1":
                stream.options = {"preset": "12"}
        for i in range(round(seconds * fps)):
            shade = np.full((size[1], size[0], 3), (i * 23) % 256, np.uint8)
            for stream in streams:
                for packet in stream.encode(av.VideoFrame.from_ndarray(shade, format="rgb24")):
                    out.mux(packet)
        for stream in streams:
            for packet in stream.encode():
                out.mux(packet)
    return buf.getvalue()


def mpeg4_video() -> bytes:
    """MPEG-4 Part 2 in MP4: a container we accept holding a codec we do not."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height = 64, 48
        stream.pix_fmt = "yuv420p"
        for _ in range(10):
            frame = av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _boxes(data: bytes, start: int, end: int) -> list[tuple[int, int, bytes]]:
    out, pos = [], start
    while pos + 8 <= end:
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        out.append((pos, size, kind))
        pos += size
    return out


def mp4_with_external_ref(url: str) -> bytes:
    """An H.264 MP4 whose data reference says its samples live at `url` (a `url ` entry without
    the self-contained flag), with every enclosing box size fixed up. The muxer writes `moov`
    after `mdat`, so growing it moves no sample offset."""
    data = bytearray(video("h264-mp4"))
    path = (b"moov", b"trak", b"mdia", b"minf", b"dinf", b"dref")
    parents, start, end = [], 0, len(data)
    for kind in path:
        pos, size, _ = next(b for b in _boxes(bytes(data), start, end) if b[2] == kind)
        parents.append(pos)
        start, end = pos + 8, pos + size
    dref = parents[-1]
    entry = dref + 16  # after the dref header, version/flags and entry count
    old_size = struct.unpack(">I", data[entry : entry + 4])[0]
    location = url.encode() + b"\x00"
    new_entry = struct.pack(">I4sI", 12 + len(location), b"url ", 0) + location
    data[entry : entry + old_size] = new_entry
    grow = len(new_entry) - old_size
    for pos in parents:
        size = struct.unpack(">I", data[pos : pos + 4])[0]
        data[pos : pos + 4] = struct.pack(">I", size + grow)
    return bytes(data)


def hls_playlist(url: str) -> bytes:
    return (
        "#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:2\n"
        f"#EXTINF:2.0,\n{url}/segment0.ts\n#EXT-X-ENDLIST\n"
    ).encode()


def ffconcat(url: str) -> bytes:
    return f"ffconcat version 1.0\nfile '{url}/clip.mp4'\n".encode()


def playlist_behind_mp4_magic(url: str) -> bytes:
    """An HLS playlist behind an MP4 `ftyp` box: the sniffer says MP4, so only the MP4 demuxer
    ever sees it (FFmpeg's HLS demuxer would have fetched the URL)."""
    return struct.pack(">I4s4sI", 16, b"ftyp", b"isom", 0) + hls_playlist(url)


def playlist_behind_webm_magic(url: str) -> bytes:
    return b"\x1a\x45\xdf\xa3" + hls_playlist(url)

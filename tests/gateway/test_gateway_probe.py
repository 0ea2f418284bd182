"""Header-only probes, in a real sandboxed worker: EXIF orientation and animation frames are read
from headers, so media whose pixel data is broken still probes (a probe that decoded pixels would
fail or see nothing), and a GIF's frame walk stops past the frame limit."""

from __future__ import annotations

import asyncio
import io
import struct
import zlib
from collections.abc import Iterator

import pytest
from PIL import Image

from gateway import headers
from gateway.decode import ORIENTATION_TAG, Spec
from gateway.pool import DecodePool, PoolSettings
from shared.errors import Reason, VisorError
from tests.gateway import hostile

MIB = 1024 * 1024
LIMITS = {"max_pixels": 7680 * 4320, "max_side": 16384, "max_frames": 64}


class Worker:
    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.pool = DecodePool(PoolSettings(1, 10.0, 1000, 1 << 25, 1024 * MIB, 8 * MIB, 8))
        self.runner.run(self.pool.start())

    def probe(self, data: bytes, fmt: str) -> tuple[int, int, int]:
        body = self.runner.run(self.pool.run("probe", {**LIMITS, "fmt": fmt}, data)).body
        return body["width"], body["height"], body["num_frames"]

    def decode(self, data: bytes, fmt: str) -> None:
        spec = Spec(fmt, 32, (0, 0, 0), 1, 1, (0,), LIMITS["max_pixels"], LIMITS["max_side"])
        self.runner.run(self.pool.run("decode", spec.to_json(), data))


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.pool.close()
    w.runner.close()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _with_exif_after_the_pixels(png: bytes, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = orientation
    iend = png.rindex(b"IEND") - 4
    return png[:iend] + _chunk(b"eXIf", exif.tobytes()) + png[iend:]


def _break_first_idat(png: bytes) -> bytes:
    """Overwrites the compressed pixels after their zlib header (chunk CRC kept valid)."""
    start = png.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", png[start : start + 4])
    body = (b"\x78\x9c" + bytes(range(256)) * (length // 256 + 1))[:length]
    return png[:start] + _chunk(b"IDAT", body) + png[start + 12 + length :]


def test_png_orientation_comes_from_metadata_after_the_pixels_without_decoding_them(
    worker: Worker,
) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4000, 3000), (9, 99, 199)).save(buf, "PNG")
    rotated = _with_exif_after_the_pixels(buf.getvalue(), 6)
    assert worker.probe(rotated, "PNG") == (3000, 4000, 1)  # upright size: width and height swap
    broken = _break_first_idat(rotated)
    with pytest.raises(VisorError) as info:
        worker.decode(broken, "PNG")
    assert info.value.reason is Reason.CORRUPT_MEDIA  # its pixels really cannot be decoded
    # The probe never touches them: it still reads the orientation stored after them.
    assert worker.probe(broken, "PNG") == (3000, 4000, 1)


def test_png_orientation_from_xmp_matches_what_the_decoder_applies(worker: Worker) -> None:
    xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="8"/></x:xmpmeta>'
    buf = io.BytesIO()
    Image.new("RGB", (40, 30)).save(buf, "PNG")
    png = buf.getvalue()
    iend = png.rindex(b"IEND") - 4
    tagged = png[:iend] + _chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + xmp)
    tagged += png[iend:]
    assert worker.probe(tagged, "PNG") == (30, 40, 1)
    with Image.open(io.BytesIO(tagged)) as img:
        img.load()
        assert img.getexif()[ORIENTATION_TAG] == 8  # Pillow's own reading after a full decode


def test_apng_frames_are_counted_from_headers_without_decoding_them(worker: Worker) -> None:
    apng = hostile.animated("PNG", 5, size=64)
    assert worker.probe(apng, "PNG") == (64, 64, 5)
    # Garbage inside every frame's compressed data (CRCs fixed up): seeking through the frames
    # would have to decode them; the headers say all the probe needs.
    out, pos = bytearray(apng[:8]), 8
    while pos < len(apng):
        (length,) = struct.unpack(">I", apng[pos : pos + 4])
        kind, body = apng[pos + 4 : pos + 8], apng[pos + 8 : pos + 8 + length]
        if kind == b"fdAT":
            body = body[:4] + b"\x78\x9c" + b"\xff" * (length - 6)
        out += _chunk(kind, body)
        pos += 12 + length
    assert worker.probe(bytes(out), "PNG") == (64, 64, 5)


def test_an_apng_frame_outside_its_canvas_is_refused_by_the_probe(worker: Worker) -> None:
    apng = bytearray(hostile.animated("PNG", 3, size=16))
    pos = apng.rindex(b"fcTL")  # the last frame: x offset 100 on a 16 px canvas
    apng[pos + 16 : pos + 20] = struct.pack(">I", 100)
    apng[pos + 30 : pos + 34] = struct.pack(">I", zlib.crc32(bytes(apng[pos : pos + 30])))
    with pytest.raises(VisorError) as info:
        worker.probe(bytes(apng), "PNG")
    assert info.value.reason is Reason.CORRUPT_MEDIA


def test_gif_frame_walk_stops_past_the_frame_limit() -> None:
    many = hostile.gif_with_frames(100_000)
    walked = headers.gif_frames(many, 64)
    assert walked.num_frames == 65  # one past the limit is enough to refuse; the rest is unread
    assert headers.gif_frames(hostile.gif_with_frames(3), 64).num_frames == 3
    far = headers.gif_frames(hostile.gif_frame_outside_canvas(), 64)
    assert (far.num_frames, far.width, far.height) == (2, 61000, 61000)


@pytest.mark.parametrize(
    ("name", "make", "fmt", "reason"),
    [
        ("gif-100000-frames", lambda: hostile.gif_with_frames(100_000), "GIF", "FRAME_LIMIT"),
        ("gif-frame-outside-canvas", hostile.gif_frame_outside_canvas, "GIF", "PIXEL_LIMIT"),
        ("apng-100-frames", lambda: hostile.animated("PNG", 100), "PNG", "FRAME_LIMIT"),
        ("webp-100-frames", lambda: hostile.animated("WEBP", 100), "WEBP", "FRAME_LIMIT"),
    ],
)
def test_frame_and_extent_limits_hold_in_the_worker(
    worker: Worker, name: str, make: object, fmt: str, reason: str
) -> None:
    with pytest.raises(VisorError) as info:
        worker.probe(make(), fmt)  # type: ignore[operator]
    assert info.value.reason.value == reason, name


def test_animations_probe_to_their_frame_counts(worker: Worker) -> None:
    assert worker.probe(hostile.animated("GIF", 5), "GIF") == (16, 16, 5)
    assert worker.probe(hostile.animated("WEBP", 5), "WEBP") == (16, 16, 5)
    assert worker.probe(hostile.gif_with_frames(3), "GIF") == (1, 1, 3)

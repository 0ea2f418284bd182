"""Generators of hostile media, built in memory from first principles (no corpus needed)."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import numpy as np
from PIL import Image


def jpeg(width: int = 64, height: int = 48, smooth: bool = False, **save: object) -> bytes:
    buf = io.BytesIO()
    if smooth:  # small scans: the file stays small however many scans it repeats
        ramp = np.linspace(0, 255, width, dtype=np.uint8)
        pixels = np.broadcast_to(ramp[None, :, None], (height, width, 3)).copy()
    else:
        pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(buf, "JPEG", **save)
    return buf.getvalue()


def jpeg_declaring(width: int, height: int) -> bytes:
    """A real small JPEG whose SOF header is patched to claim `width` x `height`."""
    data = bytearray(jpeg())
    i = 2
    while i < len(data):
        marker, length = data[i + 1], struct.unpack(">H", data[i + 2 : i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2):
            data[i + 5 : i + 9] = struct.pack(">HH", height, width)
            return bytes(data)
        i += 2 + length
    raise AssertionError("no SOF segment")


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG header claiming `width` x `height` with a few bytes of image data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def png_text_bomb(inflated: int = 64 * 1024 * 1024) -> bytes:
    """A valid 1x1 PNG with a zTXt chunk that inflates to `inflated` bytes."""
    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    ztxt = b"Comment\x00\x00" + zlib.compress(b"A" * inflated, 9)
    idat = zlib.compress(b"\x00\x00\x00\x00")
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"zTXt", ztxt)
        + _chunk(b"IDAT", idat)
        + _chunk(b"IEND", b"")
    )


def png(width: int = 32, height: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


def truncated_png() -> bytes:
    data = png(256, 256)
    return data[: len(data) // 2]


def gif_with_frames(num_frames: int) -> bytes:
    """A 1x1 GIF with `num_frames` one-pixel frames, written block by block."""
    header = b"GIF89a" + struct.pack("<HHBBB", 1, 1, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    loop = b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
    frame = (
        b"\x21\xf9\x04\x00\x01\x00\x00\x00"  # graphic control: 10 ms
        + b"\x2c"
        + struct.pack("<HHHHB", 0, 0, 1, 1, 0)
        + b"\x02\x02\x44\x01\x00"  # LZW min code 2, one sub-block, terminator
    )
    return header + loop + frame * num_frames + b"\x3b"


def animated_gif(num_frames: int, size: int = 32) -> bytes:
    frames = [Image.new("P", (size, size), i % 256) for i in range(num_frames)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=40, loop=0)
    return buf.getvalue()


def progressive_with_scans(num_scans: int) -> bytes:
    """A progressive JPEG whose last refinement scan is repeated until there are `num_scans`
    scans: libjpeg re-runs a coefficient pass for each one."""
    data = jpeg(2048, 2048, smooth=True, progressive=True, quality=90)
    body, tail = data[:-2], data[-2:]
    starts = [i for i in range(len(body) - 1) if body[i : i + 2] == b"\xff\xda"]
    chunks = [body[a:b] for a, b in zip(starts, [*starts[1:], len(body)], strict=True)]
    smallest = min(chunks, key=len)  # a scan (with any tables before the next) kept valid
    return body + smallest * max(0, num_scans - len(chunks)) + tail


def jpeg_with_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("payload.txt", "not for the decoder")
    return jpeg() + buf.getvalue()


def gif_declaring(width: int, height: int) -> bytes:
    """A one-frame GIF whose logical screen claims `width` x `height` (tiny body)."""
    header = (
        b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00" * 3 + b"\xff" * 3
    )
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"
    return header + frame + b"\x3b"


def gif_frame_outside_canvas() -> bytes:
    """A 4x4 GIF whose second frame sits at (60000, 60000) with a 1000 x 1000 extent."""
    header = b"GIF89a" + struct.pack("<HHBBB", 4, 4, 0x80, 0, 0) + b"\x00" * 3 + b"\xff" * 3
    first = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0) + b"\x02\x02\x44\x01\x00"
    far = b"\x2c" + struct.pack("<HHHHB", 60000, 60000, 1000, 1000, 0) + b"\x02\x02\x44\x01\x00"
    return header + first + far + b"\x3b"


def png_broken_zlib() -> bytes:
    """A PNG whose IDAT stream is garbage after a valid zlib header."""
    ihdr = struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0)
    idat = b"\x78\x9c" + bytes(range(256)) * 4
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def png_chunk_past_the_file() -> bytes:
    """A valid PNG with a tEXt chunk whose length field points 2 GiB past the end."""
    data = png(8, 8)
    bogus = struct.pack(">I", 0x7FFFFFF0) + b"tEXt" + b"Comment\x00x"
    return data[:33] + bogus + data[33:]


def animated(fmt: str, num_frames: int, size: int = 16) -> bytes:
    """Distinct noise frames, so that no encoder merges any two of them."""
    rng = np.random.default_rng(num_frames)
    frames = [
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
        for _ in range(num_frames)
    ]
    buf = io.BytesIO()
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=40)
    return buf.getvalue()


def other_format(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (1, 2, 3)).save(buf, fmt)
    return buf.getvalue()

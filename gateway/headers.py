"""What an image declares, read without decoding a pixel: a PNG's metadata chunks and APNG frame
controls wherever they sit in the file (Pillow reads the ones after the image data only by
decoding it), a GIF's frames and their extents, and every animation's frame delays (GIF graphic
controls, APNG frame controls, WebP ANMF chunks).

Runs only inside a decode worker: these walk untrusted bytes. Each walk reads chunk or block
headers only and is linear in the file; a GIF walk stops one frame past the caller's limit. A
malformed structure ends the walk quietly: the decoder, which parses everything, refuses it then.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Chunks Pillow takes EXIF orientation from: eXIf, a "Raw profile type exif" text, or XMP.
PNG_META = frozenset({b"eXIf", b"tEXt", b"zTXt", b"iTXt"})
GIF_EXTENSION, GIF_IMAGE, GIF_TRAILER = 0x21, 0x2C, 0x3B
GIF_GRAPHIC_CONTROL = 0xF9  # the extension that holds the next frame's delay


@dataclass(frozen=True, slots=True)
class PngHeaders:
    meta: tuple[bytes, ...]  # PNG_META chunks, whole, in file order (CRC recomputed)
    frames: tuple[tuple[int, int, int, int], ...]  # each fcTL's (width, height, x, y)
    delays: tuple[float, ...] = ()  # each fcTL's delay in seconds (delay_num / delay_den)


@dataclass(frozen=True, slots=True)
class GifFrames:
    num_frames: int  # image blocks found, counting no further than the limit + 1
    width: int  # the canvas grown to every counted frame's extents, as Pillow grows it
    height: int
    delays: tuple[int, ...] = ()  # per counted frame, its graphic control's delay (1/100 s)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def read_png(data: bytes) -> PngHeaders:
    meta: list[bytes] = []
    frames: list[tuple[int, int, int, int]] = []
    delays: list[float] = []
    pos = len(PNG_SIGNATURE)
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        end = pos + 8 + length
        if end + 4 > len(data) or kind == b"IEND":
            break
        body = data[pos + 8 : end]
        if kind in PNG_META:
            meta.append(_chunk(kind, body))
        elif kind == b"fcTL" and length >= 26:
            width, height, x, y, num, den = struct.unpack(">IIIIHH", body[4:24])
            frames.append((width, height, x, y))
            delays.append(num / (den or 100))  # a zero denominator means 1/100 s (APNG spec)
        pos = end + 4  # past the CRC
    return PngHeaders(tuple(meta), tuple(frames), tuple(delays))


# A 1x1 greyscale PNG around borrowed metadata chunks (see `png_stand_in`).
_STAND_IN_HEAD = PNG_SIGNATURE + _chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
_STAND_IN_TAIL = _chunk(b"IDAT", zlib.compress(b"\x00\x00")) + _chunk(b"IEND", b"")


def png_stand_in(meta: tuple[bytes, ...]) -> bytes:
    """A one-pixel PNG carrying these metadata chunks: Pillow reads its EXIF orientation as it
    would read the real image's after a full decode, for the price of one pixel."""
    return _STAND_IN_HEAD + b"".join(meta) + _STAND_IN_TAIL


def gif_frames(data: bytes, limit: int) -> GifFrames:
    """Counts image blocks the way Pillow seeks them (extension and image data sub-blocks are
    skipped by their length bytes, a stray byte is stepped over, the trailer ends it) without
    decompressing anything."""
    width, height, flags = struct.unpack("<HHB", data[6:11])
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    num_frames, delay = 0, 0
    delays: list[int] = []
    while pos < len(data) and num_frames <= limit:
        block = data[pos]
        if block == GIF_TRAILER:
            break
        if block == GIF_EXTENSION:
            if data[pos + 1 : pos + 3] == bytes((GIF_GRAPHIC_CONTROL, 4)) and pos + 6 <= len(data):
                delay = int.from_bytes(data[pos + 4 : pos + 6], "little")
            pos = _skip_sub_blocks(data, pos + 2)  # introducer, label
        elif block == GIF_IMAGE:
            if pos + 10 > len(data):
                break
            x, y, w, h, local = struct.unpack("<HHHHB", data[pos + 1 : pos + 10])
            num_frames += 1
            delays.append(delay)
            delay = 0
            width, height = max(width, x + w), max(height, y + h)
            pos += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0)
            pos = _skip_sub_blocks(data, pos + 1)  # the LZW code size, then the data
        else:
            pos += 1
    return GifFrames(num_frames, width, height, tuple(delays))


def webp_delays(data: bytes, limit: int) -> tuple[int, ...]:
    """Each ANMF (animation frame) chunk's duration in milliseconds, in file order, walking
    the RIFF chunk headers and no further than `limit` + 1 frames."""
    delays: list[int] = []
    pos = 12  # "RIFF", size, "WEBP"
    while pos + 8 <= len(data) and len(delays) <= limit:
        kind, size = struct.unpack("<4sI", data[pos : pos + 8])
        if kind == b"ANMF" and size >= 16 and pos + 23 <= len(data):
            delays.append(int.from_bytes(data[pos + 20 : pos + 23], "little"))
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    return tuple(delays)


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    while pos < len(data):
        size = data[pos]
        pos += 1 + size
        if size == 0:
            break
    return pos

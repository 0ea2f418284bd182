"""Normalisation inside a real sandboxed worker: EXIF orientation, alpha on the stated background,
palette / CMYK / 16-bit / greyscale to RGB, and embedded ICC profiles converted to sRGB (this
Pillow has LittleCMS; without it the pixels are taken as sRGB, as the README states). Pixels are
read back from the worker's shared memory exactly as the core would receive them."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from gateway import decode
from gateway.pool import DecodePool, PoolSettings
from gateway.sniff import sniff
from tests.gateway import icc

MIB = 1024 * 1024
TILE = 32


class Worker:
    """A one-worker pool and the one event loop it lives in."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.pool = DecodePool(PoolSettings(1, 10.0, 1000, 1 << 25, 1024 * MIB, 8 * MIB, 8))
        self.runner.run(self.pool.start())

    def close(self) -> None:
        self.pool.close()
        self.runner.close()


@pytest.fixture(scope="module")
def pool() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


def tile_of(pool: Worker, data: bytes) -> np.ndarray:
    """The one (3, TILE, TILE) tile a still image becomes, as HWC."""
    fmt = sniff(data)
    spec = decode.Spec(fmt, TILE, (0, 0, 255), 1, 1, (0,), 1 << 25, 16384)
    reply = pool.runner.run(pool.pool.run("decode", spec.to_json(), data))
    return reply.arrays[0][0].transpose(1, 2, 0)


def encode(img: Image.Image, fmt: str, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def test_icc_profile_is_converted_to_srgb_where_littlecms_is_built_in(pool: Worker) -> None:
    """With LittleCMS the profile is applied; without it (pillow-simd is often built without)
    the pixels are taken as sRGB, the documented fallback. Both branches are asserted."""
    red = Image.new("RGB", (TILE, TILE), (255, 0, 0))
    tagged = tile_of(pool, encode(red, "PNG", icc_profile=icc.swapped_red_green()))
    plain = tile_of(pool, encode(red, "PNG"))
    assert tuple(plain[16, 16]) == (255, 0, 0)
    r, g, b = (int(v) for v in tagged[16, 16])
    if decode.HAS_LCMS:
        assert g > 240 and r < 15 and b < 15  # "red" in that profile is sRGB's green
    else:
        assert (r, g, b) == (255, 0, 0)  # taken as sRGB


def test_a_broken_icc_profile_is_ignored(pool: Worker) -> None:
    red = Image.new("RGB", (TILE, TILE), (255, 0, 0))
    out = tile_of(pool, encode(red, "PNG", icc_profile=b"\x00\x00\x00\x80not a profile" * 8))
    assert tuple(out[16, 16]) == (255, 0, 0)


def test_exif_orientation_is_applied(pool: Worker) -> None:
    # Stored 64x32: left half red, right half blue. Orientation 6 = rotate 90 deg clockwise to
    # show it: upright it is 32x64 with red on top.
    img = Image.new("RGB", (64, 32), (255, 0, 0))
    img.paste((0, 0, 255), (32, 0, 64, 32))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = tile_of(pool, encode(img, "JPEG", exif=exif.tobytes(), quality=95))
    top, bottom = out[4, 16].astype(int), out[28, 16].astype(int)
    assert top[0] > 200 and top[2] < 60, top
    assert bottom[2] > 200 and bottom[0] < 60, bottom
    assert tuple(out[16, 2]) == (0, 0, 255)  # the fill: upright it is taller than wide


def test_alpha_is_flattened_on_white(pool: Worker) -> None:
    clear = Image.new("RGBA", (TILE, TILE), (255, 0, 0, 0))
    half = Image.new("RGBA", (TILE, TILE), (0, 0, 0, 128))
    assert tuple(tile_of(pool, encode(clear, "PNG"))[16, 16]) == (255, 255, 255)
    grey = tile_of(pool, encode(half, "PNG"))[16, 16]
    assert all(120 <= int(v) <= 135 for v in grey), grey


def _palette(rgb: tuple[int, int, int]) -> Image.Image:
    img = Image.new("P", (TILE, TILE), 1)
    img.putpalette([0, 0, 0, *rgb])
    return img


@pytest.mark.parametrize(
    ("name", "make", "expected"),
    [
        ("greyscale", lambda: encode(Image.new("L", (TILE, TILE), 100), "PNG"), (100, 100, 100)),
        (
            "palette",
            lambda: encode(_palette((10, 200, 30)), "GIF"),
            (10, 200, 30),
        ),
        (
            "cmyk-jpeg",
            lambda: encode(Image.new("CMYK", (TILE, TILE), (0, 255, 255, 0)), "JPEG", quality=95),
            (255, 0, 0),
        ),
        (
            "16-bit",
            lambda: encode(Image.new("I;16", (TILE, TILE), 0x8000), "PNG"),
            (128, 128, 128),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_modes_convert_to_rgb(pool: Worker, name: str, make: object, expected: tuple) -> None:
    got = tuple(int(v) for v in tile_of(pool, make())[16, 16])  # type: ignore[operator]
    assert all(abs(a - b) <= 6 for a, b in zip(got, expected, strict=True)), (name, got)

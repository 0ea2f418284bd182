"""A minimal ICC v2 RGB matrix/TRC display profile built from first principles, so a test can
tag pixels with primaries other than sRGB's (no profile file is committed)."""

from __future__ import annotations

import struct

# sRGB's primaries adapted to D50, as in the ICC sRGB profile (X, Y, Z).
SRGB_RED = (0.4361, 0.2225, 0.0139)
SRGB_GREEN = (0.3851, 0.7169, 0.0971)
SRGB_BLUE = (0.1431, 0.0606, 0.7141)
D50 = (0.9642, 1.0, 0.8249)


def _s15(v: float) -> bytes:
    return struct.pack(">i", round(v * 65536))


def _xyz(xyz: tuple[float, float, float]) -> bytes:
    return b"XYZ \x00\x00\x00\x00" + b"".join(_s15(v) for v in xyz)


def _desc(text: str) -> bytes:
    ascii_ = text.encode() + b"\x00"
    body = b"desc\x00\x00\x00\x00" + struct.pack(">I", len(ascii_)) + ascii_
    return body + b"\x00" * 12 + b"\x00" * 67  # no Unicode, no ScriptCode strings


def rgb_profile(
    red: tuple[float, float, float],
    green: tuple[float, float, float],
    blue: tuple[float, float, float],
    gamma: float = 2.2,
) -> bytes:
    curve = b"curv\x00\x00\x00\x00" + struct.pack(">IH", 1, round(gamma * 256)) + b"\x00\x00"
    tags = [
        (b"desc", _desc("visor test profile")),
        (b"wtpt", _xyz(D50)),
        (b"rXYZ", _xyz(red)),
        (b"gXYZ", _xyz(green)),
        (b"bXYZ", _xyz(blue)),
        (b"rTRC", curve),
        (b"gTRC", curve),
        (b"bTRC", curve),
    ]
    offset = 128 + 4 + 12 * len(tags)
    table, data = b"", b""
    for sig, body in tags:
        body += b"\x00" * (-len(body) % 4)
        table += sig + struct.pack(">II", offset + len(data), len(body))
        data += body
    size = offset + len(data)
    header = (
        struct.pack(">I", size)
        + b"lcms"
        + struct.pack(">I", 0x02100000)
        + b"mntrRGB XYZ "
        + b"\x00" * 12
        + b"acsp"
        + b"\x00" * 24
        + struct.pack(">I", 0)  # perceptual intent
        + b"".join(_s15(v) for v in D50)
        + b"\x00" * 48
    )
    assert len(header) == 128
    return header + struct.pack(">I", len(tags)) + table + data


def swapped_red_green() -> bytes:
    """A profile whose red primary is sRGB's green and vice versa."""
    return rgb_profile(SRGB_GREEN, SRGB_RED, SRGB_BLUE)

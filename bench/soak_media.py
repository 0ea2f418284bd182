"""Media for the noisy-neighbour soak (`bench/soak.py`): built in memory, or read from the
corpus when it is present."""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from shared.proto import gateway_pb2

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "models" / "samples"
CORPUS = Path(os.environ.get("VISOR_TEST_CORPUS", ROOT.parent / "shared" / "corpus"))


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def apng(size: int, frames: int) -> bytes:
    rng = np.random.default_rng(1)
    images = [
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8), "RGB")
        for _ in range(frames)
    ]
    buf = io.BytesIO()
    images[0].save(buf, "PNG", save_all=True, append_images=images[1:], compress_level=1)
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def hostile_media() -> list[bytes]:
    """Files every gateway must refuse or survive: the corpus's rejects when it is present, and
    a few built here (so the soak runs in a user's clone too)."""
    jpeg = (SAMPLES / "number.jpg").read_bytes()
    out = [
        jpeg[: len(jpeg) // 2],  # truncated
        png_declaring(100_000, 100_000),  # pixel bomb by header
        os.urandom(4096),  # no known format
        b"PK\x03\x04" + os.urandom(512),  # a zip
    ]
    manifest = CORPUS / "MANIFEST.tsv"
    if manifest.exists():
        for line in manifest.read_text().splitlines()[1:]:
            name, expect = line.split("\t")[:2]
            if expect == "reject":
                out.append((CORPUS / name).read_bytes())
    return out


def questions() -> list[tuple[bytes, str]]:
    table = json.loads((SAMPLES / "questions.json").read_text())
    return [((SAMPLES / name).read_bytes(), q["question"]) for name, q in table.items()]


def request(prompt: str, media: list[bytes], **params: Any) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        media=[gateway_pb2.Media(data=m) for m in media],
        params=gateway_pb2.GenerationParams(max_new_tokens=8, **params),
    )


@dataclass(frozen=True, slots=True)
class NoisyMedia:
    """Built before any phase starts, so no client stalls while it is made."""

    hostile: list[bytes]  # files to refuse or survive
    good: bytes  # a small valid image
    big: list[bytes]  # large valid files (one over max_item_bytes)

    @staticmethod
    def build() -> NoisyMedia:
        good = (SAMPLES / "colour.png").read_bytes()
        return NoisyMedia(hostile_media(), good, [png(3000, 2000, 0), apng(512, 48)])

"""What runs inside a decode worker: header probe, raster decode and preprocessing.

Everything here touches untrusted bytes, so it only ever runs in a worker process (see
`gateway.pool`). Pillow is told the one format the sniffer found, decompression-bomb warnings are
errors, truncated images stay refused, and pixel limits are checked from the header before any
raster is allocated.
"""

from __future__ import annotations

import io
import time
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from shared.errors import Reason, VisorError

# Alpha is flattened on white: documents and UI screenshots with transparency read as intended.
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True, slots=True)
class Probe:
    width: int  # canvas width from the header
    height: int  # canvas height from the header
    num_frames: int  # declared frames (1 for a still image)


@dataclass(frozen=True, slots=True)
class Decoded:
    pixels: np.ndarray  # (tiles, 3, size, size) uint8, RGB, channels first
    decode_ms: float  # raster decode time
    preprocess_ms: float  # orient + convert + resize time


def init_worker(max_pixels: int) -> None:
    """Per-process Pillow policy, applied once before the first job."""
    Image.MAX_IMAGE_PIXELS = max_pixels
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    from PIL import ImageFile

    ImageFile.LOAD_TRUNCATED_IMAGES = False


def _open(data: bytes, fmt: str) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=[fmt])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise VisorError(
            Reason.PIXEL_LIMIT, "image exceeds the pixel limit", type(exc).__name__
        ) from None
    except Exception as exc:
        raise VisorError(
            Reason.CORRUPT_MEDIA, "media could not be parsed", type(exc).__name__
        ) from None


def _check_pixels(width: int, height: int, max_pixels: int, max_side: int) -> None:
    if width < 1 or height < 1:
        raise VisorError(Reason.CORRUPT_MEDIA, "media declares an empty canvas")
    if max(width, height) > max_side:
        raise VisorError(Reason.PIXEL_LIMIT, f"a side exceeds max_side ({max_side})")
    if width * height > max_pixels:
        raise VisorError(Reason.PIXEL_LIMIT, f"a frame exceeds max_pixels ({max_pixels})")


def probe(data: bytes, fmt: str, max_pixels: int, max_side: int, max_frames: int) -> Probe:
    """Reads headers only for a still image. For an animation it walks the frame headers too
    (Pillow refuses a frame whose extents blow past the pixel limit as it seeks)."""
    with _open(data, fmt) as img:
        width, height = img.size
        _check_pixels(width, height, max_pixels, max_side)
        try:
            num_frames = int(getattr(img, "n_frames", 1))
            if num_frames > max_frames:
                raise VisorError(Reason.FRAME_LIMIT, f"frames exceed max_frames ({max_frames})")
            for index in range(1, num_frames):
                img.seek(index)
                _check_pixels(*img.size, max_pixels, max_side)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise VisorError(
                Reason.PIXEL_LIMIT, "a frame exceeds the pixel limit", type(exc).__name__
            ) from None
        except VisorError:
            raise
        except Exception as exc:
            raise VisorError(
                Reason.CORRUPT_MEDIA, "media could not be parsed", type(exc).__name__
            ) from None
        return Probe(width, height, num_frames)


def decode(
    data: bytes, fmt: str, size: int, fill: tuple[int, int, int], max_pixels: int, max_side: int
) -> Decoded:
    """Decodes the first frame and preprocesses it to one `size` x `size` tile."""
    t0 = time.perf_counter()
    with _open(data, fmt) as img:
        _check_pixels(*img.size, max_pixels, max_side)
        try:
            img.load()
            t1 = time.perf_counter()
            upright = ImageOps.exif_transpose(img)
            rgb = _to_rgb(upright)
        except VisorError:
            raise
        except Exception as exc:
            raise VisorError(
                Reason.CORRUPT_MEDIA, "media could not be decoded", type(exc).__name__
            ) from None
    tile = _letterbox(rgb, size, fill)
    pixels = np.asarray(tile, dtype=np.uint8).transpose(2, 0, 1)[None].copy()
    t2 = time.perf_counter()
    return Decoded(pixels, (t1 - t0) * 1000, (t2 - t1) * 1000)


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        flat = Image.new("RGB", rgba.size, BACKGROUND)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    if img.mode == "I;16" or img.mode.startswith("I;16"):
        arr = (np.asarray(img, dtype=np.uint16) >> 8).astype(np.uint8)
        return Image.fromarray(arr, "L").convert("RGB")
    return img.convert("RGB")


def _letterbox(img: Image.Image, size: int, fill: tuple[int, int, int]) -> Image.Image:
    """Fits the whole image into a square (aspect kept, padded with the encoder's mean colour)."""
    scale = size / max(img.size)
    w, h = max(1, round(img.width * scale)), max(1, round(img.height * scale))
    resized = img.resize((w, h), Image.Resampling.BICUBIC, reducing_gap=3.0)
    canvas = Image.new("RGB", (size, size), fill)
    canvas.paste(resized, ((size - w) // 2, (size - h) // 2))
    return canvas

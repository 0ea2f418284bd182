"""What runs inside a decode worker: header probe, raster decode and preprocessing.

Everything here touches untrusted bytes, so it only ever runs in a worker process (see
`gateway.pool`). Pillow is told the one format the sniffer found, decompression-bomb warnings are
errors, truncated images stay refused, and pixel limits are checked from the header before any
raster is allocated.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, features

from gateway import headers
from shared.errors import Reason, VisorError
from shared.preprocess import crop_boxes

# Alpha is flattened on white: documents and UI screenshots with transparency read as intended.
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True, slots=True)
class Probe:
    width: int  # canvas width from the header
    height: int  # canvas height from the header
    num_frames: int  # declared frames (1 for a still image); a video's: the frames it samples
    # When each frame shows, in seconds from the first (an animation's delays, a video's sample
    # times); () for a still image or an animation whose delays cannot be read.
    starts_s: tuple[float, ...] = ()


# EXIF orientations that swap width and height.
TRANSPOSED = (5, 6, 7, 8)
ORIENTATION_TAG = 0x0112
HAS_LCMS = bool(features.check("littlecms2"))


@dataclass(frozen=True, slots=True)
class Spec:
    """What one decode job must produce (crosses the pipe as JSON). The geometry follows the
    core's rule kind: `tiles` lays out a rows x cols grid of `size` tiles (plus a thumbnail);
    `fixed` squashes the whole image, then each of a rows x cols pan-and-scan crop grid, to
    `size` square; `native` resizes to `width` x `height`; `anyres` (a tiles rule with pinpoints)
    lays out LLaVA-OneVision's views (`_anyres`)."""

    fmt: str  # Pillow format name from the sniffer
    size: int  # tile or view side (tiles, fixed)
    fill: tuple[int, int, int]  # padding colour (the encoder's mean; tiles)
    rows: int  # tile grid rows, or crop grid rows (fixed)
    cols: int  # tile grid columns, or crop grid columns (fixed)
    frames: tuple[int, ...]  # frame indices to decode, one array each
    max_pixels: int  # per frame, rechecked here
    max_side: int  # per side, rechecked here
    kind: str = "tiles"  # the layout: the rule's kind, or "anyres" (tiles with pinpoints)
    resample: str = "bicubic"  # the rule's filter (tiles are always bicubic)
    width: int = 0  # native: resized width
    height: int = 0  # native: resized height

    def to_json(self) -> dict[str, Any]:
        return {
            "fmt": self.fmt,
            "size": self.size,
            "fill": list(self.fill),
            "rows": self.rows,
            "cols": self.cols,
            "frames": list(self.frames),
            "max_pixels": self.max_pixels,
            "max_side": self.max_side,
            "kind": self.kind,
            "resample": self.resample,
            "width": self.width,
            "height": self.height,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Spec:
        r, g, b = (int(v) for v in d["fill"])
        return Spec(
            str(d["fmt"]),
            int(d["size"]),
            (r, g, b),
            int(d["rows"]),
            int(d["cols"]),
            tuple(int(f) for f in d["frames"]),
            int(d["max_pixels"]),
            int(d["max_side"]),
            str(d.get("kind", "tiles")),
            str(d.get("resample", "bicubic")),
            int(d.get("width", 0)),
            int(d.get("height", 0)),
        )

    @property
    def num_tiles(self) -> int:
        """Arrays' first dimension: tiles or views (a native frame is one)."""
        if self.kind == "native":
            return 1
        cells = self.rows * self.cols
        return cells + 1 if cells > 1 else cells


@dataclass(frozen=True, slots=True)
class Decoded:
    items: tuple[np.ndarray, ...]  # per frame: (tiles, 3, size, size) uint8, RGB, channels first
    decode_ms: float  # raster decode time
    preprocess_ms: float  # orient + convert + resize + tile time


def init_worker(max_pixels: int) -> None:
    """Per-process Pillow policy, applied once before the first job."""
    Image.MAX_IMAGE_PIXELS = max_pixels
    # Pillow's other warnings (an invalid APNG control chunk, ...) would be text on the gateway's
    # stderr, whose log is JSON lines only; the bomb warning is a refusal.
    warnings.simplefilter("ignore")
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    from PIL import ImageFile

    ImageFile.LOAD_TRUNCATED_IMAGES = False


@contextlib.contextmanager
def refusals(corrupt: str) -> Iterator[None]:
    """Turns what a decoder raises into a refusal: ours pass as they are, Pillow's bomb errors
    are PIXEL_LIMIT, anything else is CORRUPT_MEDIA with `corrupt` as its message (only the
    exception's type name is kept, for the log)."""
    try:
        yield
    except VisorError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise VisorError(
            Reason.PIXEL_LIMIT, "image exceeds the pixel limit", type(exc).__name__
        ) from None
    except Exception as exc:
        raise VisorError(Reason.CORRUPT_MEDIA, corrupt, type(exc).__name__) from None


def _open(data: bytes, fmt: str) -> Image.Image:
    with refusals("media could not be parsed"):
        img = Image.open(io.BytesIO(data), formats=[fmt])
    return img


def check_pixels(width: int, height: int, max_pixels: int, max_side: int) -> None:
    if width < 1 or height < 1:
        raise VisorError(Reason.CORRUPT_MEDIA, "media declares an empty canvas")
    if max(width, height) > max_side:
        raise VisorError(Reason.PIXEL_LIMIT, f"a side exceeds max_side ({max_side})")
    if width * height > max_pixels:
        raise VisorError(Reason.PIXEL_LIMIT, f"a frame exceeds max_pixels ({max_pixels})")


def probe(data: bytes, fmt: str, max_pixels: int, max_side: int, max_frames: int) -> Probe:
    """Reads headers only, never pixels: the canvas, the frames and their extents, and EXIF
    orientation (the grid is chosen for the upright image)."""
    with _open(data, fmt) as img:
        width, height = img.size
        check_pixels(width, height, max_pixels, max_side)
        with refusals("media could not be parsed"):
            png = headers.read_png(data) if fmt == "PNG" else None
            if fmt == "GIF":
                num_frames, delays = _gif_frames(data, max_pixels, max_side, max_frames)
            else:
                num_frames = _frames(img, png, max_pixels, max_side, max_frames)
                delays = _delays(data, fmt, png, num_frames, bool(img.info.get("default_image")))
            orientation = _orientation(img) if png is None else _png_orientation(png.meta)
        if orientation in TRANSPOSED:
            width, height = height, width
        # The last frame's delay says when the animation loops, not when a frame shows.
        starts = tuple(itertools.accumulate(delays[: num_frames - 1], initial=0.0))
        timed = num_frames > 1 and len(starts) == num_frames
        return Probe(width, height, num_frames, starts if timed else ())


def _frame_limit(num_frames: int, max_frames: int) -> None:
    if num_frames > max_frames:
        raise VisorError(Reason.FRAME_LIMIT, f"frames exceed max_frames ({max_frames})")


def _gif_frames(
    data: bytes, max_pixels: int, max_side: int, max_frames: int
) -> tuple[int, tuple[float, ...]]:
    """A GIF declares no frame count: its blocks are walked, no further than the limit. A frame
    reaching past the canvas grows it (as Pillow does), so every frame's extent is checked.
    Delays in seconds as browsers show them: 0 or 1/100 s is shown as 1/10 s."""
    gif = headers.gif_frames(data, max_frames)
    _frame_limit(gif.num_frames, max_frames)
    check_pixels(gif.width, gif.height, max_pixels, max_side)
    return gif.num_frames, tuple(d / 100 if d > 1 else 0.1 for d in gif.delays)


def _delays(
    data: bytes, fmt: str, png: headers.PngHeaders | None, num_frames: int, default_image: bool
) -> tuple[float, ...]:
    """Each frame's delay in seconds from its header: APNG's frame controls (a default image
    outside the animation shows for none), WebP's ANMF chunks; () for other formats."""
    if num_frames < 2:
        return ()
    if png is not None:
        return (0.0,) * default_image + png.delays
    if fmt == "WEBP":
        return tuple(ms / 1000 for ms in headers.webp_delays(data, num_frames))
    return ()


def _frames(
    img: Image.Image,
    png: headers.PngHeaders | None,
    max_pixels: int,
    max_side: int,
    max_frames: int,
) -> int:
    """The declared frame count (APNG's acTL, WebP's demuxer), checked against what the frame
    headers say without decoding a frame."""
    num_frames = int(getattr(img, "n_frames", 1))
    _frame_limit(num_frames, max_frames)
    if png is not None and num_frames > 1:
        _apng_frames(png, num_frames - int(bool(img.info.get("default_image"))), img.size)
    elif img.format not in ("PNG", "WEBP"):  # libwebp composites every frame onto the canvas
        for index in range(1, num_frames):  # JPEG's MPO: seeking reads a frame's header only
            img.seek(index)
            check_pixels(*img.size, max_pixels, max_side)
    return num_frames


def _apng_frames(png: headers.PngHeaders, wanted: int, canvas: tuple[int, int]) -> None:
    """Each frame control must lie inside the canvas, and there must be as many as declared
    (Pillow refuses either while seeking)."""
    if len(png.frames) < wanted:
        raise VisorError(Reason.CORRUPT_MEDIA, "the animation holds fewer frames than it declares")
    for width, height, x, y in png.frames[:wanted]:
        if x + width > canvas[0] or y + height > canvas[1]:
            raise VisorError(Reason.CORRUPT_MEDIA, "an animation frame lies outside its canvas")


def _png_orientation(meta: tuple[bytes, ...]) -> int:
    """A PNG's orientation without decoding it: Pillow reads its metadata only after the image
    data (a full decode) unless eXIf comes first, so it reads a one-pixel stand-in instead."""
    if not meta:
        return 1
    try:
        with Image.open(io.BytesIO(headers.png_stand_in(meta)), formats=["PNG"]) as stand_in:
            return _orientation(stand_in)
    except Exception:
        return 1  # unreadable metadata: decode as stored


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(ORIENTATION_TAG, 1))
    except Exception:
        return 1  # unreadable EXIF: decode as stored


def decode(data: bytes, spec: Spec) -> Decoded:
    """Decodes the requested frames, each to `spec.num_tiles` tiles of `spec.size`."""
    t0 = time.perf_counter()
    decode_s = 0.0
    items = []
    with _open(data, spec.fmt) as img:
        check_pixels(*img.size, spec.max_pixels, spec.max_side)
        with refusals("media could not be decoded"):
            if spec.fmt == "JPEG" and spec.kind == "tiles":
                # Only tiles: other kinds match their processor's full-resolution resize.
                _draft(img, spec)
            for index in spec.frames:
                t1 = time.perf_counter()
                if index:
                    img.seek(index)
                    check_pixels(*img.size, spec.max_pixels, spec.max_side)
                img.load()
                decode_s += time.perf_counter() - t1
                items.append(preprocess(_upright(img), spec))
    total_s = time.perf_counter() - t0
    return Decoded(tuple(items), decode_s * 1000, (total_s - decode_s) * 1000)


def _draft(img: Image.Image, spec: Spec) -> None:
    """Lets libjpeg scale by 1/2, 1/4 or 1/8 during the DCT when the target is that much smaller:
    the largest win on big photos, and the result never drops below the target size."""
    w, h = img.size
    if _orientation(img) in TRANSPOSED:
        w, h = h, w
    scale = min(spec.cols * spec.size / w, spec.rows * spec.size / h)
    if scale < 0.5:
        tw, th = max(1, int(w * scale)), max(1, int(h * scale))
        if _orientation(img) in TRANSPOSED:
            tw, th = th, tw
        img.draft("RGB", (tw, th))


def _upright(img: Image.Image) -> Image.Image:
    upright = ImageOps.exif_transpose(img) if _orientation(img) != 1 else img
    return _to_srgb(_to_rgb(upright), img)


def _to_srgb(rgb: Image.Image, src: Image.Image) -> Image.Image:
    """Converts an embedded ICC profile to sRGB where this Pillow has LittleCMS; otherwise the
    pixels are taken as sRGB (the README states it). A profile that does not parse is ignored."""
    icc = src.info.get("icc_profile")
    if not icc or not HAS_LCMS:
        return rgb
    from PIL import ImageCms  # loaded by `warm` before seccomp; after it, an import would kill

    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        out = ImageCms.profileToProfile(
            rgb, profile, ImageCms.createProfile("sRGB"), outputMode="RGB"
        )
    except Exception:
        return rgb
    return out if out is not None else rgb


FILTERS = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


def preprocess(rgb: Image.Image, spec: Spec) -> np.ndarray:
    """One frame to (views, 3, H, W) uint8 as the spec's kind lays it out."""
    if spec.kind == "tiles":
        return _stack(_tiles(rgb, spec))
    # As the model's processor resizes: the whole source, its filter, no reducing gap.
    f = FILTERS[spec.resample]
    if spec.kind == "anyres":
        return _stack(_anyres(rgb, spec, f))
    if spec.kind == "native":
        if min(spec.width, spec.height) < 1:
            raise VisorError(Reason.INVALID_REQUEST, "a native resize needs a size")
        return _stack([rgb.resize((spec.width, spec.height), f)])
    views = [rgb.resize((spec.size, spec.size), f)]
    if spec.rows * spec.cols > 1:  # pan and scan: the crops follow the whole image
        boxes = crop_boxes(rgb.width, rgb.height, spec.rows, spec.cols)
        views += [rgb.crop(box).resize((spec.size, spec.size), f) for box in boxes]
    return _stack(views)


def _stack(views: list[Image.Image]) -> np.ndarray:
    return np.stack([np.asarray(v, dtype=np.uint8) for v in views]).transpose(0, 3, 1, 2).copy()


def _tiles(rgb: Image.Image, spec: Spec) -> list[Image.Image]:
    tiles = []
    if spec.rows * spec.cols > 1:
        tiles.append(_letterbox(rgb, spec.size, spec.fill))  # the global thumbnail comes first
        canvas = _fit(rgb, spec.cols * spec.size, spec.rows * spec.size, spec.fill)
        for r in range(spec.rows):
            for c in range(spec.cols):
                box = (c * spec.size, r * spec.size, (c + 1) * spec.size, (r + 1) * spec.size)
                tiles.append(canvas.crop(box))
    else:
        tiles.append(_letterbox(rgb, spec.size, spec.fill))
    return tiles


def _anyres(rgb: Image.Image, spec: Spec, f: Image.Resampling) -> list[Image.Image]:
    """LLaVA-OneVision's processor: one view is the image padded to a square with `fill`, then
    resized; a grid is the whole image squashed to a tile, then the tiles (row by row) of its
    canvas: the image resized to fit it (the long side exact, the other rounded up) and centred
    on black."""
    size, w, h = spec.size, rgb.width, rgb.height
    if spec.rows * spec.cols == 1:
        side = max(w, h)
        square = Image.new("RGB", (side, side), spec.fill)
        square.paste(rgb, ((side - w) // 2, (side - h) // 2))
        return [square.resize((size, size), f)]
    cw, ch = spec.cols * size, spec.rows * size
    if cw / w < ch / h:
        nw, nh = cw, min(math.ceil(h * (cw / w)), ch)
    else:
        nw, nh = min(math.ceil(w * (ch / h)), cw), ch
    canvas = Image.new("RGB", (cw, ch), (0, 0, 0))
    canvas.paste(rgb.resize((nw, nh), f), ((cw - nw) // 2, (ch - nh) // 2))
    views = [rgb.resize((size, size), f)]
    for r in range(spec.rows):
        for c in range(spec.cols):
            views.append(canvas.crop((c * size, r * size, (c + 1) * size, (r + 1) * size)))
    return views


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img  # no needless convert
    if img.mode in ("RGBA", "LA", "PA", "RGBa") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        flat = Image.new("RGB", rgba.size, BACKGROUND)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    if img.mode.startswith("I;16"):
        arr = (np.asarray(img, dtype=np.uint16) >> 8).astype(np.uint8)
        return Image.fromarray(arr, "L").convert("RGB")
    if img.mode == "I":
        arr = (np.clip(np.asarray(img, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(arr, "L").convert("RGB")
    return img.convert("RGB")


def _fit(img: Image.Image, width: int, height: int, fill: tuple[int, int, int]) -> Image.Image:
    """Fits the whole image into `width` x `height` (aspect kept, centred, padded with `fill`)."""
    scale = min(width / img.width, height / img.height)
    w, h = max(1, round(img.width * scale)), max(1, round(img.height * scale))
    resized = img.resize((w, h), Image.Resampling.BICUBIC, reducing_gap=3.0)
    canvas = Image.new("RGB", (width, height), fill)
    canvas.paste(resized, ((width - w) // 2, (height - h) // 2))
    return canvas


def _letterbox(img: Image.Image, size: int, fill: tuple[int, int, int]) -> Image.Image:
    return _fit(img, size, size, fill)


def _sample(fmt: str, animated: bool = False) -> bytes:
    buf = io.BytesIO()
    frames = [Image.new("RGBA", (8, 8), (i * 60, 0, 0, 128)) for i in range(2)]
    if animated:
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:])
    elif fmt == "JPEG":
        Image.new("RGB", (64, 48)).save(buf, fmt)
    else:
        frames[0].save(buf, fmt)
    return buf.getvalue()


def warm() -> None:
    """Runs every code path once so that Pillow's lazily imported plugins and helpers are loaded
    before seccomp forbids opening files (an import after that would kill the worker)."""
    Image.init()
    for fmt in ("JPEG", "PNG", "GIF", "WEBP"):
        for animated in (False, True) if fmt != "JPEG" else (False,):
            data = _sample(fmt, animated)
            p = probe(data, fmt, 1 << 20, 1 << 10, 8)
            frames = tuple(range(p.num_frames))
            for rows, cols in ((1, 1), (1, 2)):
                decode(data, Spec(fmt, 16, (0, 0, 0), rows, cols, frames, 1 << 20, 1 << 10))
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = 6
    tagged_png = io.BytesIO()  # a metadata chunk: the header walk and the one-pixel stand-in
    Image.new("RGB", (8, 4)).save(tagged_png, "PNG", exif=exif.tobytes())
    probe(tagged_png.getvalue(), "PNG", 1 << 20, 1 << 10, 8)
    big = io.BytesIO()
    Image.new("RGB", (512, 512)).save(big, "JPEG")
    decode(big.getvalue(), Spec("JPEG", 16, (0, 0, 0), 1, 1, (0,), 1 << 20, 1 << 10))
    for kind, resample in (("native", "bicubic"), ("fixed", "bilinear"), ("anyres", "bicubic")):
        spec = Spec("JPEG", 16, (0, 0, 0), 1, 2, (0,), 1 << 20, 1 << 10, kind, resample, 28, 56)
        decode(big.getvalue(), spec)
    if HAS_LCMS:  # an embedded profile: ImageCms and LittleCMS's transform code get loaded
        from PIL import ImageCms

        srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
        tagged = io.BytesIO()
        Image.new("RGB", (8, 8)).save(tagged, "PNG", icc_profile=srgb)
        decode(tagged.getvalue(), Spec("PNG", 16, (0, 0, 0), 1, 1, (0,), 1 << 20, 1 << 10))
    for mode in ("L", "LA", "P", "CMYK", "I;16", "I", "1", "RGBa"):
        _to_rgb(Image.new(mode, (2, 2)))
    with contextlib.suppress(VisorError):
        _open(b"\xff\xd8\xff", "JPEG")

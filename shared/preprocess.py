"""Preprocessing rules: what geometry a core's encoder takes, declared by the core (Describe) and
applied by the gateway's sandboxed workers, model-agnostic on both sides.

Three kinds cover the families the core serves:
- `tiles` (LLaVA-NeXT): square tiles of `image_size` in a grid chosen from `detail`, plus a global
  thumbnail; `tokens_per_tile` per tile. With `pinpoints` (LLaVA-OneVision's anyres): a grid is
  one of those canvases, cut from the image fitted into it (padded black), after the whole image
  squashed to a tile; one view is the image padded to a square (the mean colour) then resized; the
  model unpads the grid's tokens to the image's aspect and closes each row with a newline token,
  so an item's tokens follow from its grid and its source size (`anyres_tokens`).
- `native` (Qwen2/2.5/3-VL): each side rounded to a multiple of `patch_size * merge_size`, then
  scaled into [`min_pixels`, `max_pixels`]; frames grouped by `temporal_patch_size`.
- `fixed` (Gemma 3): every view squashed to `image_size` square, `tokens_per_image` each; with pan
  and scan, a long image adds crops (a 1 x n or n x 1 grid) after the whole image.

The rule's digest is part of the preprocessing version every cache key carries, so features made
under one rule are never served under another. Pure Python: both services import it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace

from shared.errors import Reason, VisorError

VERSION = "pp1"  # the gateway's preprocessing steps; the rule's digest is appended
KINDS = ("tiles", "native", "fixed")
RESAMPLES = ("bicubic", "bilinear")
MAX_ASPECT = 200  # Qwen's processor refuses a longer side over 200 times the shorter


@dataclass(frozen=True, slots=True)
class PreprocessRule:
    kind: str  # "tiles", "native" or "fixed"
    mean: tuple[float, ...]  # per-channel normalisation mean (0..1), applied by the core
    std: tuple[float, ...]  # per-channel normalisation std
    resample: str = "bicubic"  # resampling filter of the resize ("bicubic" | "bilinear")
    image_size: int = 0  # tiles: tile side; fixed: the square side every view is resized to
    tokens_per_tile: int = 0  # tiles: visual tokens per tile
    patch_size: int = 0  # native: encoder patch side
    merge_size: int = 0  # native: patches merged per side into one token
    temporal_patch_size: int = 0  # native: frames per temporal patch
    min_pixels: int = 0  # native: least pixels of a resized frame
    max_pixels: int = 0  # native: most pixels of a resized frame
    tokens_per_image: int = 0  # fixed: visual tokens per view
    pan_and_scan: bool = False  # fixed: crop long images into extra views
    min_crop_size: int = 0  # fixed: a crop's least side in source pixels
    max_num_crops: int = 0  # fixed: crops per image at most
    min_ratio_to_activate: float = 0.0  # fixed: aspect ratio from which crops are made
    pinpoints: tuple[int, ...] = ()  # tiles: anyres canvases, (height, width) pairs flattened
    anyres_max: int = 0  # tiles with pinpoints: grid tokens past this many tiles' are downscaled

    def validate(self) -> None:
        """Raises ValueError naming the field that makes the rule unusable."""
        if self.kind not in KINDS or self.resample not in RESAMPLES:
            raise ValueError(f"preprocess rule kind must be one of {KINDS}, resample {RESAMPLES}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError("preprocess rule mean and std need 3 channels, std > 0")
        if self.kind == "tiles" and min(self.image_size, self.tokens_per_tile) < 1:
            raise ValueError("tiles rule needs image_size and tokens_per_tile >= 1")
        if self.pinpoints and (
            self.kind != "tiles"
            or len(self.pinpoints) % 2
            or any(v < 1 or v % max(1, self.image_size) for v in self.pinpoints)
            or math.isqrt(self.tokens_per_tile) ** 2 != self.tokens_per_tile
        ):
            raise ValueError(
                "pinpoints are (height, width) pairs of whole tiles, of a tiles rule whose "
                "tokens_per_tile is a square"
            )
        if self.anyres_max < 0:
            raise ValueError("anyres_max must be >= 0")
        if self.kind == "fixed" and min(self.image_size, self.tokens_per_image) < 1:
            raise ValueError("fixed rule needs image_size and tokens_per_image >= 1")
        if (
            self.kind == "fixed"
            and self.pan_and_scan
            and min(self.max_num_crops - 1, self.min_crop_size) < 1
        ):
            raise ValueError("pan and scan needs max_num_crops >= 2 and min_crop_size >= 1")
        if self.kind == "native":
            sizes = (self.patch_size, self.merge_size, self.temporal_patch_size, self.min_pixels)
            if min(sizes) < 1 or self.max_pixels < max(self.min_pixels, self.factor**2):
                raise ValueError(
                    "native rule needs patch, merge and temporal sizes >= 1 and "
                    "factor^2 <= max_pixels >= min_pixels >= 1"
                )

    @property
    def factor(self) -> int:
        """Native: the side of one merged token in pixels."""
        return self.patch_size * self.merge_size

    @property
    def resolution(self) -> int:
        """What an item's `resolution` states: the tile or view side, or native's token side."""
        return self.factor if self.kind == "native" else self.image_size

    @property
    def canvases(self) -> tuple[tuple[int, int], ...]:
        """Tiles with pinpoints: the (height, width) canvases a grid may take."""
        pairs = self.pinpoints
        return tuple((pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))

    def digest(self) -> str:
        """Hex SHA-256 of a canonical encoding: every field, sorted, floats as repr; the anyres
        fields only when set, so the rules that predate them keep their digests."""
        fields = asdict(self)
        for name in ("pinpoints", "anyres_max"):
            if not fields[name]:
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def version(self) -> str:
        """The preprocessing version items made under this rule carry (and cache keys with it)."""
        return f"{VERSION}-{self.digest()}"

    def bounded(self, max_pixels: int, max_views: int) -> PreprocessRule:
        """This rule within a gateway's own limits: native frames of at most `max_pixels`,
        fixed images of at most `max_views - 1` crops (the whole image is the first view)."""
        if self.kind == "native" and self.max_pixels > max_pixels:
            top = max(max_pixels, self.factor**2)
            return replace(self, max_pixels=top, min_pixels=min(self.min_pixels, top))
        if self.kind == "fixed" and self.pan_and_scan and self.max_num_crops >= max_views:
            crops = max_views - 1
            return replace(self, max_num_crops=crops, pan_and_scan=crops >= 2)
        return self

    def item_shape(self, rows: int, cols: int, num_frames: int = 1) -> tuple[int, int, int, int]:
        """The tensor shape of an item declared with this grid: tiles and fixed views of
        `image_size` (every cell, plus the whole image first when there is more than one cell),
        or native `num_frames` frames of rows x cols merged tokens."""
        if self.kind == "native":
            return (num_frames, 3, rows * self.factor, cols * self.factor)
        cells = rows * cols
        return (cells + 1 if cells > 1 else cells, 3, self.image_size, self.image_size)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Refuses (INVALID_REQUEST) a tensor shape no image could have under this rule."""
        if len(shape) != 4 or shape[0] < 1 or shape[1] != 3:
            raise VisorError(Reason.INVALID_REQUEST, "an item's shape is not (n, 3, H, W)")
        n, _, h, w = shape
        if self.kind == "native":
            f = self.factor
            fits = h % f == 0 and w % f == 0 and min(h, w) >= f and h * w >= self.min_pixels
            # Only an extreme aspect keeps a side at one token past max_pixels (smart_resize).
            long_ok = min(h, w) == f and max(h, w) ** 2 <= MAX_ASPECT * self.max_pixels
            if not fits or not (h * w <= self.max_pixels or long_ok):
                raise VisorError(
                    Reason.INVALID_REQUEST,
                    f"an item's frames break the native rule (multiples of {f}, "
                    f"min_pixels {self.min_pixels}, max_pixels {self.max_pixels})",
                )
            return
        if h != self.image_size or w != self.image_size:
            raise VisorError(
                Reason.INVALID_REQUEST, f"an item's views are not {self.image_size} square"
            )
        if self.kind == "fixed" and not (
            n == 1 or (self.pan_and_scan and 3 <= n <= 1 + self.max_num_crops)
        ):
            raise VisorError(
                Reason.INVALID_REQUEST,
                f"an item's views exceed the rule's max_num_crops ({self.max_num_crops})",
            )

    def visual_tokens(self, shape: tuple[int, ...]) -> int:
        """Visual tokens one item of this (checked) shape yields before any compression (a
        rule with pinpoints: `anyres_tokens`, which needs the item's source size)."""
        n, _, h, w = shape
        if self.pinpoints:
            raise ValueError("an anyres item's tokens depend on its source size: anyres_tokens")
        if self.kind == "tiles":
            return self.tokens_per_tile * n
        if self.kind == "fixed":
            return self.tokens_per_image * n
        per_frame = (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2
        return per_frame * -(-n // self.temporal_patch_size)

    def anyres_tokens(self, rows: int, cols: int, width: int, height: int) -> int:
        """Tiles with pinpoints: the visual tokens of an item of a rows x cols grid (1 x 1: one
        view) for a `width` x `height` source: the view's tokens and a newline, or the whole
        image's tile and the unpadded, perhaps downscaled grid with a newline per row."""
        if rows * cols == 1:
            return self.tokens_per_tile + 1
        side = math.isqrt(self.tokens_per_tile)
        _, (h, w) = anyres_grid_size(rows, cols, side, width, height, self.anyres_max)
        return self.tokens_per_tile + h * (w + 1)

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """An item's (t, h, w) in merged-token units, for the model's rope positions: native
        frames grouped by temporal patch and sides in merged tokens; (1, 1, 1) for the other
        kinds (their positions do not depend on it)."""
        if self.kind != "native":
            return (1, 1, 1)
        n, _, h, w = shape
        return (-(-n // self.temporal_patch_size), h // self.factor, w // self.factor)

    def native_frames(self, num_sampled: int) -> int:
        """Native: frames an animation or video keeps of `num_sampled`, rounded down to whole
        temporal patches as the video processor does (fewer than one patch: all of them; the
        encoder repeats the last frame, as the processor pads)."""
        t = self.temporal_patch_size
        return num_sampled if num_sampled <= t else num_sampled // t * t

    def crop_grid(self, width: int, height: int) -> tuple[int, int]:
        """Fixed: the pan-and-scan crop grid (rows, cols) of an upright image; (1, 1) = none."""
        if self.kind != "fixed" or not self.pan_and_scan:
            return (1, 1)
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio_to_activate:
            return (1, 1)
        n = min(math.floor(long / short + 0.5), math.floor(long / self.min_crop_size))
        n = min(self.max_num_crops, max(2, n))
        rows, cols = (1, n) if width >= height else (n, 1)
        if min(math.ceil(width / cols), math.ceil(height / rows)) < self.min_crop_size:
            return (1, 1)
        return (rows, cols)


def crop_boxes(width: int, height: int, rows: int, cols: int) -> list[tuple[int, int, int, int]]:
    """Pan-and-scan crops (left, top, right, bottom) in the processor's order, row by row; the
    last crop of a row or column is cut at the image's edge, as slicing does."""
    cw, ch = math.ceil(width / cols), math.ceil(height / rows)
    return [
        (c * cw, r * ch, min(width, (c + 1) * cw), min(height, (r + 1) * ch))
        for r in range(rows)
        for c in range(cols)
    ]


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width): each side rounded to a multiple of `factor`, then scaled, aspect kept,
    into [min_pixels, max_pixels] (rounding down when shrinking, up when growing)."""
    if max(height, width) > MAX_ASPECT * min(height, width):
        raise VisorError(
            Reason.PIXEL_LIMIT, f"an image's aspect ratio exceeds the model's {MAX_ASPECT}:1"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def tiles(
    image_size: int,
    tokens_per_tile: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> PreprocessRule:
    """LLaVA-NeXT's tile grid (the letterbox and tile resize are bicubic)."""
    return PreprocessRule("tiles", tuple(mean), tuple(std), "bicubic", image_size, tokens_per_tile)


def best_pinpoint(
    width: int, height: int, pinpoints: tuple[tuple[int, int], ...]
) -> tuple[int, int]:
    """LLaVA-NeXT's `select_best_resolution`: the (height, width) canvas that keeps the most of
    the image's pixels once fitted, then wastes the least; the first such in order."""
    best, best_key = pinpoints[0], (-1, 0)
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        key = (kept, -(pw * ph - kept))
        if key > best_key:
            best, best_key = (ph, pw), key
    return best


def anyres_grid_size(
    rows: int, cols: int, side: int, width: int, height: int, anyres_max: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """A rows x cols grid of `side` x `side` token tiles, for a `width` x `height` image:
    ((h, w) of the token map unpadded to the image's aspect, (h, w) after the downscale that
    keeps it near `anyres_max` tiles' worth; 0: never). As LLaVA-OneVision computes them."""
    cur_h, cur_w = rows * side, cols * side
    if width / height > cur_w / cur_h:
        new = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new) // 2 * 2
    else:
        new = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new) // 2 * 2
    ratio = math.sqrt(cur_h * cur_w / (anyres_max * side**2)) if anyres_max else 0.0
    if ratio > 1.1:
        return (cur_h, cur_w), (int(cur_h // ratio), int(cur_w // ratio))
    return (cur_h, cur_w), (cur_h, cur_w)

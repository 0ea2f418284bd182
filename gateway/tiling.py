"""Dynamic resolution: what geometry an image gets for a `detail` level under each kind of
preprocessing rule (a tile grid, a native pixel budget, fixed views), and frame sampling.

Pure functions of header values and the question's text, so the gateway can declare every item's
geometry to the core before any pixel is decoded, and the worker lays out exactly that. The
question is read here, in memory, for a handful of keywords; it is never logged.

`detail=auto` is a per-image visual-token budget: the question's intent picks how many tiles an
image may take (reading, counting or fine detail: as many as `high`; colour, shape or position:
one; anything else: a middle budget), and the image's pixel count and aspect pick the grid under
it (`select_grid`), so a small image stays one tile whatever is asked. Every level is bounded by
`[limits] max_tiles` and by the request's `max_visual_tokens`, with one tile as the floor.

The other kinds spend the same intent classes (`low` as coarse, `high` as fine): a native rule
(Qwen) a share of its `max_pixels` (`NATIVE_SHARE`), resized as the processor's smart resize
rounds, with `min_pixels` as the floor; a fixed rule (Gemma) its pan-and-scan crops for a fine
intent only, with the whole image as the floor.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from shared.preprocess import PreprocessRule, best_pinpoint, smart_resize

DETAILS = ("low", "auto", "high")

# Intent words (lower case, whole words). Fine wins over coarse: "what colour is the small
# text?" is a reading question.
FINE_WORDS = frozenset(
    [
        "read",
        "reads",
        "reading",
        "written",
        "write",
        "text",
        "texts",
        "number",
        "numbers",
        "digit",
        "digits",
        "word",
        "words",
        "letter",
        "letters",
        "label",
        "sign",
        "many",
        "count",
        "small",
        "tiny",
        "detail",
        "details",
        "fine",
    ]
)
COARSE_WORDS = frozenset(
    [
        "colour",
        "color",
        "colours",
        "colors",
        "shape",
        "shapes",
        "same",
        "different",
        "left",
        "right",
        "above",
        "below",
    ]
)
# Tiles (thumbnail included) `auto` may spend on one image per intent; None = what `high` takes.
AUTO_TILES: dict[str, int | None] = {"fine": None, "general": 3, "coarse": 1}
# Share of a native rule's max_pixels one frame may take per intent (of each side: all, a half,
# a quarter).
NATIVE_SHARE: dict[str, float] = {"fine": 1.0, "general": 1 / 4, "coarse": 1 / 16}


@dataclass(frozen=True, slots=True)
class Grid:
    rows: int  # tile rows
    cols: int  # tile columns

    @property
    def num_tiles(self) -> int:
        """Cells, plus a global thumbnail (sent first) when there is more than one cell."""
        cells = self.rows * self.cols
        return cells + 1 if cells > 1 else cells


ONE = Grid(1, 1)


@dataclass(frozen=True, slots=True)
class Budget:
    """What bounds one image's grid, besides its detail level."""

    size: int  # the encoder's tile side, pixels
    max_tiles: int  # `[limits] max_tiles`: grid cells (a thumbnail is added to a grid)
    tokens_per_tile: int = 0  # the encoder's visual tokens per tile (0: unknown, no token bound)
    max_visual_tokens: int = 0  # the request's bound per image (0: unset)

    def most_tiles(self) -> int:
        """Tiles (thumbnail included) any level may use; at least one."""
        tiles = self.max_tiles + 1 if self.max_tiles > 1 else 1
        if self.max_visual_tokens > 0 and self.tokens_per_tile > 0:
            tiles = min(tiles, self.max_visual_tokens // self.tokens_per_tile)
        return max(1, tiles)


def intent(question: str) -> str:
    """ "fine" (reading, counting, small things), "coarse" (colour, shape, position) or
    "general", from whole lower-case words of the question."""
    words = set(re.findall(r"[a-z]+", question.lower()))
    if words & FINE_WORDS:
        return "fine"
    if words & COARSE_WORDS:
        return "coarse"
    return "general"


def level(detail: str, question: str) -> str:
    """The intent class a request spends as: `low` as coarse, `high` as fine, `auto` as the
    question's own."""
    if detail == "low":
        return "coarse"
    if detail == "high":
        return "fine"
    return intent(question)


def select_grid(width: int, height: int, size: int, max_tiles: int) -> Grid:
    """LLaVA-NeXT's rule: among grids of at most `max_tiles` cells, keep the one that preserves
    the most of the image's own pixels once fitted; on a tie, the one that wastes the least."""
    best, best_key = ONE, (-1, 0)
    for rows in range(1, max_tiles + 1):
        for cols in range(1, max_tiles // rows + 1):
            cw, ch = cols * size, rows * size
            scale = min(cw / width, ch / height)
            kept = min(round(width * scale) * round(height * scale), width * height)
            key = (kept, -(cw * ch - kept))
            if key > best_key:
                best, best_key = Grid(rows, cols), key
    return best


def fit_grid(width: int, height: int, size: int, tiles: int) -> Grid:
    """The best grid of at most `tiles` tiles, thumbnail included (a grid of n > 1 cells costs
    n + 1); one tile when the image fits one or no grid of two cells or more fits the budget."""
    if tiles < 3 or max(width, height) <= size:
        return ONE
    return select_grid(width, height, size, tiles - 1)


def grid_for(detail: str, width: int, height: int, budget: Budget, question: str = "") -> Grid:
    """`low`: one tile. `high`: the best grid under the bounds. `auto`: the best grid under the
    question's intent budget (`AUTO_TILES`) and the bounds."""
    tiles = budget.most_tiles()
    tiles = min(tiles, AUTO_TILES[level(detail, question)] or tiles)
    return fit_grid(width, height, budget.size, tiles)


def anyres_grid(
    detail: str, width: int, height: int, rule: PreprocessRule, budget: Budget, question: str = ""
) -> Grid:
    """A tiles rule with pinpoints (LLaVA-OneVision): the processor's best canvas among those
    the level allows (`AUTO_TILES`, the tiles' bound, `max_visual_tokens` counted as the model
    counts them); one view (1 x 1: the image padded to a square) when the best is one tile or
    nothing larger fits."""
    tiles = budget.most_tiles()
    tiles = min(tiles, AUTO_TILES[level(detail, question)] or tiles)
    size, cap = rule.image_size, budget.max_visual_tokens
    allowed = tuple(
        (h, w)
        for h, w in rule.canvases
        if (h // size) * (w // size) < tiles
        and (cap <= 0 or rule.anyres_tokens(h // size, w // size, width, height) <= cap)
    )
    if not allowed:
        return ONE
    h, w = best_pinpoint(width, height, allowed)
    return Grid(h // size, w // size) if h * w > size * size else ONE


def native_budget(
    detail: str, rule: PreprocessRule, question: str = "", max_visual_tokens: int = 0
) -> int:
    """Pixels one frame may take under a native rule: the level's share of `max_pixels`, at most
    `max_visual_tokens` merged tokens (factor^2 pixels each), never below `min_pixels`."""
    pixels = int(rule.max_pixels * NATIVE_SHARE[level(detail, question)])
    if max_visual_tokens > 0:
        pixels = min(pixels, max_visual_tokens * rule.factor**2)
    return max(pixels, rule.min_pixels)


def _first(lo: int, hi: int, wanted: Callable[[int], bool]) -> int:
    """The least value in [lo, hi] where `wanted` (monotone: False then True) holds; hi + 1 if
    none."""
    return lo + bisect_left(range(lo, hi + 1), True, key=wanted)


def native_grid(
    detail: str,
    width: int,
    height: int,
    rule: PreprocessRule,
    question: str = "",
    max_visual_tokens: int = 0,
) -> Grid:
    """A frame's size in merged tokens (rows x cols) under a native rule: Qwen's smart resize
    with `native_budget` as its max_pixels, so the pixels are what the processor makes at that
    budget. Two edges pick another budget, the same rounding: an extreme aspect keeps its short
    side at one token and can overshoot the budget (the largest budget that does not, else
    min_pixels), and rounding down near min_pixels can fall under it (the least budget that
    does not: min_pixels is the floor, as the core's admission requires)."""
    budget = native_budget(detail, rule, question, max_visual_tokens)
    least, f = rule.min_pixels, rule.factor

    def area(pixels: int) -> int:
        h, w = smart_resize(height, width, f, least, pixels)
        return h * w

    chosen = budget
    if area(chosen) > budget:
        chosen = max(least, _first(least, budget, lambda b: area(b) > budget) - 1)
    if area(chosen) < least:
        chosen = min(rule.max_pixels, _first(chosen, rule.max_pixels, lambda b: area(b) >= least))
    h, w = smart_resize(height, width, f, least, chosen)
    return Grid(h // f, w // f)


def views_grid(
    detail: str,
    width: int,
    height: int,
    rule: PreprocessRule,
    question: str = "",
    max_visual_tokens: int = 0,
) -> Grid:
    """A fixed rule's pan-and-scan crop grid (1 x 1: the whole image only): the rule's crops
    for a fine level (`high`, or `auto` with a fine intent), none otherwise; `max_visual_tokens`
    caps the views (whole image plus crops) at `tokens_per_image` each, as a rule with fewer
    crops would cut them, with the whole image as the floor."""
    if level(detail, question) != "fine":
        return ONE
    if max_visual_tokens > 0:
        views = max(1, max_visual_tokens // rule.tokens_per_image)
        rule = rule.bounded(rule.max_pixels, views)
    return Grid(*rule.crop_grid(width, height))


def sample_frames(num_frames: int, max_sampled: int) -> tuple[int, ...]:
    """Up to `max_sampled` frame indices spread uniformly, first and last included."""
    k = min(num_frames, max_sampled)
    if k <= 1:
        return (0,)
    return tuple(round(i * (num_frames - 1) / (k - 1)) for i in range(k))

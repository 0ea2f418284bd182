"""Dynamic resolution: which tile grid an image gets for a `detail` level, and frame sampling.

Pure functions of header values and the question's text, so the gateway can declare every item's
grid to the core before any pixel is decoded, and the worker lays out exactly that grid. The
question is read here, in memory, for a handful of keywords; it is never logged.

`detail=auto` is a per-image visual-token budget: the question's intent picks how many tiles an
image may take (reading, counting or fine detail: as many as `high`; colour, shape or position:
one; anything else: a middle budget), and the image's pixel count and aspect pick the grid under
it (`select_grid`), so a small image stays one tile whatever is asked. Every level is bounded by
`[limits] max_tiles` and by the request's `max_visual_tokens`, with one tile as the floor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    if detail == "low":
        tiles = 1
    elif detail != "high":
        tiles = min(tiles, AUTO_TILES[intent(question)] or tiles)
    return fit_grid(width, height, budget.size, tiles)


def sample_frames(num_frames: int, max_sampled: int) -> tuple[int, ...]:
    """Up to `max_sampled` frame indices spread uniformly, first and last included."""
    k = min(num_frames, max_sampled)
    if k <= 1:
        return (0,)
    return tuple(round(i * (num_frames - 1) / (k - 1)) for i in range(k))

"""Dynamic resolution: which tile grid an image gets for a `detail` level, and frame sampling.

Pure functions of header values, so the gateway can declare every item's grid to the core before
any pixel is decoded, and the worker lays out exactly that grid.
"""

from __future__ import annotations

from dataclasses import dataclass

DETAILS = ("low", "auto", "high")


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


def grid_for(detail: str, width: int, height: int, size: int, max_tiles: int) -> Grid:
    """`low` and `auto`: one tile (the cheapest in visual tokens; callers opt into more).
    `high`: the best grid, when the image has more than one tile's worth of pixels."""
    if detail != "high" or max_tiles <= 1 or max(width, height) <= size:
        return ONE
    return select_grid(width, height, size, max_tiles)


def sample_frames(num_frames: int, max_sampled: int) -> tuple[int, ...]:
    """Up to `max_sampled` frame indices spread uniformly, first and last included."""
    k = min(num_frames, max_sampled)
    if k <= 1:
        return (0,)
    return tuple(round(i * (num_frames - 1) / (k - 1)) for i in range(k))

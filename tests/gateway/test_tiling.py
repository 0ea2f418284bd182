"""`detail=auto` as a per-image visual-token budget: the intent rule, the grid under a budget,
and the bounds (`[limits] max_tiles`, the request's `max_visual_tokens`)."""

from __future__ import annotations

import pytest

from gateway import tiling
from gateway.tiling import ONE, Budget, Grid, grid_for, intent

TILE = 224
PER_TILE = 64  # the demo encoder: 8 x 8 patches per tile
DEFAULT = Budget(TILE, 6, PER_TILE)


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("What number is written?", "fine"),
        ("What small number is written?", "fine"),
        ("How many circles are there?", "fine"),
        ("Read the sign.", "fine"),
        ("What colour is the small text?", "fine"),  # fine wins over coarse
        ("What colour is the triangle?", "coarse"),
        ("Is the red circle left of the blue square?", "coarse"),
        ("Is the square the same colour in both images?", "coarse"),
        ("What is this?", "general"),
        ("", "general"),
        ("COLOR?", "coarse"),  # case does not matter
        ("Is this a colourful countryside?", "general"),  # whole words only
    ],
)
def test_intent_classes(question: str, expected: str) -> None:
    assert intent(question) == expected


def test_low_is_one_tile_and_high_the_best_grid_whatever_is_asked() -> None:
    for question in ("What number is written?", "What colour is it?", ""):
        assert grid_for("low", 896, 448, DEFAULT, question) == ONE
        assert grid_for("high", 448, 448, DEFAULT, question) == Grid(2, 2)
        assert grid_for("high", 672, 448, DEFAULT, question) == Grid(2, 3)


def test_auto_follows_the_intent_budget() -> None:
    reading = grid_for("auto", 448, 448, DEFAULT, "What small number is written?")
    assert reading == grid_for("high", 448, 448, DEFAULT) == Grid(2, 2)
    assert grid_for("auto", 448, 448, DEFAULT, "What colour is the square?") == ONE
    # General questions get at most three tiles: a wide image its two halves and a thumbnail.
    general = grid_for("auto", 448, 224, DEFAULT, "What is this?")
    assert general == Grid(1, 2) and general.num_tiles == 3
    assert grid_for("auto", 448, 448, DEFAULT, "What is this?") == ONE  # 2 cells keep no more


def test_pixel_count_and_aspect_pick_the_grid_under_the_budget() -> None:
    fine = "How many circles are there?"
    assert grid_for("auto", 224, 224, DEFAULT, fine) == ONE  # one tile's worth of pixels
    assert grid_for("auto", 200, 120, DEFAULT, fine) == ONE
    assert grid_for("auto", 1344, 224, DEFAULT, fine) == Grid(1, 6)  # a strip: one row
    assert grid_for("auto", 224, 896, DEFAULT, fine) == Grid(4, 1)
    big = grid_for("auto", 4000, 3000, DEFAULT, fine)
    assert big.rows * big.cols <= 6 and big.cols >= big.rows  # landscape stays landscape


def test_max_visual_tokens_shrinks_the_grid_for_every_level() -> None:
    def bounded(tokens: int) -> Budget:
        return Budget(TILE, 6, PER_TILE, tokens)

    assert grid_for("high", 672, 448, bounded(0), "").num_tiles == 7  # 0 = unset
    assert grid_for("high", 672, 448, bounded(7 * PER_TILE), "").num_tiles == 7
    shrunk = grid_for("high", 672, 448, bounded(5 * PER_TILE), "")
    assert shrunk.num_tiles <= 5 and shrunk.rows * shrunk.cols > 1
    assert grid_for("high", 672, 448, bounded(2 * PER_TILE), "") == ONE  # no grid fits in two
    assert grid_for("auto", 448, 448, bounded(200), "What number is written?") == ONE
    assert grid_for("high", 448, 448, bounded(1), "") == ONE  # one tile is the floor


def test_max_tiles_bounds_every_level() -> None:
    assert grid_for("high", 1344, 224, Budget(TILE, 3, PER_TILE), "") == Grid(1, 3)
    assert grid_for("high", 1344, 224, Budget(TILE, 1, PER_TILE), "") == ONE
    assert grid_for("auto", 1344, 224, Budget(TILE, 3), "What number is written?") == Grid(1, 3)


def test_most_tiles_counts_the_thumbnail() -> None:
    assert Budget(TILE, 6).most_tiles() == 7
    assert Budget(TILE, 6, PER_TILE, 6 * PER_TILE).most_tiles() == 6
    assert Budget(TILE, 6, 0, 10).most_tiles() == 7  # tokens per tile unknown: no token bound
    assert Budget(TILE, 1).most_tiles() == 1
    assert tiling.fit_grid(448, 448, TILE, 5) == Grid(2, 2)
    assert tiling.fit_grid(448, 448, TILE, 4) == ONE  # 2 x 2 needs 5 tiles; 1 x 2 keeps no more


def test_max_visual_tokens_travels_from_the_client_to_the_gateway_ask() -> None:
    from gateway.servicer import ask_from_proto
    from visor import request

    req = request.build("What number is written?", [b"x"], detail="high", max_visual_tokens=320)
    assert req.max_visual_tokens == 320
    ask = ask_from_proto(req)
    assert (ask.detail, ask.max_visual_tokens) == ("high", 320)
    assert ask_from_proto(request.build("hi")).max_visual_tokens == 0  # unset
    with pytest.raises(ValueError, match="max_visual_tokens"):
        request.build("hi", max_visual_tokens=-1)

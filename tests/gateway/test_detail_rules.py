"""`detail` and `max_visual_tokens` under the native (Qwen) and fixed (Gemma) rules: the pixel
budget per intent, the processor's own rounding at that budget, the bounds (`min_pixels` as the
floor, `[limits] max_pixels`, the request's `max_visual_tokens`), aspect extremes, and the crops
a fixed rule keeps per level. Every planned shape passes the core's admission check."""

from __future__ import annotations

import random
import warnings
from dataclasses import replace
from typing import Any

import pytest
from PIL import Image

from gateway import decode, tiling
from gateway.config import LimitsConfig
from gateway.pipeline import bounded_rule, plan_media
from gateway.tiling import ONE, Grid, level, native_budget, native_grid, views_grid
from shared.errors import VisorError
from shared.preprocess import PreprocessRule, smart_resize

HALF = (0.5, 0.5, 0.5)
NATIVE = PreprocessRule(
    "native", HALF, HALF, "bicubic", patch_size=14, merge_size=2, temporal_patch_size=2,
    min_pixels=3136, max_pixels=1280 * 28 * 28,
)  # fmt: skip
FIXED = PreprocessRule(
    "fixed", HALF, HALF, "bilinear", image_size=896, tokens_per_image=256, pan_and_scan=True,
    min_crop_size=256, max_num_crops=4, min_ratio_to_activate=1.2,
)  # fmt: skip
READING, COLOUR, OTHER = "What number is written on the sign?", "What colour is it?", "Why?"
TOKEN = 28 * 28  # pixels of one merged token


def _tokens(grid: Grid) -> int:
    return grid.rows * grid.cols


def _processor_grid(width: int, height: int, rule: PreprocessRule, max_pixels: int) -> Grid:
    """The merged-token grid transformers' Qwen processor makes at this max_pixels."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = transformers.Qwen2VLImageProcessorPil(
            min_pixels=rule.min_pixels, max_pixels=max_pixels
        )
        out = processor(images=[Image.new("RGB", (width, height))])
    _, h, w = (int(v) for v in out["image_grid_thw"][0])
    return Grid(h // rule.merge_size, w // rule.merge_size)


def test_levels_spend_as_intents() -> None:
    assert [level("low", q) for q in (READING, COLOUR, OTHER)] == ["coarse"] * 3
    assert [level("high", q) for q in (READING, COLOUR, OTHER)] == ["fine"] * 3
    assert [level("auto", q) for q in (READING, COLOUR, OTHER)] == ["fine", "coarse", "general"]


def test_native_budget_per_level_and_intent() -> None:
    top = NATIVE.max_pixels
    assert native_budget("high", NATIVE, COLOUR) == top
    assert native_budget("auto", NATIVE, READING) == top
    assert native_budget("auto", NATIVE, OTHER) == top // 4  # half of each side
    assert native_budget("auto", NATIVE, COLOUR) == top // 16 == 80 * TOKEN
    assert native_budget("low", NATIVE, READING) == top // 16
    # The request's bound in merged tokens, and min_pixels as the floor (a clamp, no refusal).
    assert native_budget("high", NATIVE, "", 100) == 100 * TOKEN
    assert native_budget("low", NATIVE, "", 500) == 80 * TOKEN  # the level is tighter
    assert native_budget("high", NATIVE, "", 1) == NATIVE.min_pixels
    tight = replace(NATIVE, min_pixels=200 * TOKEN)
    assert native_budget("low", tight) == 200 * TOKEN  # the level's share is under the minimum


@pytest.mark.parametrize("size", [(3000, 2000), (641, 479), (37, 1001), (1200, 400), (900, 900)])
def test_native_grid_is_the_processors_resize_at_the_budget(size: tuple[int, int]) -> None:
    width, height = size
    for detail, question in [("low", ""), ("auto", OTHER), ("auto", READING), ("high", "")]:
        budget = native_budget(detail, NATIVE, question)
        h, w = smart_resize(height, width, NATIVE.factor, NATIVE.min_pixels, budget)
        got = native_grid(detail, width, height, NATIVE, question)
        assert got == Grid(h // 28, w // 28), (size, detail)
        assert got == _processor_grid(width, height, NATIVE, budget), (size, detail)


def test_a_reading_question_gets_more_tokens_than_a_colour_question() -> None:
    big = [native_grid("auto", 3000, 2000, NATIVE, q) for q in (COLOUR, OTHER, READING)]
    assert _tokens(big[0]) < _tokens(big[1]) < _tokens(big[2]) <= 1280
    assert _tokens(big[2]) == _tokens(native_grid("high", 3000, 2000, NATIVE))
    assert _tokens(big[0]) == _tokens(native_grid("low", 3000, 2000, NATIVE)) <= 80
    # A small image fits every budget: its pixel count, not the question, sets its size.
    small = {native_grid("auto", 200, 150, NATIVE, q) for q in (COLOUR, OTHER, READING)}
    assert small == {native_grid("high", 200, 150, NATIVE)} == {Grid(5, 7)}


def test_max_visual_tokens_bounds_every_level_with_min_pixels_as_the_floor() -> None:
    for detail in ("low", "auto", "high"):
        for bound in (4, 9, 50, 200, 10_000):
            grid = native_grid(detail, 1600, 1200, NATIVE, READING, bound)
            assert _tokens(grid) <= bound, (detail, bound)
            assert _tokens(grid) * TOKEN >= NATIVE.min_pixels
    assert native_grid("high", 1600, 1200, NATIVE, "", 0) == native_grid("high", 1600, 1200, NATIVE)
    # Under the rule's minimum (four tokens) the frame keeps the minimum, as tiles keep one tile.
    assert _tokens(native_grid("high", 1600, 1200, NATIVE, "", 1)) == 4


def test_aspect_extremes_stay_admissible() -> None:
    # 199:1 at `low`: smart resize at the budget keeps the short side at one token and
    # overshoots (126 tokens for 80); a smaller budget, the same rounding, stays within it.
    budget = native_budget("low", NATIVE)
    h, w = smart_resize(100, 19_900, 28, NATIVE.min_pixels, budget)
    assert h == 28 and h * w > budget
    low = native_grid("low", 19_900, 100, NATIVE)
    assert low.rows == 1 and 70 <= _tokens(low) <= 80
    assert _tokens(low) < _tokens(native_grid("high", 19_900, 100, NATIVE)) <= 1280
    # 183:1 cannot come under 27 tokens at min_pixels: a bound of 20 gets that least size.
    tall = native_grid("low", 60, 11_000, NATIVE, "", 20)
    least = smart_resize(11_000, 60, 28, NATIVE.min_pixels, NATIVE.min_pixels)
    assert (tall.rows * 28, tall.cols * 28) == least == (27 * 28, 28)
    for w, h in [(19_900, 100), (60, 11_000), (1, 150), (150, 1), (28, 28), (5, 5)]:
        for detail in ("low", "auto", "high"):
            grid = native_grid(detail, w, h, NATIVE, OTHER, 6)
            NATIVE.check_shape(NATIVE.item_shape(grid.rows, grid.cols))


def _rules() -> list[PreprocessRule]:
    """Rules with the minimum near the maximum (rounding down can fall under it), odd minima,
    and Qwen's own defaults."""
    return [
        NATIVE,
        replace(NATIVE, min_pixels=56 * 56, max_pixels=12_845_056),
        replace(NATIVE, min_pixels=100_000, max_pixels=200_000),
        replace(NATIVE, min_pixels=5_000, max_pixels=16 * TOKEN),
        replace(NATIVE, patch_size=16, min_pixels=1, max_pixels=32 * 32 * 5),
    ]


def test_every_planned_native_shape_passes_admission() -> None:
    """A sweep of sizes (aspects up to 200:1), levels and bounds: the core's admission accepts
    every shape, min_pixels is never undercut, and the budget is kept unless one side is a
    single token or the minimum forbids it. Sizes whose resize under the rule itself is refused
    are left out: smart resize's growing branch can overshoot a max_pixels near min_pixels (a
    4 x 506 image under [100000, 200000] becomes 56 x 3584), whatever the level."""
    rng = random.Random(7)
    sizes = [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(150)]
    sizes += [(s, max(1, s // rng.randint(2, 200))) for s in rng.sample(range(200, 9000), 40)]
    sizes = [(w, h) if rng.random() < 0.5 else (h, w) for w, h in sizes]
    checked = 0
    for rule in _rules():
        for w, h in sizes:
            if max(w, h) > 200 * min(w, h) or not _admissible(rule, w, h):
                continue
            checked += 1
            for detail, bound in [("low", 0), ("auto", 0), ("high", 0), ("high", 7), ("auto", 33)]:
                grid = native_grid(detail, w, h, rule, OTHER, bound)
                shape = rule.item_shape(grid.rows, grid.cols)
                rule.check_shape(shape)
                pixels = shape[2] * shape[3]
                assert pixels >= rule.min_pixels, (rule, w, h, detail)
                budget = native_budget(detail, rule, OTHER, bound)
                if pixels > budget and min(grid.rows, grid.cols) > 1:
                    # Only the minimum overshoots: the processor grows a small image past it
                    # (ceil), or rounding down at the budget undercuts it.
                    at = smart_resize(h, w, rule.factor, rule.min_pixels, budget)
                    grown = at == shape[2:]
                    assert grown or at[0] * at[1] < rule.min_pixels, (rule, w, h, detail)
    assert checked > 900


def _admissible(rule: PreprocessRule, width: int, height: int) -> bool:
    h, w = smart_resize(height, width, rule.factor, rule.min_pixels, rule.max_pixels)
    try:
        rule.check_shape((1, 3, h, w))
    except VisorError:
        return False
    return True


def test_limits_max_pixels_bounds_high() -> None:
    lim = LimitsConfig(max_pixels=200 * TOKEN)
    rule = bounded_rule(NATIVE, lim)
    plan = plan_media(0, decode.Probe(3000, 2000, 1), False, "high", rule, lim)
    assert _tokens(plan.grid) <= 200 and plan.stacked
    NATIVE.check_shape(rule.item_shape(plan.grid.rows, plan.grid.cols))


# ---- fixed (Gemma) -----------------------------------------------------------------------------


def test_fixed_crops_for_fine_levels_only() -> None:
    wide = (2400, 300)  # four crops under the rule
    assert FIXED.crop_grid(*wide) == (1, 4)
    assert views_grid("high", *wide, FIXED, COLOUR) == Grid(1, 4)
    assert views_grid("auto", *wide, FIXED, READING) == Grid(1, 4)
    assert views_grid("auto", *wide, FIXED, COLOUR) == ONE
    assert views_grid("auto", *wide, FIXED, OTHER) == ONE
    assert views_grid("low", *wide, FIXED, READING) == ONE
    assert views_grid("high", 900, 900, FIXED) == ONE  # a square image makes no crops
    assert views_grid("high", *wide, replace(FIXED, pan_and_scan=False)) == ONE


def test_max_visual_tokens_caps_the_views() -> None:
    wide, per = (2400, 300), FIXED.tokens_per_image
    assert views_grid("high", *wide, FIXED, "", 5 * per) == Grid(1, 4)  # whole image + 4 crops
    assert views_grid("high", *wide, FIXED, "", 4 * per) == Grid(1, 3)
    assert views_grid("high", *wide, FIXED, "", 3 * per) == Grid(1, 2)
    assert views_grid("high", *wide, FIXED, "", 3 * per - 1) == ONE  # one crop is never made
    assert views_grid("high", 300, 2400, FIXED, "", 3 * per) == Grid(2, 1)
    assert views_grid("high", *wide, FIXED, "", 1) == ONE  # the whole image is the floor
    for bound in (0, 1, 2 * per, 3 * per, 4 * per, 9 * per):
        grid = views_grid("high", *wide, FIXED, "", bound)
        shape = FIXED.item_shape(grid.rows, grid.cols)
        FIXED.check_shape(shape)
        assert bound == 0 or FIXED.visual_tokens(shape) <= max(bound, per)


def _gemma_views(width: int, height: int, **settings: Any) -> int:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = transformers.Gemma3ImageProcessorPil(
            size={"height": 64, "width": 64},
            do_pan_and_scan=True,
            pan_and_scan_min_crop_size=32,
            pan_and_scan_min_ratio_to_activate=1.2,
            **settings,
        )
        out = processor(images=[Image.new("RGB", (width, height))])
    return len(out["pixel_values"])


def test_capped_views_are_what_the_processor_cuts_with_fewer_crops() -> None:
    rule = replace(FIXED, image_size=64, min_crop_size=32, tokens_per_image=16)
    for width, height in [(640, 100), (100, 400), (300, 200)]:
        for crops in (2, 3, 4):
            grid = views_grid("high", width, height, rule, "", (crops + 1) * 16)
            shape = rule.item_shape(grid.rows, grid.cols)
            want = _gemma_views(width, height, pan_and_scan_max_num_crops=crops)
            assert shape[0] == want, (width, height, crops)


def test_plan_media_passes_the_level_to_every_kind() -> None:
    probe, lim = decode.Probe(2400, 300, 1), LimitsConfig()
    fixed = [plan_media(0, probe, False, d, FIXED, lim, READING).grid for d in tiling.DETAILS]
    assert fixed == [ONE, Grid(1, 4), Grid(1, 4)]
    native = [plan_media(0, probe, False, d, NATIVE, lim, COLOUR).grid for d in tiling.DETAILS]
    assert _tokens(native[0]) == _tokens(native[1]) < _tokens(native[2])
    bounded = plan_media(0, probe, False, "high", NATIVE, lim, "", max_visual_tokens=30)
    assert _tokens(bounded.grid) <= 30

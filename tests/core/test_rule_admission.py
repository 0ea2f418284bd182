"""Admission under the native and fixed rules (the demo's tokenizer, a core that declares Qwen's
or Gemma's rule): a declared item must have the shape its grid implies under the rule and within
the rule's bounds, and counts the visual tokens the rule says, then what the compression profile
keeps of them, before any tensor arrives."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from core import compression
from core.config import SchedulerConfig
from core.engine import Engine
from core.input_processor import InputProcessor
from core.model.tokenizer import ChatTurn
from core.types import InferRequest, ItemSpec, SamplingParams
from shared.errors import Reason, VisorError
from shared.preprocess import PreprocessRule

NATIVE = PreprocessRule(
    "native", (0.5,) * 3, (0.5,) * 3, "bicubic", patch_size=14, merge_size=2,
    temporal_patch_size=2, min_pixels=3136, max_pixels=1003520,
)  # fmt: skip
FIXED = PreprocessRule(
    "fixed", (0.5,) * 3, (0.5,) * 3, "bilinear", image_size=896, tokens_per_image=256,
    pan_and_scan=True, min_crop_size=256, max_num_crops=4, min_ratio_to_activate=1.2,
)  # fmt: skip


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    e = Engine(model_dir, "rules")
    yield e
    e.close()


def _inputs(engine: Engine, rule: PreprocessRule, max_tokens: int = 100_000) -> InputProcessor:
    info = dataclasses.replace(engine.info, rule=rule)
    return InputProcessor(engine.tokenizer, info, SchedulerConfig(), max_tokens, engine.grammars)


def _item(rule: PreprocessRule, rows: int, cols: int, shape: tuple[int, ...]) -> ItemSpec:
    return ItemSpec("0" * 64, rule.version(), rule.resolution, rows, cols, "uint8", shape)


def _req(*items: ItemSpec) -> InferRequest:
    turns = (ChatTurn("user", "What is it?", len(items)),)
    return InferRequest("t", "r", turns, SamplingParams(4), items, "none")


def _refused(inputs: InputProcessor, item: ItemSpec) -> str:
    with pytest.raises(VisorError) as err:
        inputs.check(_req(item))
    assert err.value.reason == Reason.INVALID_REQUEST
    return err.value.message


def test_native_items_count_tokens_by_the_rule(engine: Engine) -> None:
    inputs = _inputs(engine, NATIVE)
    still = _item(NATIVE, 20, 30, (1, 3, 560, 840))  # H != W
    small = _item(NATIVE, 2, 3, (1, 3, 56, 84))
    _, counts, slots = inputs.check(_req(still, small))
    assert counts == (600, 6) and slots == (1, 1)


def test_native_items_of_several_frames_are_refused_without_video(engine: Engine) -> None:
    """An animation or video stacked into one native item is refused before any pixel is sent:
    without its frame interval (no video positions), or by a model that serves no video (the
    demo's tokenizer names no video token; tests/core/test_video_items.py admits one)."""
    inputs = _inputs(engine, NATIVE)
    frames = _item(NATIVE, 20, 30, (4, 3, 560, 840))
    assert "frame_interval_s" in _refused(inputs, frames)
    message = _refused(inputs, dataclasses.replace(frames, frame_interval_s=0.5))
    assert "still images only" in message and "max_sampled_frames" in message


@pytest.mark.parametrize("profile", list(compression.PROFILES))
def test_profiles_count_the_tokens_compression_leaves_native_and_fixed(
    engine: Engine, profile: str
) -> None:
    """Under a profile a Qwen image counts the tokens its (h, w) grid keeps and a Gemma image
    each view's share, the number compression really leaves; a request whose total is exactly
    the cap is admitted, one token more is refused (TOKEN_BUDGET) before any pixel arrives."""
    chosen = compression.profile(profile)
    items = {
        NATIVE: _item(NATIVE, 20, 30, (1, 3, 560, 840)),  # 600 tokens, one (20, 30) grid
        FIXED: _item(FIXED, 1, 3, (4, 3, 896, 896)),  # four views of 16 x 16
    }
    balanced = {NATIVE: 300, FIXED: 4 * 128}
    rng = np.random.default_rng(0)
    for rule, item in items.items():
        req = dataclasses.replace(_req(item), profile=profile)
        ids, (count,), slots = _inputs(engine, rule).check(req)
        full = rule.visual_tokens(item.shape)
        units = compression.layout(rule, item.shape)
        feats = rng.standard_normal((full, 8)).astype(np.float32)
        out = compression.compress_item(
            feats, rng.random(full), units.num_units, chosen, 1, units.grid
        )[0]
        assert count == out.shape[0] and (count < full) == bool(chosen.steps)
        if profile == "balanced":
            assert count == balanced[rule]
        total = len(ids) - sum(slots) + count + req.params.max_new_tokens
        assert _inputs(engine, rule, total).check(req)[1] == (count,)
        with pytest.raises(VisorError) as err:
            _inputs(engine, rule, total - 1).check(req)
        assert err.value.reason == Reason.TOKEN_BUDGET


def test_native_shapes_that_break_the_rule_are_refused(engine: Engine) -> None:
    inputs = _inputs(engine, NATIVE)
    assert "geometry" in _refused(inputs, _item(NATIVE, 20, 30, (1, 3, 560, 841)))  # grid != shape
    assert "max_pixels" in _refused(inputs, _item(NATIVE, 40, 40, (1, 3, 1120, 1120)))
    assert "min_pixels" in _refused(inputs, _item(NATIVE, 1, 1, (1, 3, 28, 28)))
    assert "max_item_tiles" in _refused(inputs, _item(NATIVE, 2, 2, (17, 3, 56, 56)))
    stale = dataclasses.replace(_item(NATIVE, 20, 30, (1, 3, 560, 840)), preprocess_version="pp1")
    assert "geometry" in _refused(inputs, stale)
    tiled = dataclasses.replace(_item(NATIVE, 20, 30, (1, 3, 560, 840)), resolution=336)
    assert "geometry" in _refused(inputs, tiled)


def test_fixed_items_count_views_and_bound_crops(engine: Engine) -> None:
    inputs = _inputs(engine, FIXED)
    _, counts, _ = inputs.check(
        _req(_item(FIXED, 1, 1, (1, 3, 896, 896)), _item(FIXED, 1, 3, (4, 3, 896, 896)))
    )
    assert counts == (256, 1024)
    assert "max_num_crops" in _refused(inputs, _item(FIXED, 1, 5, (6, 3, 896, 896)))
    assert "geometry" in _refused(inputs, _item(FIXED, 1, 1, (1, 3, 896, 672)))


ANYRES = PreprocessRule(
    "tiles", (0.5,) * 3, (0.5,) * 3, "bicubic", image_size=384, tokens_per_tile=729,
    pinpoints=(384, 384, 384, 768, 768, 384, 768, 768, 768, 1152), anyres_max=9,
)  # fmt: skip


def test_anyres_items_count_the_unpadded_grid_and_its_newlines(engine: Engine) -> None:
    """LLaVA-OneVision: one view is its tile and a newline; a 777 x 555 image on a 2 x 3 grid
    (54 x 81 tokens) unpads to 54 x 75 (its aspect), a newline closing each row, after the
    whole image's tile; a square image on 2 x 2 keeps all 54 x 54 (under 9 tiles' worth, no
    downscale: tests/core/test_llava_onevision.py covers it)."""
    inputs = _inputs(engine, ANYRES)
    one = dataclasses.replace(_item(ANYRES, 1, 1, (1, 3, 384, 384)), source_width=90)
    one = dataclasses.replace(one, source_height=60)
    grid = _item(ANYRES, 2, 3, (7, 3, 384, 384))
    grid = dataclasses.replace(grid, source_width=777, source_height=555)
    square = _item(ANYRES, 2, 2, (5, 3, 384, 384))
    square = dataclasses.replace(square, source_width=700, source_height=700)
    _, counts, slots = inputs.check(_req(one, grid, square))
    assert counts == (730, 729 + 54 * 76, 729 + 54 * 55) and slots == (1, 1, 1)


def test_anyres_items_are_refused_without_their_geometry_or_with_a_profile(engine: Engine) -> None:
    inputs = _inputs(engine, ANYRES)
    grid = _item(ANYRES, 2, 3, (7, 3, 384, 384))
    assert "source size" in _refused(inputs, grid)  # 0 x 0: a gateway that did not say
    sized = dataclasses.replace(grid, source_width=777, source_height=555)
    off_grid = dataclasses.replace(_item(ANYRES, 1, 3, (4, 3, 384, 384)), source_width=900)
    assert "pinpoints" in _refused(inputs, dataclasses.replace(off_grid, source_height=300))
    with pytest.raises(VisorError) as err:
        inputs.check(dataclasses.replace(_req(sized), profile="balanced"))
    assert err.value.reason == Reason.INVALID_REQUEST and "profile" in err.value.message

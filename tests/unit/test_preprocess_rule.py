"""Preprocessing rules: the digest moves with every field, the proto round trip is exact, shapes
and visual tokens per kind, the smart-resize and pan-and-scan arithmetic agree with transformers'
own functions, cache keys differ across rules, and a checkpoint's processor config becomes a rule
in both layouts (malformed settings are refused with the file and key named)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from core.model.config import ModelConfigError
from core.model.preprocessing import rule_for
from shared.errors import Reason, VisorError
from shared.hashing import FeatureKey
from shared.preprocess import PreprocessRule, crop_boxes, smart_resize, tiles
from shared.proto import core_pb2, rule_from_proto, rule_to_proto

HALF = (0.5, 0.5, 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TILES = tiles(336, 576, CLIP_MEAN, CLIP_STD)
NATIVE = PreprocessRule(
    "native", CLIP_MEAN, CLIP_STD, "bicubic", patch_size=14, merge_size=2,
    temporal_patch_size=2, min_pixels=3136, max_pixels=1003520,
)  # fmt: skip
FIXED = PreprocessRule(
    "fixed", HALF, HALF, "bilinear", image_size=896, tokens_per_image=256, pan_and_scan=True,
    min_crop_size=256, max_num_crops=4, min_ratio_to_activate=1.2,
)  # fmt: skip
ANYRES = PreprocessRule(
    "tiles", HALF, HALF, "bicubic", image_size=384, tokens_per_tile=729,
    pinpoints=(384, 384, 384, 768, 768, 384, 768, 768), anyres_max=9,
)  # fmt: skip
RULES = {"tiles": TILES, "native": NATIVE, "fixed": FIXED, "anyres": ANYRES}


@pytest.mark.parametrize("name", list(RULES))
def test_proto_round_trip_is_exact_and_keeps_the_digest(name: str) -> None:
    rule = RULES[name]
    rule.validate()
    wire = core_pb2.PreprocessRule.FromString(rule_to_proto(rule).SerializeToString())
    back = rule_from_proto(wire)
    assert back == rule and back.digest() == rule.digest()
    assert rule.version() == f"pp1-{rule.digest()}"


def test_every_field_moves_the_digest() -> None:
    digests = {FIXED.digest()}
    for f in dataclasses.fields(PreprocessRule):
        value = getattr(FIXED, f.name)
        if isinstance(value, bool):
            changed = not value
        elif isinstance(value, int | float):
            changed = value + 1
        elif isinstance(value, tuple):
            changed = (value[0] + 0.01, *value[1:]) if value else (384, 768)
        else:
            changed = "native" if value != "native" else "tiles"
        digests.add(dataclasses.replace(FIXED, **{f.name: changed}).digest())
    assert len(digests) == len(dataclasses.fields(PreprocessRule)) + 1
    assert len({r.digest() for r in RULES.values()}) == len(RULES)


def test_an_unusable_rule_from_a_core_is_refused() -> None:
    for bad in (
        dataclasses.replace(NATIVE, merge_size=0),
        dataclasses.replace(TILES, kind="spiral"),
        dataclasses.replace(FIXED, resample="lanczos"),
        dataclasses.replace(FIXED, std=(0.5, 0.0, 0.5)),
        dataclasses.replace(ANYRES, pinpoints=(384, 500)),  # not whole tiles
        dataclasses.replace(ANYRES, pinpoints=(384,)),  # not pairs
        dataclasses.replace(ANYRES, tokens_per_tile=730),  # no square of tokens to unpad
        dataclasses.replace(NATIVE, pinpoints=(14, 14)),  # only a tiles rule has canvases
    ):
        with pytest.raises(ValueError):
            rule_from_proto(rule_to_proto(bad))


def test_shapes_and_visual_tokens_per_kind() -> None:
    assert TILES.visual_tokens(TILES.item_shape(2, 3)) == 7 * 576
    assert NATIVE.item_shape(20, 30, 4) == (4, 3, 560, 840)
    assert NATIVE.visual_tokens((4, 3, 560, 840)) == 20 * 30 * 2
    assert NATIVE.visual_tokens((3, 3, 560, 840)) == 20 * 30 * 2  # the last patch is padded
    assert NATIVE.visual_tokens((1, 3, 56, 56)) == 4
    assert FIXED.visual_tokens(FIXED.item_shape(1, 3)) == 4 * 256
    for rule, shape in (
        (NATIVE, (1, 3, 560, 840)),
        (FIXED, (5, 3, 896, 896)),
        (TILES, (7, 3, 336, 336)),
    ):
        rule.check_shape(shape)
    broken = [
        (NATIVE, (1, 3, 560, 841)),  # not a multiple of 28
        (NATIVE, (1, 3, 28, 28)),  # under min_pixels
        (NATIVE, (1, 3, 1120, 1120)),  # over max_pixels
        (NATIVE, (1, 4, 560, 840)),
        (FIXED, (6, 3, 896, 896)),  # more than 4 crops
        (FIXED, (2, 3, 896, 896)),  # one crop never happens
        (FIXED, (1, 3, 896, 895)),
        (TILES, (1, 3, 336, 224)),
    ]
    for rule, shape in broken:
        with pytest.raises(VisorError) as err:
            rule.check_shape(shape)
        assert err.value.reason == Reason.INVALID_REQUEST, (rule.kind, shape)
    # A long strip keeps one token's side past max_pixels, as smart_resize makes it.
    small = dataclasses.replace(NATIVE, max_pixels=28 * 28 * 100)
    h, w = smart_resize(20, 20 * 199, 28, small.min_pixels, small.max_pixels)
    assert h == 28 and h * w > small.max_pixels
    small.check_shape((1, 3, h, w))


def test_smart_resize_and_pan_and_scan_agree_with_transformers() -> None:
    qwen = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    gemma_mod = pytest.importorskip("transformers.models.gemma3.image_processing_pil_gemma3")
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 5000, (300, 2))]
    sizes += [(8, 8), (28, 28), (27, 5000), (4000, 3000), (1, 150)]
    for h, w in sizes:
        if max(h, w) > 200 * min(h, w):
            with pytest.raises(VisorError):
                smart_resize(h, w, 28, 3136, 1003520)
            continue
        assert smart_resize(h, w, 28, 3136, 1003520) == qwen.smart_resize(h, w, 28, 3136, 1003520)
    processor = gemma_mod.Gemma3ImageProcessorPil()
    for h, w in sizes[:200]:
        image = np.zeros((1, h, w), np.uint8)
        crops = processor.pan_and_scan(image, 256, 4, 1.2)
        rows, cols = FIXED.crop_grid(w, h)
        assert len(crops) == (rows * cols if rows * cols > 1 else 0), (h, w)
        boxes = crop_boxes(w, h, rows, cols) if crops else []
        assert [(b[3] - b[1], b[2] - b[0]) for b in boxes] == [c.shape[1:] for c in crops]


def test_two_rules_give_the_same_bytes_different_keys() -> None:
    """Changing the rule misses; the same image under two families never collides."""

    def key(rule: PreprocessRule, encoder: str, rows: int, cols: int) -> bytes:
        shape = rule.item_shape(rows, cols)
        return FeatureKey(
            "t", "ab" * 32, encoder, "d" * 64, rule.version(), rule.resolution, rows, cols, 0, shape
        ).encode()

    looser = dataclasses.replace(NATIVE, max_pixels=2**21)
    assert key(NATIVE, "qwen", 20, 30) != key(looser, "qwen", 20, 30)
    # Same encoder name and grid numbers under two kinds: the version and shape still differ.
    assert len({key(TILES, "m", 1, 1), key(FIXED, "m", 1, 1), key(NATIVE, "m", 1, 1)}) == 3


def _checkpoint(tmp: Path, model_type: str, files: dict[str, object]) -> Path:
    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name, body in files.items():
        (tmp / name).write_text(json.dumps(body))
    return tmp


QWEN_PROC = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "resample": 3,
}  # fmt: skip


def test_rule_for_reads_both_layouts(tmp_path: Path) -> None:
    flat = {"preprocessor_config.json": QWEN_PROC}
    hub = rule_for(_checkpoint(tmp_path / "hub", "qwen2_5_vl", flat), "qwen2_5_vl")
    nested = {"processor_config.json": {"image_processor": QWEN_PROC, "processor_class": "X"}}
    v5 = rule_for(_checkpoint(tmp_path / "v5", "qwen2_5_vl", nested), "qwen2_5_vl")
    assert hub == v5 == dataclasses.replace(NATIVE, max_pixels=12845056)
    sized = {
        "preprocessor_config.json": {
            **QWEN_PROC,
            "size": {"shortest_edge": 65536, "longest_edge": 2**22},
        }
    }
    rule = rule_for(_checkpoint(tmp_path / "sized", "qwen3_vl", sized), "qwen3_vl")
    assert (rule.min_pixels, rule.max_pixels) == (65536, 2**22)
    gemma = rule_for(_checkpoint(tmp_path / "gemma", "gemma3", {}), "gemma3")  # the defaults
    no_crops = {"pan_and_scan": False, "min_crop_size": 0, "max_num_crops": 0}
    assert gemma == dataclasses.replace(FIXED, **no_crops, min_ratio_to_activate=0.0)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"resample": 1}, "resample"),
        ({"do_resize": False}, "do_resize"),
        ({"rescale_factor": 1.0}, "rescale_factor"),
        ({"patch_size": "14"}, "patch_size"),
        ({"merge_size": 0}, "merge"),
        ({"image_mean": ["x", 1, 2]}, "image_mean"),
    ],
)
def test_rule_for_refuses_what_the_gateway_cannot_apply(
    tmp_path: Path, change: dict[str, object], named: str
) -> None:
    ckpt = _checkpoint(
        tmp_path, "qwen2_5_vl", {"preprocessor_config.json": {**QWEN_PROC, **change}}
    )
    with pytest.raises(ModelConfigError) as err:
        rule_for(ckpt, "qwen2_5_vl")
    assert "preprocessor_config.json" in str(err.value)
    assert named in str(err.value)


def test_rule_for_llava_is_the_tiled_rule_of_its_config(model_dir: Path) -> None:
    from core.model import config

    cfg = config.load(model_dir)
    rule = rule_for(model_dir, "llava")
    assert rule == tiles(cfg.vision.image_size, cfg.tokens_per_tile, cfg.image_mean, cfg.image_std)
    assert math.isclose(rule.mean[0], cfg.image_mean[0])
    with pytest.raises(ModelConfigError):
        rule_for(model_dir, "mystery_vl")


def test_a_gateway_reads_a_core_that_predates_the_rule_as_tiles() -> None:
    from gateway.core_client import CoreUnreachable, geometry_from_proto

    old = core_pb2.CoreInfo(
        core_id="c", image_size=336, tokens_per_tile=576, preprocess_version="pp1",
        image_mean=CLIP_MEAN, image_std=CLIP_STD,
    )  # fmt: skip
    geo = geometry_from_proto(old)
    assert geo.rule.kind == "tiles" and geo.rule.image_size == 336
    assert geo.preprocess_version == "pp1"  # echoed: the old core checks its own version
    assert geo.fill == (123, 117, 104)
    new = core_pb2.CoreInfo(core_id="c", preprocess_version=NATIVE.version())
    new.rule.CopyFrom(rule_to_proto(NATIVE))
    assert geometry_from_proto(new).rule == NATIVE
    new.rule.merge_size = 0
    with pytest.raises(CoreUnreachable):
        geometry_from_proto(new)


def test_rules_without_pinpoints_keep_their_digests() -> None:
    """The anyres fields enter a digest only when set: cached features stay valid."""
    for rule in (TILES, NATIVE, FIXED):
        fields = dataclasses.asdict(rule)
        old = {k: v for k, v in fields.items() if k not in ("pinpoints", "anyres_max")}
        encoded = json.dumps(old, sort_keys=True).encode()
        assert rule.digest() == hashlib.sha256(encoded).hexdigest()

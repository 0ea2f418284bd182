"""The gateway's workers preprocess as the model's own processor does: for corpus files and
generated images of odd sizes, the uint8 pixels a real sandboxed worker produces under a rule
match what transformers' `Qwen2VLImageProcessorPil` / `Gemma3ImageProcessorPil` produce for the
same file (their float output brought back to uint8 with their mean, std and rescale), within 1.

The rule comes from the processor's own saved config through `core.model.preprocessing.rule_for`,
and the geometry from the gateway's planner (`plan_media`, `decode_spec`), so the test covers the
whole path from checkpoint to worker. transformers is a test dependency only."""

from __future__ import annotations

import asyncio
import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps

from core.model.preprocessing import rule_for
from gateway import decode
from gateway.config import LimitsConfig
from gateway.pipeline import bounded_rule, decode_spec, plan_media
from gateway.pool import DecodePool, PoolSettings
from gateway.sniff import sniff
from shared.preprocess import PreprocessRule
from tests.conftest import CORPUS, corpus_rows, need_corpus

transformers = pytest.importorskip("transformers")
MIB = 1024 * 1024
LIMITS = LimitsConfig()


class Worker:
    """A one-worker pool and the one event loop it lives in."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.pool = DecodePool(PoolSettings(1, 30.0, 1000, 1 << 25, 1024 * MIB, 64 * MIB, 8))
        self.runner.run(self.pool.start())

    def run(self, job: str, args: dict[str, Any], data: bytes) -> Any:
        return self.runner.run(self.pool.run(job, args, data))

    def close(self) -> None:
        self.pool.close()
        self.runner.close()


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


def _processor(kind: str, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "qwen2_5_vl":
            return transformers.Qwen2VLImageProcessorPil(**kwargs)
        if kind == "qwen3_vl":  # Qwen3-VL's processor is Qwen2-VL's at 16 px patches
            half = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
            return transformers.Qwen2VLImageProcessorPil(patch_size=16, **half, **kwargs)
        return transformers.Gemma3ImageProcessorPil(**kwargs)


def _rule(tmp: Path, model_type: str, processor: Any) -> PreprocessRule:
    """The rule the core reads from a checkpoint that holds this processor's config."""
    processor.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps({"model_type": model_type}))
    return rule_for(tmp, model_type)


def gateway_views(worker: Worker, data: bytes, rule: PreprocessRule) -> np.ndarray:
    """Frame 0 as the worker sends it to the core: (views, 3, H, W) uint8."""
    fmt = sniff(data)
    lim = LIMITS
    probe_args = {"fmt": fmt, "max_pixels": lim.max_pixels, "max_side": lim.max_side}
    body = worker.run("probe", {**probe_args, "max_frames": lim.max_frames}, data).body
    probe = decode.Probe(int(body["width"]), int(body["height"]), int(body["num_frames"]))
    bounded = bounded_rule(rule, lim)
    plan = plan_media(0, probe, False, "high", bounded, lim)
    spec = decode_spec(fmt, plan.grid, (0,), bounded, (0, 0, 0), lim)
    (array,) = worker.run("decode", spec.to_json(), data).arrays
    assert array.shape == bounded.item_shape(plan.grid.rows, plan.grid.cols)
    return np.asarray(array)


def _to_uint8(pixels: np.ndarray, processor: Any) -> np.ndarray:
    """The processor's normalised (3, H, W) floats back in 0..255."""
    mean = np.asarray(processor.image_mean, np.float64)[:, None, None]
    std = np.asarray(processor.image_std, np.float64)[:, None, None]
    raw = (pixels.astype(np.float64) * std + mean) / processor.rescale_factor
    return np.clip(np.rint(raw), 0, 255).astype(np.uint8)


def qwen_reference(processor: Any, img: Image.Image) -> np.ndarray:
    """Qwen's output un-patchified: (1, 3, H, W) uint8."""
    out = processor(images=[img])
    t, gh, gw = (int(v) for v in out["image_grid_thw"][0])
    assert t == 1  # a still image: one temporal patch
    p, m, tp = processor.patch_size, processor.merge_size, processor.temporal_patch_size
    patches = np.asarray(out["pixel_values"]).reshape(gh // m, gw // m, m, m, 3, tp, p, p)
    frame = patches[:, :, :, :, :, 0].transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)
    return _to_uint8(frame, processor)[None]


def gemma_reference(processor: Any, img: Image.Image) -> np.ndarray:
    """Gemma's views (the whole image, then its crops): (views, 3, S, S) uint8."""
    out = processor(images=[img])
    return np.stack([_to_uint8(np.asarray(v), processor) for v in out["pixel_values"]])


def _upright(data: bytes) -> Image.Image:
    """The file as a caller hands it to the processor: first frame, EXIF orientation applied."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return ImageOps.exif_transpose(img)


def _encode(img: Image.Image, fmt: str, **save: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def _scene(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Smooth gradients with sharp edges and noise: every resample filter's hard case."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x ^ y) & 255])
    rgb = rgb.transpose(1, 2, 0) + rng.integers(-20, 21, (height, width, 3))
    img = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(((x * 7 + y * 3) % 256).astype(np.uint8), "L")
        img.putalpha(alpha)
    return img


GENERATED = {
    "odd-png-641x479": lambda: _encode(_scene(641, 479), "PNG"),
    "big-jpeg-3000x2000 (max_pixels)": lambda: _encode(_scene(3000, 2000, seed=1), "JPEG"),
    "tiny-png-20x30 (min_pixels)": lambda: _encode(_scene(20, 30, seed=2), "PNG"),
    "tall-jpeg-37x1001": lambda: _encode(_scene(37, 1001, seed=3), "JPEG", quality=90),
    "alpha-png-300x200": lambda: _encode(_scene(300, 200, "RGBA", seed=4), "PNG"),
    "webp-1200x400 (pan and scan)": lambda: _encode(_scene(1200, 400, seed=5), "WEBP"),
    "png-300x900 (pan and scan)": lambda: _encode(_scene(300, 900, seed=6), "PNG"),
    "jpeg-777x555 (two crops)": lambda: _encode(_scene(777, 555, seed=7), "JPEG"),
    "png-500x380 (crops too small)": lambda: _encode(_scene(500, 380, seed=8), "PNG"),
}


def _corpus_files() -> list[str]:
    return [
        r["file"]
        for r in corpus_rows()
        if r["expect"] == "accept" and r["file"].rsplit(".", 1)[-1] in ("jpg", "png", "webp", "gif")
    ]


QWEN_SETTINGS = {
    "defaults": {},  # 56*56 .. 28*28*1280 pixels
    "qwen2.5 hub": {"min_pixels": 3136, "max_pixels": 12845056},
    "tight": {"min_pixels": 100_000, "max_pixels": 200_000},
}
# Qwen3-VL's published preprocessor_config.json sizes, and a tight one.
QWEN3_SETTINGS = {
    "qwen3 hub": {"size": {"shortest_edge": 64 * 64 * 16, "longest_edge": 32 * 32 * 16384}},
    "tight": {"size": {"shortest_edge": 100_000, "longest_edge": 200_000}},
}
GEMMA = {
    "size": {"height": 896, "width": 896},
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


def _check(got: np.ndarray, want: np.ndarray, name: str) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    diff = int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max())
    assert diff <= 1, (name, diff)


@pytest.mark.parametrize("setting", list(QWEN_SETTINGS))
@pytest.mark.parametrize("name", list(GENERATED))
def test_native_rule_matches_qwen_processor(
    worker: Worker, tmp_path: Path, name: str, setting: str
) -> None:
    processor = _processor("qwen2_5_vl", **QWEN_SETTINGS[setting])
    rule = _rule(tmp_path, "qwen2_5_vl", processor)
    assert rule.kind == "native" and rule.resample == "bicubic"
    data = GENERATED[name]()
    _check(gateway_views(worker, data, rule), qwen_reference(processor, _upright(data)), name)


@pytest.mark.parametrize("setting", list(QWEN3_SETTINGS))
@pytest.mark.parametrize("name", list(GENERATED))
def test_native_rule_at_16_px_patches_matches_qwen3_processor(
    worker: Worker, tmp_path: Path, name: str, setting: str
) -> None:
    """Qwen3-VL's rule: 32 px merged tokens (patch 16 x merge 2), mean and std 0.5."""
    processor = _processor("qwen3_vl", **QWEN3_SETTINGS[setting])
    rule = _rule(tmp_path, "qwen3_vl", processor)
    assert (rule.kind, rule.factor, rule.mean) == ("native", 32, (0.5, 0.5, 0.5))
    data = GENERATED[name]()
    got = gateway_views(worker, data, rule)
    _check(got, qwen_reference(processor, _upright(data)), name)
    assert got.shape[2] % 32 == 0 and got.shape[3] % 32 == 0


@pytest.mark.parametrize("name", list(GENERATED))
def test_fixed_rule_matches_gemma_processor(worker: Worker, tmp_path: Path, name: str) -> None:
    processor = _processor("gemma3", **GEMMA)
    rule = _rule(tmp_path, "gemma3", processor)
    assert rule.kind == "fixed" and rule.pan_and_scan and rule.resample == "bilinear"
    data = GENERATED[name]()
    got = gateway_views(worker, data, rule)
    _check(got, gemma_reference(processor, _upright(data)), name)
    if "(pan and scan)" in name:  # the cases meant to crop do crop
        assert got.shape[0] == 4


def test_corpus_files_match_both_processors(worker: Worker, tmp_path: Path) -> None:
    need_corpus()
    qwen = _processor("qwen2_5_vl")
    gemma = _processor("gemma3", **GEMMA)
    rules = (_rule(tmp_path / "q", "qwen2_5_vl", qwen), _rule(tmp_path / "g", "gemma3", gemma))
    files = _corpus_files()
    assert files, "the corpus lists no valid still images"
    for file in files:
        data = (CORPUS / file).read_bytes()
        img = _upright(data)
        if img.info.get("icc_profile") and decode.HAS_LCMS:
            continue  # the worker converts to sRGB; the processors take the pixels as they are
        _check(gateway_views(worker, data, rules[0]), qwen_reference(qwen, img), file)
        _check(gateway_views(worker, data, rules[1]), gemma_reference(gemma, img), file)


def test_max_tiles_bounds_the_crops_of_a_rule(tmp_path: Path) -> None:
    """A tenant's max_tiles caps a rule's pan-and-scan crops (a limit never loosens)."""
    processor = _processor("gemma3", **{**GEMMA, "pan_and_scan_max_num_crops": 8})
    rule = _rule(tmp_path, "gemma3", processor)
    lim = LimitsConfig(max_tiles=3)
    bounded = bounded_rule(rule, lim)
    assert bounded.max_num_crops == 3 and rule.max_num_crops == 8
    probe = decode.Probe(2400, 300, 1)
    assert plan_media(0, probe, False, "high", bounded, lim).grid.cols == 3
    assert plan_media(0, probe, False, "high", rule, LIMITS).grid.cols == 8


def test_a_native_animation_is_one_item_of_whole_temporal_patches(
    worker: Worker, tmp_path: Path
) -> None:
    """Five frames keep four (two temporal patches), every frame at the same size, each as the
    processor resizes that frame; the core is told one item of shape (4, 3, H, W), a video of
    the mean delay between the kept frames."""
    processor = _processor("qwen2_5_vl")
    rule = _rule(tmp_path, "qwen2_5_vl", processor)
    frames = [_scene(150, 100, seed=20 + i) for i in range(5)]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    probe = decode.Probe(150, 100, 5, (0.0, 0.1, 0.2, 0.3, 0.4))
    plan = plan_media(0, probe, False, "high", rule, LIMITS)
    assert plan.stacked and plan.frames == (0, 1, 3, 4) and plan.items == (plan.frames,)
    assert plan.interval_s == pytest.approx(0.4 / 3)
    # Frames without timing (a multi-picture JPEG): the first alone, a still image.
    still = plan_media(0, decode.Probe(150, 100, 5), False, "auto", rule, LIMITS)
    assert still.frames == (0,) and still.interval_s == 0
    shape = rule.item_shape(plan.grid.rows, plan.grid.cols, len(plan.frames))
    assert shape[0] == 4 and rule.visual_tokens(shape) == 2 * shape[2] * shape[3] // 28**2
    spec = decode_spec(sniff(data), plan.grid, plan.frames, rule, (0, 0, 0), LIMITS)
    arrays = worker.run("decode", spec.to_json(), data).arrays
    gif = Image.open(io.BytesIO(data))
    for index, array in zip(plan.frames, arrays, strict=True):
        gif.seek(index)
        _check(array, qwen_reference(processor, gif.convert("RGB")), f"frame {index}")

"""A checkpoint's preprocessing rule, read from its processor config (no transformers at run time).

Two layouts hold the image processor's settings: transformers 5 writes `processor_config.json`
with them nested under `image_processor`; Hub checkpoints carry `preprocessor_config.json`, flat.
A key that is absent takes the family processor's own default. Settings the gateway cannot apply
(no resize, another rescale factor, a filter other than bicubic / bilinear) are refused rather
than silently preprocessed differently from the model's training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.model import config as llava_config
from core.model import llava_onevision
from core.model.config import ModelConfigError, processor_config, read_json
from shared.preprocess import PreprocessRule, tiles

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's filter numbers
LLAVA_TYPES = ("llava", "llava_next")
ANYRES_TYPES = llava_onevision.MODEL_TYPES
# Qwen's image processors: (patch_size, merge_size, temporal_patch_size, min_pixels, max_pixels,
# mean, std), the defaults of Qwen2VLImageProcessor (Qwen2-VL, 2.5-VL) and Qwen3-VL's.
NATIVE_DEFAULTS: dict[str, tuple[int, int, int, int, int, tuple[float, ...], tuple[float, ...]]] = {
    "qwen2_vl": (14, 2, 2, 56 * 56, 28 * 28 * 1280, CLIP_MEAN, CLIP_STD),
    "qwen2_5_vl": (14, 2, 2, 56 * 56, 28 * 28 * 1280, CLIP_MEAN, CLIP_STD),
    "qwen3_vl": (16, 2, 2, 64 * 64 * 16, 32 * 32 * 16384, HALF, HALF),
}
FIXED_TYPES = ("gemma3",)


def rule_for(model_dir: Path, model_type: str) -> PreprocessRule:
    """The rule the gateway must apply for this checkpoint; ModelConfigError names the file and
    key when its processor settings are malformed or beyond what the gateway implements."""
    if model_type in LLAVA_TYPES:
        cfg = llava_config.load(model_dir)
        return tiles(cfg.vision.image_size, cfg.tokens_per_tile, cfg.image_mean, cfg.image_std)
    where, proc = processor_config(model_dir)
    if model_type in ANYRES_TYPES:
        rule = _anyres(model_dir, proc, where)
    elif model_type in NATIVE_DEFAULTS:
        rule = _native(proc, NATIVE_DEFAULTS[model_type], where)
    elif model_type in FIXED_TYPES:
        rule = _fixed(proc, _mm_tokens(model_dir), where)
    else:
        raise ModelConfigError(f"config.json: no preprocessing rule for model_type {model_type!r}")
    try:
        rule.validate()
    except ValueError as exc:
        raise ModelConfigError(f"{where}: {exc}") from None
    return rule


def _common(proc: dict[str, Any], default_resample: int, where: str) -> str:
    """Checks the steps every rule assumes; returns the resampling filter's name."""
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if proc.get(key, True) is not True:
            raise ModelConfigError(f"{where}: {key} = {proc[key]!r} is not supported (true only)")
    factor = proc.get("rescale_factor", 1 / 255)
    if not isinstance(factor, float | int) or abs(factor - 1 / 255) > 1e-9:
        raise ModelConfigError(f"{where}: rescale_factor = {factor!r} (only 1/255)")
    resample = proc.get("resample", default_resample)
    if resample not in RESAMPLE:
        raise ModelConfigError(f"{where}: resample = {resample!r} (2 bilinear or 3 bicubic)")
    return RESAMPLE[resample]


def _int(proc: dict[str, Any], key: str, default: int, where: str) -> int:
    value = proc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelConfigError(f"{where}: {key} = {value!r} is not a count")
    return value


def _channels(
    proc: dict[str, Any], key: str, default: tuple[float, ...], where: str
) -> tuple[float, ...]:
    value = proc.get(key, default)
    if isinstance(value, float | int):
        value = [value] * 3
    try:
        return tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ModelConfigError(f"{where}: {key} is not a list of numbers") from None


def _native(
    proc: dict[str, Any],
    defaults: tuple[int, int, int, int, int, tuple[float, ...], tuple[float, ...]],
    where: str,
) -> PreprocessRule:
    patch, merge, temporal, min_px, max_px, mean, std = defaults
    size = proc.get("size") or {}
    if not isinstance(size, dict):
        raise ModelConfigError(f"{where}: size = {size!r} is not an object")
    # Older checkpoints state min_pixels / max_pixels at the top; newer ones in `size`.
    min_px = _int(size, "shortest_edge", _int(proc, "min_pixels", min_px, where), where)
    max_px = _int(size, "longest_edge", _int(proc, "max_pixels", max_px, where), where)
    return PreprocessRule(
        kind="native",
        mean=_channels(proc, "image_mean", mean, where),
        std=_channels(proc, "image_std", std, where),
        resample=_common(proc, 3, where),
        patch_size=_int(proc, "patch_size", patch, where),
        merge_size=_int(proc, "merge_size", merge, where),
        temporal_patch_size=_int(proc, "temporal_patch_size", temporal, where),
        min_pixels=min_px,
        max_pixels=max_px,
    )


def _fixed(proc: dict[str, Any], tokens: int, where: str) -> PreprocessRule:
    size = proc.get("size") or {"height": 896, "width": 896}
    if not isinstance(size, dict) or size.get("height") != size.get("width"):
        raise ModelConfigError(f"{where}: size = {size!r} (a square height = width only)")
    pan = bool(proc.get("do_pan_and_scan") or False)
    return PreprocessRule(
        kind="fixed",
        mean=_channels(proc, "image_mean", HALF, where),
        std=_channels(proc, "image_std", HALF, where),
        resample=_common(proc, 2, where),
        image_size=_int(size, "height", 896, where),
        tokens_per_image=tokens,
        pan_and_scan=pan,
        min_crop_size=_int(proc, "pan_and_scan_min_crop_size", 256, where) if pan else 0,
        max_num_crops=_int(proc, "pan_and_scan_max_num_crops", 4, where) if pan else 0,
        min_ratio_to_activate=float(proc.get("pan_and_scan_min_ratio_to_activate") or 1.2)
        if pan
        else 0.0,
    )


def _anyres(model_dir: Path, proc: dict[str, Any], where: str) -> PreprocessRule:
    """LLaVA-OneVision: tiles of the tower's side, the grid among the model's pinpoints (the
    processor's, where it states them, must be the same), its anyres_max, the processor's
    filter; mean and std as the model normalises."""
    cfg, pinpoints, anyres_max = llava_onevision.load_config(model_dir)
    size = cfg.vision.image_size
    stated = proc.get("size") or {"height": size, "width": size}
    if not isinstance(stated, dict) or stated.get("height", stated.get("shortest_edge")) != size:
        raise ModelConfigError(f"{where}: size = {stated!r} (the tower's {size} square only)")
    if proc.get("image_grid_pinpoints", [list(p) for p in pinpoints]) != [
        list(p) for p in pinpoints
    ]:
        raise ModelConfigError(f"{where}: image_grid_pinpoints differ from config.json's")
    return PreprocessRule(
        kind="tiles",
        mean=cfg.image_mean,
        std=cfg.image_std,
        resample=_common(proc, 3, where),
        image_size=size,
        tokens_per_tile=cfg.tokens_per_tile,
        pinpoints=tuple(v for pair in pinpoints for v in pair),
        anyres_max=anyres_max,
    )


def _mm_tokens(model_dir: Path) -> int:
    """Gemma 3's visual tokens per view: config.json's mm_tokens_per_image (256 by default)."""
    raw = read_json(model_dir / "config.json")
    return _int(raw, "mm_tokens_per_image", 256, "config.json")

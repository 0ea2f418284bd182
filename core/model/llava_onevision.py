"""LLaVA-OneVision: LLaVA's SigLIP tower, two-layer projector and Qwen2 decoder (`core.model.llava`,
whose per-tile encoder every backend runs unchanged), with the anyres layout of an image's
features.

An item is either one view (the image padded to a square: the processor's layout for an image
among several) or the whole image squashed to a tile followed by a grid of tiles cut from a
canvas chosen among the checkpoint's `image_grid_pinpoints` (its layout for a lone image). The
encoder's per-tile features are cached as they are; `arrange` then lays one item out as the
model reads it: the base tile's tokens, and the grid's tokens stitched into one feature map,
unpadded to the image's aspect, bilinearly downscaled past `anyres_max_N` tiles' worth, each row
closed by the learned `image_newline`. The sizes come from `shared.preprocess.anyres_grid_size`,
the arithmetic admission counts with. Video is not served (the core refuses video items).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.model import config as model_config
from core.model.config import LlavaConfig, ModelConfigError, processor_config, read_json
from core.model.llava import CPU, Llava, canonical_name
from core.model.weights import check_state, fuse, read_state
from shared.preprocess import anyres_grid_size

MODEL_TYPES = ("llava_onevision",)  # config.json `model_type` values this family serves
# What transformers' LlavaOnevisionConfig assumes for keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "image_token_index": 151646,
    "vision_feature_select_strategy": "full",
    "vision_feature_layer": -1,
    "vision_aspect_ratio": "anyres_max_9",
}
VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "siglip_vision_model",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "patch_size": 14,
    "image_size": 384,
    "num_hidden_layers": 26,
    "num_attention_heads": 16,
}
ANYRES = "anyres_max_"


class LlavaOnevision(Llava):
    """`Llava` plus the anyres layout (`arrange`) and its `image_newline` row."""

    def __init__(
        self, cfg: LlavaConfig, pinpoints: tuple[tuple[int, int], ...], anyres_max: int
    ) -> None:
        super().__init__(cfg)
        self.pinpoints = pinpoints  # (height, width) canvases a grid may take
        self.anyres_max = anyres_max  # grid features past this many tiles' worth are downscaled
        self.image_newline = nn.Parameter(torch.zeros(cfg.text.hidden_size))

    def arrange(
        self, features: torch.Tensor, rows: int, cols: int, width: int, height: int
    ) -> torch.Tensor:
        """One item's per-tile features (views, tokens_per_tile, hidden) -> its tokens as the
        decoder reads them (tokens, hidden). `rows` x `cols`: its grid (views = 1: one view);
        `width` x `height`: the upright source image, which the unpadding follows."""
        views, per_tile, hidden = features.shape
        newline = self.image_newline.to(features.device, features.dtype)
        if views == 1:
            return torch.cat([features[0], newline[None]])
        side = math.isqrt(per_tile)
        if side * side != per_tile or views != rows * cols + 1:
            raise ValueError(f"{views} views of {per_tile} tokens is no {rows} x {cols} grid")
        grid = features[1:].reshape(rows, cols, side, side, hidden)
        grid = grid.permute(4, 0, 2, 1, 3).reshape(hidden, rows * side, cols * side)
        (kept_h, kept_w), (out_h, out_w) = anyres_grid_size(
            rows, cols, side, width, height, self.anyres_max
        )
        top, left = (rows * side - kept_h) // 2, (cols * side - kept_w) // 2
        grid = grid[:, top : top + kept_h, left : left + kept_w]
        if (out_h, out_w) != (kept_h, kept_w):
            grid = F.interpolate(grid[None], [out_h, out_w], mode="bilinear")[0]
        grid = torch.cat([grid, newline[:, None, None].expand(hidden, out_h, 1)], dim=-1)
        return torch.cat([features[0], grid.flatten(1).transpose(0, 1)])

    def arrange_item(
        self, features: np.ndarray, views: int, rows: int, cols: int, width: int, height: int
    ) -> np.ndarray:
        """`arrange` on one cached entry's (views * tokens_per_tile, hidden) float32 rows, on
        the host (the core's servicer calls it between the cache and the LLM)."""
        with torch.inference_mode():
            tiles = torch.from_numpy(features).view(views, -1, features.shape[-1])
            return self.arrange(tiles, rows, cols, width, height).float().numpy()


def load_config(model_dir: Path) -> tuple[LlavaConfig, tuple[tuple[int, int], ...], int]:
    """The LLaVA config under OneVision's defaults, the grid pinpoints and anyres_max_N's N."""
    raw = read_json(model_dir / "config.json", required=True)
    raw = {**DEFAULTS, **raw, "vision_config": {**VISION_DEFAULTS, **raw.get("vision_config", {})}}
    raw.setdefault("text_config", {}).setdefault("model_type", "qwen2")
    cfg = model_config.parse(raw, processor_config(model_dir)[1])
    aspect = raw["vision_aspect_ratio"]
    if not isinstance(aspect, str) or not aspect.startswith(ANYRES):
        raise ModelConfigError(f"vision_aspect_ratio = {aspect!r} (only {ANYRES}<N>)")
    try:
        anyres_max = int(aspect[len(ANYRES) :])
    except ValueError:
        raise ModelConfigError(f"vision_aspect_ratio = {aspect!r} (only {ANYRES}<N>)") from None
    return cfg, _pinpoints(raw.get("image_grid_pinpoints"), cfg.vision.image_size), anyres_max


def _pinpoints(value: object, size: int) -> tuple[tuple[int, int], ...]:
    """The pinpoints as (height, width) pairs, each a whole number of tiles of `size`; absent:
    transformers' default, every grid up to 6 x 6 tiles."""
    if value is None:
        value = [[r * size, c * size] for r in range(1, 7) for c in range(1, 7)]
    pairs = value if isinstance(value, list) and value else None
    if pairs is None or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in pairs
    ):
        raise ModelConfigError("image_grid_pinpoints is not a list of [height, width] pairs")
    if any(v < size or v % size for p in pairs for v in p):
        raise ModelConfigError(
            f"image_grid_pinpoints holds a side that is not a multiple of {size}"
        )
    return tuple((int(h), int(w)) for h, w in pairs)


def _canonical(name: str) -> str | None:
    if name in ("image_newline", "model.image_newline"):
        return "image_newline"
    return canonical_name(name)


def load(
    model_dir: Path, device: torch.device = CPU, dtype: torch.dtype = torch.float32
) -> LlavaOnevision:
    """The checkpoint's weights (transformers 5's `model.*` names or the Hub's legacy ones) read
    straight onto `device` in `dtype`, as `core.model.llava.load` does."""
    cfg, pinpoints, anyres_max = load_config(model_dir)
    state = read_state(model_dir, _canonical, device, dtype)
    embed = state.get("language_model.embed_tokens.weight")
    if "lm_head.weight" not in state and cfg.text.tie_word_embeddings and embed is not None:
        state["lm_head.weight"] = embed
    fuse(state, cfg.text.num_layers)
    with torch.device("meta"):
        model = LlavaOnevision(cfg, pinpoints, anyres_max)
    check_state(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    with torch.device(device):  # the derived buffers (float32) beside the weights
        model.reset_buffers()
    return model.eval()

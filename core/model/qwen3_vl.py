"""Qwen3-VL: its vision transformer (core/model/qwen3_vl_vision.py) and a Qwen3 decoder with
interleaved multimodal rotary positions and deepstack inputs, loaded from a checkpoint directory.

Against Qwen2.5-VL (core/model/qwen2_5_vl.py, whose loader pieces this reuses): the decoder's
attention has per-head RMSNorm on queries and keys, an explicit head_dim and no biases; M-RoPE
interleaves the axes (frequency pair i turns with h when i % 3 == 1, with w when i % 3 == 2,
within their sections; with t otherwise); every video frame pair is its own visual item with
t = 1, announced in the prompt by its timestamp (`video_placeholder`); and the features of the
vision blocks in `deepstack_visual_indexes` are added to the hidden states at the visual
positions after the first decoder layers (`deepstack_inputs`, a layer's `extra`).

Both layouts a checkpoint comes in share the tensor names (`model.visual.*`,
`model.language_model.*`, `lm_head.*` unless tied); the Hub's has `rope_scaling` and
`preprocessor_config.json` where transformers 5 writes `rope_parameters` and one
`processor_config.json`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.model.config import ModelConfigError, TextConfig, read_json
from core.model.layers import activation, register_pixel_affine
from core.model.qwen2_5_vl import (
    QwenDecoderLayer,
    QwenPreprocess,
    Rope,
    _mrope_section,
    _preprocess,
    _text,
    fill_visual_slots,
    load_weights,
    mrope,
    mrope_positions,
)
from core.model.qwen2_5_vl_vision import Grid, patchify
from core.model.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTransformer
from core.model.text import Attention, RMSNorm
from core.model.weights import encoder_digest

MODEL_TYPES = ("qwen3_vl",)
CPU = torch.device("cpu")
_HALF = (0.5, 0.5, 0.5)  # Qwen3-VL's processor mean and std


@dataclass(frozen=True, slots=True)
class Qwen3VLConfig:
    text: TextConfig
    vision: Qwen3VisionConfig
    mrope_section: tuple[int, int, int]  # rotary frequency pairs driven by t, h, w (interleaved)
    image_token_id: int  # <|image_pad|>, once per merged visual token of an image
    video_token_id: int  # <|video_pad|>, once per merged visual token of a video frame pair
    vision_start_token_id: int  # <|vision_start|>, before each image and each frame pair
    vision_end_token_id: int  # <|vision_end|>
    preprocess: QwenPreprocess

    @property
    def num_deepstack(self) -> int:
        """Decoder layers (the first ones) whose output gets a deepstack input added."""
        return len(self.vision.deepstack_visual_indexes)


def _vision(vc: dict[str, Any], out_hidden: int, num_layers: int) -> Qwen3VisionConfig:
    rope = vc.get("rope_parameters") or {}
    cfg = Qwen3VisionConfig(
        hidden_size=int(vc.get("hidden_size", 1152)),
        intermediate_size=int(vc.get("intermediate_size", 4304)),
        depth=int(vc.get("depth", vc.get("num_hidden_layers", 27))),
        num_heads=int(vc.get("num_heads", vc.get("num_attention_heads", 16))),
        patch_size=int(vc.get("patch_size", 16)),
        temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
        out_hidden_size=int(vc.get("out_hidden_size", out_hidden)),
        hidden_act=str(vc.get("hidden_act", "gelu_pytorch_tanh")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        num_position_embeddings=int(vc.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(
            int(i) for i in vc.get("deepstack_visual_indexes", (8, 16, 24))
        ),
    )
    if cfg.out_hidden_size != out_hidden:
        raise ModelConfigError(
            f"config.json: vision out_hidden_size {cfg.out_hidden_size} != text hidden_size "
            f"{out_hidden}"
        )
    if cfg.position_side**2 != cfg.num_position_embeddings:
        raise ModelConfigError(
            f"config.json: vision num_position_embeddings {cfg.num_position_embeddings} is not "
            "a square number"
        )
    indexes = cfg.deepstack_visual_indexes
    if any(not 0 <= i < cfg.depth for i in indexes) or len(indexes) > num_layers:
        raise ModelConfigError(
            f"config.json: deepstack_visual_indexes {list(indexes)} must name vision blocks "
            f"(depth {cfg.depth}), at most one per decoder layer ({num_layers})"
        )
    try:
        activation(cfg.hidden_act)
    except ValueError:
        raise ModelConfigError(
            f"config.json: vision hidden_act {cfg.hidden_act!r} is not supported"
        ) from None
    return cfg


def load_config(model_dir: Path) -> Qwen3VLConfig:
    raw = read_json(model_dir / "config.json")
    if raw.get("model_type") not in MODEL_TYPES:
        raise ModelConfigError(
            f"config.json: model_type {raw.get('model_type')!r} is not one of {list(MODEL_TYPES)}"
        )
    for key in ("vision_config", "text_config"):
        if not isinstance(raw.get(key), dict):
            raise ModelConfigError(f"config.json: {key} is missing")
    tc = raw["text_config"]
    if tc.get("attention_bias"):
        raise ModelConfigError("config.json: text attention_bias true is not supported")
    rope = tc.get("rope_parameters") or {}
    text = replace(
        _text(raw, tc, read_json(model_dir / "generation_config.json")),
        kind="qwen3",  # o_proj without bias, as qwen2
        head_dim=int(tc.get("head_dim", 128)),  # explicit, not hidden / heads
        attention_bias=False,
        rope_theta=float(rope.get("rope_theta", tc.get("rope_theta", 5000000.0))),
    )
    return Qwen3VLConfig(
        text=text,
        vision=_vision(raw["vision_config"], text.hidden_size, text.num_layers),
        mrope_section=_mrope_section(tc, text.head_dim),
        image_token_id=int(raw.get("image_token_id", 151655)),
        video_token_id=int(raw.get("video_token_id", 151656)),
        vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
        preprocess=_preprocess(model_dir, _HALF, _HALF),
    )


class Qwen3Attention(Attention):
    """Qwen3's attention: queries and keys RMS-normed per head before the rotation."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().split(qkv)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3DecoderLayer(QwenDecoderLayer):
    """A Qwen3 layer: a Qwen2 one with q/k norms (its deepstack input is the contract's
    `extra`, which `DecoderLayer.forward_paged` adds)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg, sliding_window=None)
        self.self_attn = Qwen3Attention(cfg)


class Qwen3Decoder(nn.Module):
    """`model.language_model`: embeddings, layers, final norm (M-RoPE lives on the model)."""

    def __init__(self, text: TextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(text) for _ in range(text.num_layers))
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)


def interleaved_axes(section: tuple[int, int, int], pairs: int) -> torch.Tensor:
    """Which position (0 = t, 1 = h, 2 = w) turns each of the `pairs` rotary frequency pairs:
    h takes pairs 1, 4, 7, ... below 3 * section[1], w takes 2, 5, 8, ... below 3 * section[2],
    t the rest (the layout Qwen3-VL was trained with)."""
    i = torch.arange(pairs)
    w = torch.where((i % 3 == 2) & (i < 3 * section[2]), 2, 0)
    return torch.where((i % 3 == 1) & (i < 3 * section[1]), 1, w)


def frame_seconds(
    frame_indices: list[int], fps: float, temporal_patch_size: int = 2
) -> list[float]:
    """Each frame pair's timestamp: the mean time of its first and last sampled frame (an odd
    count repeats the last frame, as patchify does)."""
    indices = list(frame_indices)
    indices += indices[-1:] * (-len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    step = temporal_patch_size
    return [(times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step)]


def video_placeholder(seconds: list[float], tokens_per_frame: int) -> str:
    """What replaces a video's `<|vision_start|><|video_pad|><|vision_end|>` in the rendered
    template: per frame pair its timestamp, then its own vision marks around its tokens."""
    pad = "<|video_pad|>" * tokens_per_frame
    return "".join(f"<{s:.1f} seconds><|vision_start|>{pad}<|vision_end|>" for s in seconds)


class Qwen3VL(nn.Module):
    pixel_scale: torch.Tensor
    pixel_shift: torch.Tensor
    inv_freq: torch.Tensor
    rope_axis: torch.Tensor
    bidirectional_images = False

    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = Qwen3VisionTransformer(cfg.vision)
        self.language_model = Qwen3Decoder(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)builds the derived, non-persistent buffers; needed after loading on `meta`."""
        pre, text = self.cfg.preprocess, self.cfg.text
        register_pixel_affine(self, pre.image_mean, pre.image_std)
        steps = torch.arange(0, text.head_dim, 2, dtype=torch.float32) / text.head_dim
        self.register_buffer("inv_freq", 1.0 / (text.rope_theta**steps), persistent=False)
        axis = interleaved_axes(self.cfg.mrope_section, text.head_dim // 2)
        self.register_buffer("rope_axis", axis, persistent=False)
        self.visual.reset_buffers()

    def normalize(self, pixels_u8: torch.Tensor) -> torch.Tensor:
        return pixels_u8.float() * self.pixel_scale + self.pixel_shift

    def encode_visual(self, pixels_u8: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        """One image (1, 3, H, W) or video (T, 3, H, W) of uint8, H and W multiples of 32 ->
        (t * h * w, (1 + num_deepstack) * hidden) features and the grid (t, h, w) in merged
        units. Columns [0, hidden) are the visual tokens `embed` places; deepstack input k is
        columns [(1 + k) * hidden, (2 + k) * hidden) (`deepstack_inputs`): one tensor per item,
        so the feature cache and the engine carry it as they carry any family's features."""
        side = self.cfg.vision.merge_pixels
        if (
            pixels_u8.dim() != 4
            or pixels_u8.shape[1] != 3
            or pixels_u8.shape[2] % side
            or pixels_u8.shape[3] % side
        ):
            raise ValueError(f"pixels must be (frames, 3, H, W) with H and W multiples of {side}")
        patches, grid = patchify(self.normalize(pixels_u8), self.cfg.vision)
        merged, deepstack = self.visual(patches, grid)
        return torch.cat([merged, *deepstack], dim=-1), grid

    def prompt_positions(
        self, ids: list[int], grids: list[Grid]
    ) -> tuple[torch.Tensor | None, int]:
        """The prompt's (3, n) rope positions and the delta of later tokens. Each frame pair of
        a video is its own item of grid (1, h, w) (its tokens may follow the previous pair's
        directly or after its timestamp text); text after an item starts at its largest
        position + 1 = start + max(h, w)."""
        if not grids:
            return None, 0
        frames = [(1, h, w) for t, h, w in grids for _ in range(t)]
        visual = (self.cfg.image_token_id, self.cfg.video_token_id)
        return mrope_positions(ids, frames, visual, [], 1.0)

    def rope(self, positions: torch.Tensor) -> Rope:
        """(tokens,) or (3, tokens) positions -> cos, sin (tokens, head_dim), axes interleaved
        (`interleaved_axes`)."""
        return mrope(positions, self.inv_freq, self.rope_axis)

    def embed(
        self, token_ids: list[int] | torch.Tensor, image_features: torch.Tensor | None
    ) -> torch.Tensor:
        """Token embeddings with every image and video slot replaced, in order, by the visual
        tokens of `image_features` (`encode_visual`'s, concatenated in prompt order)."""
        hidden = self.cfg.text.hidden_size
        feats = None if image_features is None else image_features[:, :hidden]
        visual = (self.cfg.image_token_id, self.cfg.video_token_id)
        return fill_visual_slots(self.language_model.embed_tokens, token_ids, visual, feats)

    def encode_item(self, pixels_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's encode of one item (`core.encoders.ItemModel`): `encode_visual`'s
        features, deepstack columns included (the cache stores them as one row per token), and
        as importance each token's norm over its first `hidden` columns (what compression ranks
        by: Qwen2.5-VL's attention-received score is not wired for this tower)."""
        feats, _ = self.encode_visual(pixels_u8)
        return feats, feats[:, : self.cfg.text.hidden_size].float().norm(dim=-1)

    def deepstack_rows(
        self, token_ids: list[int] | torch.Tensor, image_features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The deepstack inputs of a prompt, for an engine that gathers a step's rows itself:
        each token's row (host, long, -1 for a text token) in the table of its visual tokens'
        deepstack columns ((visual tokens, num_deepstack * hidden), on the features' device,
        layer k's input in columns [k * hidden, (k + 1) * hidden)); None when the prompt has no
        visual token."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
        visual = (self.cfg.image_token_id, self.cfg.video_token_id)
        count = itertools.count()
        rows = [next(count) if i in visual else -1 for i in ids]
        num = next(count)
        if image_features is None or not num or not self.cfg.num_deepstack:
            return None
        if image_features.shape[0] != num:
            raise ValueError(f"{num} visual tokens but {image_features.shape[0]} feature rows")
        return torch.tensor(rows), image_features[:, self.cfg.text.hidden_size :]

    def deepstack_inputs(
        self, token_ids: list[int] | torch.Tensor, image_features: torch.Tensor | None
    ) -> list[torch.Tensor | None]:
        """Per decoder layer, the `extra` its `forward_paged` adds to its output over a whole
        prompt: for the first `num_deepstack` layers a (tokens, hidden) tensor holding deepstack
        input k at the visual rows and zero elsewhere; None for the other layers, and for all
        when no visual token is among `token_ids`."""
        extras: list[torch.Tensor | None] = [None] * self.cfg.text.num_layers
        found = self.deepstack_rows(token_ids, image_features)
        if found is None:
            return extras
        rows, table = found
        hidden = self.cfg.text.hidden_size
        zero = table.new_zeros(1, table.shape[1])
        # Row 0 of the gathered table is zero: text tokens (-1) read it.
        gathered = torch.cat([zero, table]).index_select(0, (rows + 1).to(table.device))
        for k in range(self.cfg.num_deepstack):
            extras[k] = gathered.narrow(1, k * hidden, hidden)
        return extras

    def encoder_digest(self) -> str:
        return encoder_digest(self, ("visual.",))


def load(
    model_dir: Path, device: torch.device = CPU, dtype: torch.dtype = torch.float32
) -> Qwen3VL:
    """A Qwen3-VL checkpoint on `device` in `dtype` (`core.model.qwen2_5_vl.load_weights`)."""
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = Qwen3VL(cfg)
    load_weights(model_dir, model, cfg.text.num_layers, device, dtype)
    with torch.device(device):
        model.reset_buffers()
    return model.eval()

"""Qwen2.5-VL: the native-resolution vision transformer, its merger, and a Qwen2 decoder with
multimodal rotary positions (M-RoPE), loaded from a checkpoint directory.

Two layouts are read. The Hub's published one: a flat `config.json` (text keys at the top,
`rope_scaling: {type: mrope, mrope_section}`), `preprocessor_config.json`, tensors `visual.*`,
`model.*`, `lm_head.*`. And transformers 5's: nested `text_config` with `rope_parameters`, one
`processor_config.json` holding `image_processor`, `chat_template.jinja`, tensors
`model.visual.*` / `model.language_model.*`, a tied head stored nowhere, end tokens in
`generation_config.json`. Anything this module does not implement is refused with one
`ModelConfigError` line naming the file, key and value.

Images and videos share one slot sequence: `embed` fills `<|image_pad|>` and `<|video_pad|>`
positions, in prompt order, with the rows of the visual items in that order. The engine shows an
item as a video (`video_token_id`) when it declares the seconds between its frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.model.config import ModelConfigError, TextConfig, read_json
from core.model.layers import register_pixel_affine
from core.model.qwen2_5_vl_vision import Grid, QwenVisionConfig, QwenVisionTransformer, patchify
from core.model.text import DecoderLayer, RMSNorm
from core.model.weights import check_state, encoder_digest, fuse, read_state

MODEL_TYPES = ("qwen2_5_vl",)
CPU = torch.device("cpu")
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: (tokens, head_dim)
# The engine's attention (q, k, v[, scale]) -> (tokens, heads * dim), and its linear.
# Checkpoint prefixes (transformers 5 first: `model.` alone is the Hub's decoder) -> ours.
_PREFIXES = (
    ("model.visual.", "visual."),
    ("model.language_model.", "language_model."),
    ("visual.", "visual."),
    ("model.", "language_model."),
    ("lm_head.", "lm_head."),
)
_OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class QwenPreprocess:
    """What the gateway's resize must produce and the core normalises with (until
    `shared.preprocess.PreprocessRule` takes these over)."""

    min_pixels: int  # smart resize keeps H * W within [min_pixels, max_pixels]
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]


@dataclass(frozen=True, slots=True)
class QwenVLConfig:
    text: TextConfig
    vision: QwenVisionConfig
    mrope_section: tuple[int, int, int]  # rotary frequency pairs driven by t, h, w positions
    sliding_window: tuple[int | None, ...]  # per decoder layer
    image_token_id: int  # <|image_pad|>, once per merged visual token of an image
    video_token_id: int  # <|video_pad|>, once per merged visual token of a video
    preprocess: QwenPreprocess


def _mrope_section(tc: dict[str, Any], head_dim: int) -> tuple[int, int, int]:
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ModelConfigError(f"config.json: rope type {kind!r} is not supported (default, mrope)")
    section = rope.get("mrope_section")
    if not isinstance(section, list) or len(section) != 3 or sum(section) != head_dim // 2:
        raise ModelConfigError(
            f"config.json: mrope_section {section!r} must be three sizes summing to "
            f"head_dim / 2 = {head_dim // 2}"
        )
    return (int(section[0]), int(section[1]), int(section[2]))


def _text(raw: dict[str, Any], tc: dict[str, Any], generation: dict[str, Any]) -> TextConfig:
    if tc.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"config.json: text hidden_act {tc['hidden_act']!r} is not silu")
    heads, hidden = int(tc.get("num_attention_heads", 28)), int(tc.get("hidden_size", 3584))
    rope = tc.get("rope_parameters") or {}
    eos = generation.get("eos_token_id", tc.get("eos_token_id", raw.get("eos_token_id")))
    return TextConfig(
        kind="qwen2",
        vocab_size=int(tc.get("vocab_size", 152064)),
        hidden_size=hidden,
        intermediate_size=int(tc.get("intermediate_size", 18944)),
        num_layers=int(tc.get("num_hidden_layers", 28)),
        num_heads=heads,
        num_kv_heads=int(tc.get("num_key_value_heads") or heads),
        head_dim=hidden // heads,  # Qwen2.5-VL has no separate head_dim
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", tc.get("rope_theta", 1000000.0))),
        attention_bias=True,
        max_position_embeddings=int(tc.get("max_position_embeddings", 128000)),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", raw.get("tie_word_embeddings"))),
        eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
    )


def _vision(vc: dict[str, Any], out_hidden: int) -> QwenVisionConfig:
    rope = vc.get("rope_parameters") or {}
    cfg = QwenVisionConfig(
        hidden_size=int(vc.get("hidden_size", 1280)),
        intermediate_size=int(vc.get("intermediate_size", 3420)),
        depth=int(vc.get("depth", vc.get("num_hidden_layers", 32))),
        num_heads=int(vc.get("num_heads", vc.get("num_attention_heads", 16))),
        patch_size=int(vc.get("patch_size", vc.get("spatial_patch_size", 14))),
        temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
        window_size=int(vc.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in vc.get("fullatt_block_indexes", ())),
        out_hidden_size=int(vc.get("out_hidden_size", out_hidden)),
        hidden_act=str(vc.get("hidden_act", "silu")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        tokens_per_second=float(vc.get("tokens_per_second", 2)),
    )
    if cfg.window_size < cfg.merge_pixels or cfg.window_size % cfg.merge_pixels:
        raise ModelConfigError(
            f"config.json: vision window_size {cfg.window_size} is not a multiple of "
            f"patch_size * spatial_merge_size = {cfg.merge_pixels}"
        )
    if cfg.out_hidden_size != out_hidden:
        raise ModelConfigError(
            f"config.json: vision out_hidden_size {cfg.out_hidden_size} != text hidden_size "
            f"{out_hidden}"
        )
    if cfg.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"):
        raise ModelConfigError(
            f"config.json: vision hidden_act {cfg.hidden_act!r} is not supported"
        )
    return cfg


def _preprocess(
    model_dir: Path,
    mean: tuple[float, float, float] = _OPENAI_MEAN,
    std: tuple[float, float, float] = _OPENAI_STD,
) -> QwenPreprocess:
    pre = read_json(model_dir / "preprocessor_config.json")
    if not pre:  # transformers 5: one processor_config.json with the image processor inside
        pre = read_json(model_dir / "processor_config.json").get("image_processor") or {}
    size = pre.get("size") or {}
    return QwenPreprocess(
        min_pixels=int(pre.get("min_pixels", size.get("shortest_edge", 56 * 56))),
        max_pixels=int(pre.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))),
        image_mean=tuple(pre.get("image_mean", mean)),
        image_std=tuple(pre.get("image_std", std)),
    )


def load_config(model_dir: Path) -> QwenVLConfig:
    raw = read_json(model_dir / "config.json")
    if raw.get("model_type") not in MODEL_TYPES:
        raise ModelConfigError(
            f"config.json: model_type {raw.get('model_type')!r} is not one of {list(MODEL_TYPES)}"
        )
    if not isinstance(raw.get("vision_config"), dict):
        raise ModelConfigError("config.json: vision_config is missing")
    tc = raw.get("text_config") or raw  # the Hub's layout keeps text keys at the top
    text = _text(raw, tc, read_json(model_dir / "generation_config.json"))
    window = tc.get("sliding_window") if tc.get("use_sliding_window") else None
    types = tc.get("layer_types") or ["full_attention"] * text.num_layers
    if len(types) != text.num_layers:
        raise ModelConfigError(
            f"config.json: layer_types has {len(types)} entries, not {text.num_layers}"
        )
    return QwenVLConfig(
        text=text,
        vision=_vision(raw["vision_config"], text.hidden_size),
        mrope_section=_mrope_section(tc, text.head_dim),
        sliding_window=tuple(window if t == "sliding_attention" else None for t in types),
        image_token_id=int(raw.get("image_token_id", 151655)),
        video_token_id=int(raw.get("video_token_id", 151656)),
        preprocess=_preprocess(model_dir),
    )


class QwenDecoderLayer(DecoderLayer):
    """A Qwen2 layer that may slide: `DecoderLayer.forward_paged` serves it as it is, since
    M-RoPE is only a different choice of the angles `QwenVL.rope` precomputes."""

    def __init__(self, cfg: TextConfig, sliding_window: int | None) -> None:
        super().__init__(cfg)
        self.sliding_window = sliding_window


class QwenDecoder(nn.Module):
    """`model.language_model`: embeddings, layers, final norm (M-RoPE lives on the model)."""

    def __init__(self, cfg: QwenVLConfig) -> None:
        super().__init__()
        text = cfg.text
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(QwenDecoderLayer(text, w) for w in cfg.sliding_window)
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)


def mrope(positions: torch.Tensor, inv_freq: torch.Tensor, axis: torch.Tensor) -> Rope:
    """(tokens,) or (3, tokens) positions -> cos, sin (tokens, head_dim), frequency pair i
    turning with position axis[i] (0 = t, 1 = h, 2 = w)."""
    if positions.dim() == 1:
        positions = positions.expand(3, -1)
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # (3, n, dim/2)
    freqs = freqs.gather(0, axis.to(positions.device).expand(1, freqs.shape[1], -1))[0]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def mrope_positions(
    ids: list[int], grids: list[Grid], visual_ids: tuple[int, int], seconds: list[float], tps: float
) -> tuple[torch.Tensor, int]:
    """Qwen2.5-VL's rope index: text advances t, h, w together by one per token; a visual item
    of (t, h, w) merged tokens gets (start + t_i * interval, start + row, start + col), with
    interval = tokens_per_second * seconds per temporal patch for a video (1 for an image), and
    the text after it starts at the item's largest position + 1 (the rule the models were
    trained with; transformers 5.25 starts it at start + max(h, w), the same for images and
    for videos whose time axis stays below that). Returns ((3, n) positions, delta): a later
    token at sequence index i sits at i + delta on all three axes."""
    video_id = visual_ids[1]
    out = torch.empty(3, len(ids), dtype=torch.long)
    cursor, start, num_videos = 0, 0, 0
    for t, h, w in grids:
        at = next((i for i in range(cursor, len(ids)) if ids[i] in visual_ids), len(ids))
        if at + t * h * w > len(ids) or any(i not in visual_ids for i in ids[at : at + t * h * w]):
            raise ValueError(
                f"the prompt has no run of {t * h * w} visual tokens for grid {(t, h, w)}"
            )
        out[:, cursor:at] = torch.arange(start, start + at - cursor)
        start += at - cursor
        interval = 1.0
        if ids[at] == video_id:
            interval = tps * (seconds[num_videos] if num_videos < len(seconds) else 1.0)
            num_videos += 1
        tt = (torch.arange(t) * interval).long()
        grid = torch.stack(torch.meshgrid(tt, torch.arange(h), torch.arange(w), indexing="ij"))
        out[:, at : at + t * h * w] = grid.reshape(3, -1) + start
        start = int(out[:, at : at + t * h * w].max()) + 1
        cursor = at + t * h * w
    if any(i in visual_ids for i in ids[cursor:]):
        raise ValueError("the prompt has more visual tokens than its grids cover")
    out[:, cursor:] = torch.arange(start, start + len(ids) - cursor)
    return out, start - cursor


def fill_visual_slots(
    embed_tokens: nn.Embedding,
    token_ids: list[int] | torch.Tensor,
    visual_ids: tuple[int, ...],
    features: torch.Tensor | None,
) -> torch.Tensor:
    """Token embeddings with every slot of `visual_ids`, in order, replaced by a row of
    `features` (all visual items of the prompt, concatenated in prompt order)."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
    device = embed_tokens.weight.device
    is_visual = [i in visual_ids for i in ids]
    host = torch.tensor([0 if v else i for i, v in zip(ids, is_visual, strict=True)])
    embeds = embed_tokens(host.to(device))
    num = sum(is_visual)
    if num:
        if features is None or features.shape[0] != num:
            have = 0 if features is None else features.shape[0]
            raise ValueError(f"{num} visual tokens but {have} visual feature rows")
        mask = torch.tensor(is_visual).to(device)[:, None]
        embeds = embeds.masked_scatter(mask, features.to(device, embeds.dtype))
    return embeds


class QwenVL(nn.Module):
    pixel_scale: torch.Tensor
    pixel_shift: torch.Tensor
    inv_freq: torch.Tensor
    mrope_axis: torch.Tensor
    bidirectional_images = False

    def __init__(self, cfg: QwenVLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = QwenVisionTransformer(cfg.vision)
        self.language_model = QwenDecoder(cfg)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)builds the derived, non-persistent buffers; needed after loading on `meta`."""
        register_pixel_affine(self, self.cfg.preprocess.image_mean, self.cfg.preprocess.image_std)
        dim = self.cfg.text.head_dim
        steps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        self.register_buffer("inv_freq", 1.0 / (self.cfg.text.rope_theta**steps), persistent=False)
        # Which of t, h, w turns each frequency pair: on the device, so that `rope` copies
        # nothing from the host (a captured CUDA graph cannot).
        axis = [i for i, n in enumerate(self.cfg.mrope_section) for _ in range(n)]
        self.register_buffer("mrope_axis", torch.tensor(axis), persistent=False)
        self.visual.reset_buffers()

    @property
    def video_token_id(self) -> int:
        """`<|video_pad|>`: this family serves video (frames in temporal patch pairs)."""
        return self.cfg.video_token_id

    def normalize(self, pixels_u8: torch.Tensor) -> torch.Tensor:
        return pixels_u8.float() * self.pixel_scale + self.pixel_shift

    def encode_visual(self, pixels_u8: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        """One image (1, 3, H, W) or video (T, 3, H, W) of uint8, H and W multiples of 28 ->
        (t * h * w, hidden) visual tokens and the grid (t, h, w) in merged units."""
        feats, _, grid = self._encode(pixels_u8, importance=False)
        return feats, grid

    def encode_item(self, pixels_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's encode of one item (`core.encoders.ItemModel`): its visual tokens and
        their importance for compression, the attention each receives in the tower's last
        full-attention block (`QwenVisionTransformer.forward_with_importance`)."""
        feats, scores, _ = self._encode(pixels_u8, importance=True)
        assert scores is not None
        return feats, scores

    def _encode(
        self, pixels_u8: torch.Tensor, importance: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, Grid]:
        side = self.cfg.vision.merge_pixels
        if (
            pixels_u8.dim() != 4
            or pixels_u8.shape[1] != 3
            or pixels_u8.shape[2] % side
            or pixels_u8.shape[3] % side
        ):
            raise ValueError(f"pixels must be (frames, 3, H, W) with H and W multiples of {side}")
        patches, grid = patchify(self.normalize(pixels_u8), self.cfg.vision)
        feats, scores = self.visual.forward_with_importance(patches, grid, importance)
        return feats, scores, grid

    def prompt_positions(
        self, ids: list[int], grids: list[Grid], seconds: list[float] | None = None
    ) -> tuple[torch.Tensor | None, int]:
        """The prompt's (3, n) rope positions and the delta of later tokens (`mrope_positions`);
        `seconds`: per video, seconds per temporal patch (default 1)."""
        if not grids:
            return None, 0
        visual = (self.cfg.image_token_id, self.cfg.video_token_id)
        return mrope_positions(ids, grids, visual, seconds or [], self.cfg.vision.tokens_per_second)

    def rope(self, positions: torch.Tensor) -> Rope:
        """(tokens,) or (3, tokens) positions -> cos, sin (tokens, head_dim): frequency pair i
        turns with the t, h or w position as `mrope_section` assigns it (in sections)."""
        return mrope(positions, self.inv_freq, self.mrope_axis)

    def embed(
        self, token_ids: list[int] | torch.Tensor, image_features: torch.Tensor | None
    ) -> torch.Tensor:
        """Token embeddings with every image and video slot replaced, in order, by the rows of
        `image_features` (all visual items of the prompt, concatenated in prompt order)."""
        embed_tokens = self.language_model.embed_tokens
        visual = (self.cfg.image_token_id, self.cfg.video_token_id)
        return fill_visual_slots(embed_tokens, token_ids, visual, image_features)

    def encoder_digest(self) -> str:
        """SHA-256 over the vision transformer's weights (merger included), in name order."""
        return encoder_digest(self, ("visual.",))


def canonical_name(name: str) -> str | None:
    """A checkpoint tensor's name in this module, or None for tensors that are not parameters."""
    if name.endswith("inv_freq"):
        return None
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def load_weights(
    model_dir: Path, model: nn.Module, num_layers: int, device: torch.device, dtype: torch.dtype
) -> None:
    """Reads the checkpoint's weights straight onto `device` one tensor at a time, each cast to
    `dtype` there once, into `model` (built on `meta`); every parameter must be present with its
    configured shape. A missing `lm_head` is tied to the embeddings."""
    state = read_state(model_dir, canonical_name, device, dtype)
    if "lm_head.weight" not in state and "language_model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["language_model.embed_tokens.weight"]
    fuse(state, num_layers)
    check_state(model, state)
    model.load_state_dict(state, strict=True, assign=True)


def load(model_dir: Path, device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> QwenVL:
    """A Qwen2.5-VL checkpoint on `device` in `dtype` (`load_weights`)."""
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = QwenVL(cfg)
    load_weights(model_dir, model, cfg.text.num_layers, device, dtype)
    with torch.device(device):
        model.reset_buffers()
    return model.eval()

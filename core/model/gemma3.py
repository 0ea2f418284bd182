"""Gemma 3: SigLIP tower + average-pool projector + a decoder of local (sliding-window) and global
layers, loaded from a Gemma 3 checkpoint directory (either layout `gemma3_config` reads).

The decoder's layers implement the family contract's `forward_paged`: the layer does norms,
projections, q/k norm, rotary and residuals and hands rotated q/k/v to the engine's `attend`,
which caches them and masks (causal; the layer's `sliding_window`; both ways inside one image,
since `bidirectional_images` is set)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.model import gemma3_config
from core.model.gemma3_config import MODEL_TYPES, Gemma3Config, GemmaTextConfig, Rope
from core.model.layers import activation, embed_with_images, register_pixel_affine
from core.model.llava import canonical_name
from core.model.text import _rotate
from core.model.vision import VisionTower
from core.model.weights import check_state, encoder_digest, fuse, read_state

if TYPE_CHECKING:
    from core.model.family import Attend, Linear

__all__ = ["MODEL_TYPES", "Gemma3", "GemmaImageLayout", "load"]

CPU = torch.device("cpu")


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), in float32, then casts back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class ScaledEmbedding(nn.Embedding):
    """Embeddings times sqrt(hidden), the factor rounded to the weights' dtype first as the
    checkpoint was trained (bfloat16 makes sqrt(3072) 55.5)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = float(torch.tensor(self.embedding_dim**0.5, dtype=self.weight.dtype))
        return super().forward(ids) * scale


@dataclass(frozen=True, slots=True)
class GemmaRope:
    """A step's rotary tables, (tokens, head_dim) cos and sin for each kind of layer."""

    local: tuple[torch.Tensor, torch.Tensor]
    full: tuple[torch.Tensor, torch.Tensor]


class Rotary(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, rope: Rope) -> None:
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self.reset_buffers()

    def reset_buffers(self) -> None:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.rope.theta**steps) / self.rope.linear_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


class Attention(nn.Module):
    """q/k/v fused into one GEMM (the loader concatenates the checkpoint's three), per-head
    RMSNorm on queries and keys before rotary."""

    def __init__(self, cfg: GemmaTextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar**-0.5

    def forward_paged(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
        linear: Linear,
    ) -> torch.Tensor:
        n = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv * self.head_dim
        q, k, v = torch.split(linear(self.qkv_proj, x), [q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).transpose(0, 1)
        k = self.k_norm(k.reshape(n, self.num_kv, self.head_dim)).transpose(0, 1)
        v = v.reshape(n, self.num_kv, self.head_dim).transpose(0, 1)
        cos, sin = cos_sin
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return linear(self.o_proj, attend(q, k, v, scale=self.scale))


class MLP(nn.Module):
    """Gated GELU (tanh) with the gate and up projections fused (`gate_up_proj`)."""

    def __init__(self, cfg: GemmaTextConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward_paged(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        gate, up = linear(self.gate_up_proj, x).chunk(2, dim=-1)
        return linear(self.down_proj, self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaTextConfig, local: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.sliding_window = cfg.sliding_window if local else None
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward_paged(
        self,
        x: torch.Tensor,
        rope: GemmaRope,
        attend: Attend,
        linear: Linear,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`core.model.family.PagedLayer`'s hook (`extra`: None, or rows added to the output)."""
        cos_sin = rope.local if self.sliding_window is not None else rope.full
        attn = self.self_attn.forward_paged(self.input_layernorm(x), cos_sin, attend, linear)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp.forward_paged(self.pre_feedforward_layernorm(x), linear)
        x = x + self.post_feedforward_layernorm(mlp)
        return x if extra is None else x + extra.to(x.dtype)


class Decoder(nn.Module):
    def __init__(self, cfg: GemmaTextConfig) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, local) for local in cfg.local_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.local_rotary = Rotary(cfg.head_dim, cfg.local_rope)
        self.global_rotary = Rotary(cfg.head_dim, cfg.global_rope)


class Projector(nn.Module):
    """SigLIP's patch grid average-pooled to sqrt(mm_tokens_per_image) a side, RMS-normed and
    projected to the decoder's width."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        width = cfg.vision.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(width, cfg.text.hidden_size))
        self.mm_soft_emb_norm = RMSNorm(width, cfg.vision.layer_norm_eps)
        self.grid = cfg.vision.image_size // cfg.vision.patch_size
        self.kernel = self.grid // int(cfg.mm_tokens_per_image**0.5)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(views, grid * grid, channels) -> (views, tokens, channels)."""
        views, _, channels = x.shape
        grid = x.transpose(1, 2).reshape(views, channels, self.grid, self.grid)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel)
        return pooled.flatten(2).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.mm_soft_emb_norm(self.pool(x))
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


def encode_with_importance(
    tower: VisionTower, projector: Projector, pixels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(views, 3, H, W) normalised pixels -> (views, tokens, text hidden) features and
    (views, tokens) importance: the mean attention each patch receives in the last layer,
    pooled like the features."""
    vit = tower.vision_model
    last = len(vit.encoder.layers)
    states = vit.hidden_states(pixels, upto=last)
    feats = projector(vit.post_layernorm(states[last]))
    scores = projector.pool(vit.importance(states[last - 1], last - 1)[..., None])[..., 0]
    return feats, scores


@dataclass(frozen=True, slots=True)
class GemmaImageLayout:
    """How Gemma 3's prompt shows an image (its processor's text): the chat template emits
    `<start_of_image>` (`marker`); each view becomes "\\n\\n<start_of_image>" + the visual
    tokens + "<end_of_image>\\n\\n", written here with the image token once (the engine repeats
    it to the view's tokens); an image with pan-and-scan crops is introduced and its crops
    announced in the processor's words."""

    marker: str  # <start_of_image>
    image_token: str  # <image_soft_token>
    end: str  # <end_of_image>

    def text(self, num_views: int) -> str:
        """The prompt text replacing the marker for an image of `num_views` views (the full
        image, then its crops)."""
        view = f"\n\n{self.marker}{self.image_token}{self.end}\n\n"
        if num_views <= 1:
            return view
        crops = " ".join([view] * (num_views - 1))
        return (
            f"Here is the original image {view} and here are some crops to help you see better "
            + crops
        )


class Gemma3(nn.Module):
    pixel_scale: torch.Tensor
    pixel_shift: torch.Tensor
    bidirectional_images = True  # image tokens attend both ways inside one image

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg.vision)
        self.multi_modal_projector = Projector(cfg)
        self.language_model = Decoder(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)builds the derived, non-persistent buffers; needed after loading on `meta`."""
        register_pixel_affine(self, self.cfg.image_mean, self.cfg.image_std)
        self.language_model.local_rotary.reset_buffers()
        self.language_model.global_rotary.reset_buffers()

    def normalize(self, pixels_u8: torch.Tensor) -> torch.Tensor:
        return pixels_u8.float() * self.pixel_scale + self.pixel_shift

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(views, 3, H, W) normalised pixels -> (views, mm_tokens_per_image, hidden)."""
        return self.encode_with_importance(pixels)[0]

    def encode_with_importance(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return encode_with_importance(self.vision_tower, self.multi_modal_projector, pixels)

    def encode_item(self, pixels_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's encode of one item (`core.encoders.ItemModel`): uint8 (views, 3, S, S)
        -> (views * mm_tokens_per_image, hidden) features and their importance, view by view."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        feats, scores = self.encode_with_importance(self.normalize(pixels_u8).to(dtype))
        return feats.flatten(0, 1), scores.flatten()

    def embed(
        self, token_ids: list[int] | torch.Tensor, image_features: torch.Tensor | None
    ) -> torch.Tensor:
        """Scaled token embeddings with the image tokens' rows replaced by image features
        (unscaled), in order."""
        return embed_with_images(
            self.language_model.embed_tokens, self.cfg.image_token_id, token_ids, image_features
        )

    def rope(self, positions: torch.Tensor) -> GemmaRope:
        """The step's rotary tables for (tokens,) positions; each layer takes its kind's."""
        decoder = self.language_model
        return GemmaRope(decoder.local_rotary(positions), decoder.global_rotary(positions))

    def prompt_positions(
        self, ids: list[int], grids: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor | None, int]:
        """Plain 1-D rope: positions are sequence indices."""
        return None, 0

    def encoder_digest(self) -> str:
        return encoder_digest(self)

    @property
    def image_layout(self) -> GemmaImageLayout:
        """What the tokenizer needs to lay out an image (`ChatTokenizer(..., layout=)`)."""
        return GemmaImageLayout("<start_of_image>", "<image_soft_token>", "<end_of_image>")


def load(model_dir: Path, device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> Gemma3:
    """The checkpoint's weights read straight onto `device`, each cast to `dtype` there once.
    A checkpoint whose tensors do not fit its config stops here with one line."""
    cfg = gemma3_config.load(model_dir)
    state = read_state(model_dir, canonical_name, device, dtype)
    embeddings = state.get("language_model.embed_tokens.weight")
    if "lm_head.weight" not in state and cfg.text.tie_word_embeddings and embeddings is not None:
        state["lm_head.weight"] = embeddings
    fuse(state, cfg.text.num_layers)
    with torch.device("meta"):
        model = Gemma3(cfg)
    check_state(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    with torch.device(device):  # the derived buffers (float32) beside the weights
        model.reset_buffers()
    return model.eval()

"""LLaVA: vision tower + projector + decoder, loaded from a llava-hf checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from core.model import config as model_config
from core.model.config import LlavaConfig
from core.model.layers import activation, embed_with_images, register_pixel_affine
from core.model.text import Decoder, KVCache
from core.model.vision import VisionTower
from core.model.weights import FUSED, encoder_digest, fuse, read_state

# Checkpoint prefixes (legacy llava-hf and transformers >= 4.52) -> this module's names.
_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
)
_IGNORED_SUFFIXES = ("position_ids", "rotary_emb.inv_freq")
CPU = torch.device("cpu")
MODEL_TYPES = ("llava",)  # config.json `model_type` values this family serves


class Projector(nn.Module):
    def __init__(self, cfg: LlavaConfig) -> None:
        super().__init__()
        width = cfg.vision.hidden_size * len(cfg.vision_feature_layers)
        self.linear_1 = nn.Linear(width, cfg.text.hidden_size, bias=cfg.projector_bias)
        self.act = activation(cfg.projector_act)
        self.linear_2 = nn.Linear(
            cfg.text.hidden_size, cfg.text.hidden_size, bias=cfg.projector_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def encode_with_importance(
    cfg: LlavaConfig, tower: VisionTower, projector: Projector, pixels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Llava.encode_with_importance` on the encoder's own modules, which the encoder backends
    place and export without the language model."""
    num_layers = cfg.vision.num_layers
    indices = [i if i >= 0 else num_layers + 1 + i for i in cfg.vision_feature_layers]
    last = max(indices)
    vit = tower.vision_model
    states = vit.hidden_states(pixels, upto=last)
    feats = torch.cat([states[i] for i in indices], dim=-1)
    scores = vit.importance(states[last - 1], last - 1) if last > 0 else feats[..., 0] * 0
    if cfg.drop_class_token:  # narrow, not [:, 1:]: see VisionTransformer.importance
        tokens = feats.shape[1] - 1
        feats, scores = feats.narrow(1, 1, tokens), scores.narrow(1, 1, tokens)
    return projector(feats), scores


class Llava(nn.Module):
    pixel_scale: torch.Tensor
    pixel_shift: torch.Tensor
    bidirectional_images = False  # causal attention over image tokens too

    def __init__(self, cfg: LlavaConfig) -> None:
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
        self.language_model.rotary.reset_buffers()

    def normalize(self, pixels_u8: torch.Tensor) -> torch.Tensor:
        return pixels_u8.float() * self.pixel_scale + self.pixel_shift

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(tiles, 3, H, W) normalised pixels -> (tiles, tokens_per_tile, text_hidden) features."""
        return self.encode_with_importance(pixels)[0]

    def encode_with_importance(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features as `encode_images`, plus (tiles, tokens_per_tile) importance scores for
        pruning, taken from the attention of the last selected layer."""
        return encode_with_importance(
            self.cfg, self.vision_tower, self.multi_modal_projector, pixels
        )

    def embed(
        self, token_ids: list[int] | torch.Tensor, image_features: torch.Tensor | None
    ) -> torch.Tensor:
        """Token embeddings, on the weights' device, with image-token positions replaced by image
        features, in order. The ids are counted on the host, without waiting for the device."""
        return embed_with_images(
            self.language_model.embed_tokens, self.cfg.image_token_id, token_ids, image_features
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the step's (tokens,) positions, for every layer."""
        return self.language_model.rotary(positions)

    def prompt_positions(
        self, ids: list[int], grids: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor | None, int]:
        """1-D rope: a token's position is its index in the sequence."""
        return None, 0

    def forward_tokens(self, embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of the last position after running `embeds` through the decoder."""
        hidden = self.language_model(embeds, cache)
        return self.lm_head(hidden[-1:]).float()[0]

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.text.num_layers)

    def encoder_digest(self) -> str:
        """SHA-256 over the encoder's (vision tower + projector) weights, in name order."""
        return encoder_digest(self)


def canonical_name(name: str) -> str | None:
    """A checkpoint tensor's name in this module, or None for tensors that are not parameters."""
    if name.endswith(_IGNORED_SUFFIXES) or ".head." in name:
        return None
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        # Some transformers versions save the bare vision transformer (no `vision_model.`).
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


def load(
    model_dir: Path,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
) -> Llava:
    """The checkpoint's weights read straight onto `device` one tensor at a time, each cast to
    `dtype` there once (float32 on the CPU, the default, is exactly the checkpoint's values)."""
    cfg = model_config.load(model_dir)
    state = read_state(model_dir, canonical_name, device, dtype)
    if "lm_head.weight" not in state and cfg.text.tie_word_embeddings:
        state["lm_head.weight"] = state["language_model.embed_tokens.weight"]
    fuse(state, cfg.text.num_layers)
    with torch.device("meta"):
        model = Llava(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    with torch.device(device):  # the derived buffers (float32) beside the weights
        model.reset_buffers()
    return model.eval()


def _unfuse(model: Llava, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the fused projections split back into the checkpoint's separate tensors."""
    text = model.cfg.text
    kv_size = text.num_kv_heads * text.head_dim
    sizes = {
        "self_attn.qkv_proj": [text.num_heads * text.head_dim, kv_size, kv_size],
        "mlp.gate_up_proj": [text.intermediate_size] * 2,
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        fused = next((f for f in FUSED if f".{f}." in name), None)
        if fused is None or not name.startswith("language_model.layers."):
            out[name] = tensor
            continue
        for part, piece in zip(FUSED[fused], torch.split(tensor, sizes[fused]), strict=True):
            out[name.replace(fused, part)] = piece
    return out


def save(model: Llava, path: Path) -> None:
    """Writes the weights in the legacy llava-hf layout that public checkpoints use."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _unfuse(model, model.state_dict()).items():
        if name.startswith("language_model."):
            name = "language_model.model." + name[len("language_model.") :]
        elif name.startswith("lm_head."):
            name = "language_model." + name
        out[name] = tensor.contiguous()
    save_file(out, str(path), metadata={"format": "pt"})

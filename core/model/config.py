"""Reads a llava-hf `config.json` into plain frozen dataclasses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VISION_TYPES = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
TEXT_TYPES = {"llama": "llama", "qwen2": "qwen2"}


class ModelConfigError(ValueError):
    """The checkpoint's config names something this loader does not implement."""


def read_json(path: Path, required: bool = False) -> dict[str, Any]:
    """A checkpoint's JSON object file; {} when it is absent and not `required`. Anything else
    wrong with it is a one-line ModelConfigError naming the file."""
    if not path.exists():
        if required:
            raise ModelConfigError(f"{path.name} is missing")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path.name} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path.name} is not a JSON object")
    return data


def processor_config(model_dir: Path) -> tuple[str, dict[str, Any]]:
    """(file name, the image processor's settings) in either layout; {} when there is neither."""
    nested = model_dir / "processor_config.json"
    if nested.exists():
        raw = read_json(nested)
        inner = raw.get("image_processor")
        if isinstance(inner, dict):
            return f"{nested.name} image_processor", inner
    flat = model_dir / "preprocessor_config.json"
    return flat.name, read_json(flat)


@dataclass(frozen=True, slots=True)
class VisionConfig:
    kind: str  # "clip" (class token, pre-norm) or "siglip" (no class token)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # square input side in pixels
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True, slots=True)
class TextConfig:
    kind: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool  # bias on q/k/v (always on for qwen2)
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: tuple[int, ...]  # may be empty: the tokenizer's eos token then decides


@dataclass(frozen=True, slots=True)
class LlavaConfig:
    vision: VisionConfig
    text: TextConfig
    image_token_id: int
    vision_feature_layers: tuple[int, ...]  # hidden-state indices concatenated as features
    drop_class_token: bool  # vision_feature_select_strategy == "default"
    projector_act: str
    projector_bias: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def tokens_per_tile(self) -> int:
        return self.vision.num_patches


def load(model_dir: Path) -> LlavaConfig:
    raw = read_json(model_dir / "config.json", required=True)
    pre = read_json(model_dir / "preprocessor_config.json")
    return parse(raw, pre)


def parse(raw: dict[str, Any], pre: dict[str, Any]) -> LlavaConfig:
    vc, tc = raw.get("vision_config", {}), raw.get("text_config", {})
    vkind = VISION_TYPES.get(vc.get("model_type", "clip_vision_model"))
    tkind = TEXT_TYPES.get(tc.get("model_type", "llama"))
    if vkind is None or tkind is None:
        raise ModelConfigError(
            f"unsupported model types {vc.get('model_type')!r} / {tc.get('model_type')!r}; "
            f"vision: {sorted(VISION_TYPES)}, text: {sorted(TEXT_TYPES)}"
        )
    vision = VisionConfig(
        kind=vkind,
        hidden_size=vc.get("hidden_size", 768),
        intermediate_size=vc.get("intermediate_size", 3072),
        num_layers=vc.get("num_hidden_layers", 12),
        num_heads=vc.get("num_attention_heads", 12),
        image_size=vc.get("image_size", 224),
        patch_size=vc.get("patch_size", 32 if vkind == "clip" else 16),
        hidden_act=vc.get("hidden_act", "quick_gelu" if vkind == "clip" else "gelu_pytorch_tanh"),
        layer_norm_eps=vc.get("layer_norm_eps", 1e-5 if vkind == "clip" else 1e-6),
    )
    heads = tc.get("num_attention_heads", 32)
    hidden = tc.get("hidden_size", 4096)
    rope = tc.get("rope_parameters") or {}
    eos = tc.get("eos_token_id", raw.get("eos_token_id"))
    text = TextConfig(
        kind=tkind,
        vocab_size=tc.get("vocab_size", 32000),
        hidden_size=hidden,
        intermediate_size=tc.get("intermediate_size", 11008),
        num_layers=tc.get("num_hidden_layers", 32),
        num_heads=heads,
        num_kv_heads=tc.get("num_key_value_heads") or heads,
        head_dim=tc.get("head_dim") or hidden // heads,
        rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", tc.get("rope_theta", 10000.0))),
        attention_bias=tkind == "qwen2" or bool(tc.get("attention_bias", False)),
        max_position_embeddings=tc.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", raw.get("tie_word_embeddings"))),
        eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
    )
    layer = raw.get("vision_feature_layer", -2)
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelConfigError(f"unsupported vision_feature_select_strategy {strategy!r}")
    return LlavaConfig(
        vision=vision,
        text=text,
        image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 32000))),
        vision_feature_layers=tuple(layer) if isinstance(layer, list) else (int(layer),),
        drop_class_token=strategy == "default",
        projector_act=raw.get("projector_hidden_act", "gelu"),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        image_mean=tuple(pre.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        image_std=tuple(pre.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
    )

"""Reads a Gemma 3 checkpoint's configuration into frozen dataclasses, from either layout it comes
in: what transformers 5's `save_pretrained` writes (`layer_types`, per-layer-type
`rope_parameters`, one nested `processor_config.json`, end tokens in `generation_config.json`) or
the Hub's published one (`sliding_window_pattern`, `rope_theta` / `rope_local_base_freq` /
`rope_scaling`, `preprocessor_config.json`, most sizes left to the defaults below, which are
transformers' own). Anything this core does not implement stops it with one line naming the file,
key and value."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.model.config import ModelConfigError, VisionConfig, read_json

MODEL_TYPES = ("gemma3",)
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class Rope:
    theta: float  # base frequency
    linear_factor: float  # positions divided by this ("linear" rope scaling); 1.0 = none


@dataclass(frozen=True, slots=True)
class GemmaTextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str  # of the gated MLP
    max_position_embeddings: int
    tie_word_embeddings: bool  # no lm_head in the checkpoint: the embeddings serve
    eos_token_id: tuple[int, ...]  # every end token the checkpoint lists
    query_pre_attn_scalar: float  # attention scale is its inverse square root
    sliding_window: int  # keys a local layer's query sees, itself included
    local_layers: tuple[bool, ...]  # per layer: sliding-window (local) or global attention
    local_rope: Rope  # rope of the local layers
    global_rope: Rope  # rope of the global layers


@dataclass(frozen=True, slots=True)
class PanAndScan:
    """The processor's crop settings (the gateway cuts the crops; the prompt names them)."""

    enabled: bool  # do_pan_and_scan
    min_crop_size: int  # pixels
    max_num_crops: int
    min_ratio_to_activate: float  # long side / short side before an image is cropped


@dataclass(frozen=True, slots=True)
class Gemma3Config:
    vision: VisionConfig
    text: GemmaTextConfig
    image_token_id: int  # <image_soft_token>: one per visual token
    boi_token_id: int  # <start_of_image>: where the chat template puts an image
    eoi_token_id: int  # <end_of_image>
    mm_tokens_per_image: int  # visual tokens per view (the SigLIP grid average-pooled)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    pan_and_scan: PanAndScan

    @property
    def tokens_per_tile(self) -> int:
        return self.mm_tokens_per_image


def load(model_dir: Path) -> Gemma3Config:
    raw = read_json(model_dir / "config.json", required=True)
    generation = read_json(model_dir / "generation_config.json")
    processor = read_json(model_dir / "processor_config.json")
    # transformers 5 nests the image processor's settings; the Hub keeps them in their own file.
    image = processor.get("image_processor") or read_json(model_dir / "preprocessor_config.json")
    return parse(raw, generation, processor, image)


def parse(
    raw: dict[str, Any],
    generation: dict[str, Any],
    processor: dict[str, Any],
    image: dict[str, Any],
) -> Gemma3Config:
    if raw.get("model_type") not in MODEL_TYPES:
        raise ModelConfigError(f"config.json model_type {raw.get('model_type')!r} is not gemma3")
    vc, tc = raw.get("vision_config") or {}, raw.get("text_config") or {}
    _expect(vc, "vision_config.model_type", "siglip_vision_model")
    _expect(tc, "text_config.model_type", "gemma3_text")
    vision = VisionConfig(
        kind="siglip",
        hidden_size=_int(vc, "hidden_size", 768, "vision_config"),
        intermediate_size=_int(vc, "intermediate_size", 3072, "vision_config"),
        num_layers=_int(vc, "num_hidden_layers", 12, "vision_config"),
        num_heads=_int(vc, "num_attention_heads", 12, "vision_config"),
        image_size=_int(vc, "image_size", 224, "vision_config"),
        patch_size=_int(vc, "patch_size", 16, "vision_config"),
        hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh"),
        layer_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
    )
    tokens = _int(raw, "mm_tokens_per_image", 256, "config.json")
    side, grid = math.isqrt(tokens), vision.image_size // vision.patch_size
    if side * side != tokens or grid % side:
        raise ModelConfigError(
            f"config.json mm_tokens_per_image {tokens} is not a square whose side divides the "
            f"vision grid ({grid} patches a side)"
        )
    seq = processor.get("image_seq_length", tokens)
    if seq != tokens:
        raise ModelConfigError(
            f"processor_config.json image_seq_length {seq} != mm_tokens_per_image {tokens}"
        )
    return Gemma3Config(
        vision=vision,
        text=_text(raw, tc, generation),
        image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 262_144))),
        boi_token_id=int(raw.get("boi_token_index", raw.get("boi_token_id", 255_999))),
        eoi_token_id=int(raw.get("eoi_token_index", raw.get("eoi_token_id", 256_000))),
        mm_tokens_per_image=tokens,
        image_mean=_triple(image, "image_mean"),
        image_std=_triple(image, "image_std"),
        pan_and_scan=PanAndScan(
            enabled=bool(image.get("do_pan_and_scan") or False),
            min_crop_size=int(image.get("pan_and_scan_min_crop_size") or 256),
            max_num_crops=int(image.get("pan_and_scan_max_num_crops") or 4),
            min_ratio_to_activate=float(image.get("pan_and_scan_min_ratio_to_activate") or 1.2),
        ),
    )


def _text(raw: dict[str, Any], tc: dict[str, Any], generation: dict[str, Any]) -> GemmaTextConfig:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if tc.get(key) is not None:
            raise ModelConfigError(f"config.json text_config.{key} {tc[key]!r} is not supported")
    if tc.get("use_bidirectional_attention"):
        raise ModelConfigError(
            "config.json text_config.use_bidirectional_attention is not supported"
        )
    act = tc.get("hidden_activation") or tc.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ModelConfigError(
            f"config.json text_config.hidden_activation {act!r} is not supported"
        )
    heads = _int(tc, "num_attention_heads", 8, "text_config")
    kv_heads = _int(tc, "num_key_value_heads", 4, "text_config")
    if heads % kv_heads:
        raise ModelConfigError(
            f"config.json text_config.num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    num_layers = _int(tc, "num_hidden_layers", 26, "text_config")
    local_rope, global_rope = _ropes(tc)
    eos: set[int] = set()
    for source in (generation, raw, tc):
        value = source.get("eos_token_id")
        eos.update(value if isinstance(value, list) else [] if value is None else [value])
    tied = tc.get("tie_word_embeddings", raw.get("tie_word_embeddings", True))
    return GemmaTextConfig(
        vocab_size=_int(tc, "vocab_size", 262_208, "text_config"),
        hidden_size=_int(tc, "hidden_size", 2304, "text_config"),
        intermediate_size=_int(tc, "intermediate_size", 9216, "text_config"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_int(tc, "head_dim", 256, "text_config"),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        hidden_act=act,
        max_position_embeddings=_int(tc, "max_position_embeddings", 131_072, "text_config"),
        tie_word_embeddings=bool(tied),
        eos_token_id=tuple(sorted(int(i) for i in eos)),
        query_pre_attn_scalar=float(tc.get("query_pre_attn_scalar", 256)),
        sliding_window=_int(tc, "sliding_window", 4096, "text_config"),
        local_layers=_local_layers(tc, num_layers),
        local_rope=local_rope,
        global_rope=global_rope,
    )


def _local_layers(tc: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    types = tc.get("layer_types")
    if types is None:  # the Hub's form: every pattern-th layer is global
        pattern = tc.get("sliding_window_pattern", tc.get("_sliding_window_pattern", 6))
        if not isinstance(pattern, int) or pattern < 1:
            raise ModelConfigError(
                f"config.json text_config.sliding_window_pattern {pattern!r} is not a positive int"
            )
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ModelConfigError(
            f"config.json text_config.layer_types must list {num_layers} of "
            f"{SLIDING!r} / {FULL!r}; got {types!r:.80}"
        )
    return tuple(t == SLIDING for t in types)


def _ropes(tc: dict[str, Any]) -> tuple[Rope, Rope]:
    """(local, global) rope: transformers 5 stores `rope_parameters` per layer type; the Hub
    stores `rope_theta` (global), `rope_local_base_freq` and `rope_scaling` (global only)."""
    params = tc.get("rope_parameters")
    if not isinstance(params, dict) or SLIDING not in params:
        params = {
            SLIDING: {"rope_theta": tc.get("rope_local_base_freq", 10_000.0)},
            FULL: {**(tc.get("rope_scaling") or {}), "rope_theta": tc.get("rope_theta", 1e6)},
        }
    ropes = []
    for kind, default in ((SLIDING, 10_000.0), (FULL, 1_000_000.0)):
        p = params.get(kind) or {}
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise ModelConfigError(
                f"config.json text_config rope_type {rope_type!r} of {kind} layers is not "
                "supported (default, linear)"
            )
        factor = float(p.get("factor", 1.0)) if rope_type == "linear" else 1.0
        ropes.append(Rope(float(p.get("rope_theta", default)), factor))
    return ropes[0], ropes[1]


def _expect(section: dict[str, Any], key: str, want: str) -> None:
    got = section.get("model_type", want)
    if got != want:
        raise ModelConfigError(f"config.json {key} {got!r} is not supported ({want})")


def _int(section: dict[str, Any], key: str, default: int, where: str) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"config.json {where}.{key} {value!r} is not a positive int")
    return value


def _triple(image: dict[str, Any], key: str) -> tuple[float, float, float]:
    value = image.get(key, [0.5, 0.5, 0.5])  # Gemma 3's processor: SigLIP's [-1, 1] range
    if not isinstance(value, list) or len(value) != 3:
        raise ModelConfigError(f"image processor {key} {value!r:.40} is not three numbers")
    return (float(value[0]), float(value[1]), float(value[2]))

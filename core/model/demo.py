"""Builds the demo checkpoint: a small LLaVA (CLIP ViT + projector + Llama) in llava-hf layout,
with a byte-level BPE tokenizer trained here. Fixed seed, no download. The weights it writes are
random (answers are noise); `visor model train-demo` (bench/quality/train.py) starts from this
build and trains it on the synthetic suite."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from core.model import config as model_config
from core.model.llava import Llava, save

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'][-1]['text'] + '\\n' }}"
    "{% else %}{{ message['role'].upper() }}: "
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>\\n' }}{% else %}{{ item['text'] }}{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {
        "vision": {
            "hidden_size": 96,
            "intermediate_size": 384,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "image_size": 224,
            # One token per cell of the synthetic suite's 8 x 8 layout (bench/quality/suite.py).
            "patch_size": 28,
        },
        "text": {
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "vocab_size": 512,
        "model_vocab_size": 0,  # rows of the embedding; 0 = the tokenizer's
        # The last layer's output: every layer of the small tower is used.
        "vision_feature_layer": -1,
    },
    # Benchmark size: a ViT-B/14 tower at 336 px (576 tokens per tile) and a 12-layer, hidden-768
    # decoder, so prefill and decode (not Python) dominate while a benchmark fits in minutes.
    "bench": {
        "vision": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "image_size": 336,
            "patch_size": 14,
        },
        "text": {
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
        },
        "vocab_size": 2048,
        "model_vocab_size": 0,  # rows of the embedding; 0 = the tokenizer's
        "vision_feature_layer": -2,  # llava-hf's default: the penultimate layer
    },
    # LLaVA-1.5-7B's shapes (CLIP ViT-L/14 at 336 px, Llama-2-7B), random weights: for the GPU
    # check (bench/gpu_check.py), built on the device in bf16 (13.5 GB) rather than downloaded.
    # The tokenizer trained here is small; the model's vocabulary is padded to 7B's 32064 rows
    # (ids past the tokenizer's decode to nothing) so the embedding and LM head weigh the same.
    "llava-7b": {
        "vision": {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "image_size": 336,
            "patch_size": 14,
        },
        "text": {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
        },
        "vocab_size": 2048,
        "model_vocab_size": 32064,
        "vision_feature_layer": -2,
    },
}
_WORDS = [
    "a",
    "an",
    "the",
    "is",
    "are",
    "of",
    "in",
    "on",
    "left",
    "right",
    "above",
    "below",
    "next",
    "to",
    "what",
    "how",
    "many",
    "which",
    "colour",
    "color",
    "red",
    "green",
    "blue",
    "yellow",
    "black",
    "white",
    "orange",
    "purple",
    "circle",
    "square",
    "triangle",
    "star",
    "shape",
    "shapes",
    "number",
    "word",
    "written",
    "image",
    "picture",
    "photo",
    "there",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "zero",
    "ten",
    "yes",
    "no",
    "small",
    "large",
    "big",
    "it",
    "this",
    "that",
    "describe",
    "see",
    "do",
    "you",
    "USER",
    "ASSISTANT",
    "SYSTEM",
]


# Question forms (the synthetic suite's among them), so that they tokenize to few tokens.
_PHRASES = [
    "How many circles are there?",
    "How many squares are there?",
    "How many triangles are there?",
    "What number is written?",
    "What colour is the",
    "Is the red circle left of the blue square?",
    "Is the green triangle right of the yellow circle?",
    "Is the purple square above the orange triangle?",
    "Is the blue circle below the red square?",
]


def _corpus() -> list[str]:
    lines = [" ".join(p) for p in itertools.permutations(_WORDS[:24], 3)][:4000]
    lines += _PHRASES * 20
    lines += [f"{w} {i}" for w in _WORDS for i in range(10)]
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def sincos_positions(rows: int, dim: int) -> torch.Tensor:
    """(rows, dim) start values for the tower's position embeddings: the class token (when
    `rows` is a square plus one) at zero, then 2-D sine-cosine codes of each patch's row and
    column. A small random start leaves a short training run to discover positions; these start
    with row and column linearly readable."""
    side = math.isqrt(rows)
    extra = rows - side * side
    quarter = dim // 4
    freq = 1.0 / (100.0 ** (torch.arange(quarter, dtype=torch.float32) / max(1, quarter)))
    grid = torch.arange(side, dtype=torch.float32)
    angles = grid[:, None] * freq[None, :]  # (side, quarter)
    code = torch.cat([angles.sin(), angles.cos()], dim=1)  # (side, 2 * quarter)
    row = code[:, None, :].expand(side, side, -1)
    col = code[None, :, :].expand(side, side, -1)
    table = torch.zeros(rows, dim)
    table[extra:, : 4 * quarter] = torch.cat([row, col], dim=-1).reshape(side * side, -1)
    return table


def build(
    out: Path,
    preset: str = "demo",
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Writes config.json, preprocessor/tokenizer configs, tokenizer.json and model.safetensors.
    The weights are drawn on `device` (a 7B model's init is minutes on a CPU, a second on a GPU)
    and saved in `dtype`; the draw is seeded per device, not bitwise the same across devices."""
    spec = PRESETS[preset]
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(spec["vocab_size"])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    raw = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": ids["<image>"],
        "projector_hidden_act": "gelu",
        "vision_feature_layer": spec["vision_feature_layer"],
        "vision_feature_select_strategy": "default",
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            **spec["vision"],
        },
        "text_config": {
            "model_type": "llama",
            "vocab_size": max(tok.get_vocab_size(), spec["model_vocab_size"]),
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "bos_token_id": ids["<s>"],
            "eos_token_id": ids["</s>"],
            "pad_token_id": ids["<pad>"],
            **spec["text"],
        },
        "tie_word_embeddings": False,
        "visor_demo": {"preset": preset, "seed": seed, "trained": False},
    }
    pre = {
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": spec["vision"]["image_size"]},
        "crop_size": {
            "height": spec["vision"]["image_size"],
            "width": spec["vision"]["image_size"],
        },
    }
    tok_cfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
    }
    for name, data in (
        ("config.json", raw),
        ("preprocessor_config.json", pre),
        ("tokenizer_config.json", tok_cfg),
    ):
        (out / name).write_text(json.dumps(data, indent=2) + "\n")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llava(model_config.parse(raw, pre))
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv2d)):
            nn.init.normal_(module.weight, std=0.02)
            bias = getattr(module, "bias", None)  # nn.Embedding has none
            if isinstance(bias, torch.Tensor):
                nn.init.zeros_(bias)
    with torch.no_grad():
        embeddings = model.vision_tower.vision_model.embeddings
        positions = embeddings.position_embedding.weight
        positions.copy_(sincos_positions(positions.shape[0], positions.shape[1]))
        # A patch's pixel projection starts a tenth of the usual size, below the position code:
        # at 0.02 over 28 x 28 x 3 inputs it is ~2 and hides where the patch is (measured: a
        # linear probe reads a patch's row at 52% from the tower's output, at 100% with this).
        embeddings.patch_embedding.weight.mul_(0.1)
    save(model.to("cpu", dtype), out / "model.safetensors")
    return out

"""Tiny random-weight checkpoints of the non-LLaVA families, saved by transformers' own classes
with a small BPE tokenizer (the family's special tokens spelled as the real ones) and a chat
template written here in the family's prompt layout. Shared by the family tests
(tests/core/test_qwen_vl.py, test_gemma3.py, test_family_engine.py) and the end-to-end test
(tests/integration/test_families_e2e.py); transformers is a test dependency only.

- `build_qwen(root)`: Qwen2.5-VL in transformers 5's layout (`t5`) and the Hub's (`hub`).
- `build_qwen3(root)`: Qwen3-VL in both layouts, the same way.
- `build_gemma(out)`: Gemma 3 as transformers 5 saves it; `gemma_hub_copy` rewrites it in the
  Hub's layout.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# ---- Qwen2.5-VL -------------------------------------------------------------------------------

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen2.5-VL's prompt layout: a default system turn, each image or video between vision marks.
QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}{% set video_count.value = video_count.value + 1 %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen_words() -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "fa", "gu", "ze"]
    return ["".join(p) for p in itertools.product(syllables, repeat=2)] + [
        "What", "colour", "is", "the", "circle", "square", "How", "many", "are", "there", "?",
    ]  # fmt: skip


def qwen_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=QWEN_SPECIALS,
    )
    words = _qwen_words()
    tok.train_from_iterator([" ".join(words[i : i + 7]) for i in range(len(words))], trainer)
    return tok


def qwen_video_patches(
    frames: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]
) -> torch.Tensor:
    """transformers' Qwen2-VL video processor's normalisation and flatten order for (T, 3, H, W)
    uint8 frames, T even, transcribed (it needs torchvision, which is absent here):
    (batch, t, temporal, c, h/m, m, p, w/m, m, p) permuted."""
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    x = (frames.float() / 255 - m) / s
    t, c, h, w = x.shape
    x = x.view(1, t // 2, 2, c, h // 28, 2, 14, w // 28, 2, 14)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(t // 2 * (h // 14) * (w // 14), c * 2 * 14 * 14)


def _qwen_config(transformers: Any, tok: Tokenizer) -> Any:
    return transformers.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
            "eos_token_id": tok.token_to_id("<|im_end|>"),
            "bos_token_id": tok.token_to_id("<|endoftext|>"),
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
            "window_size": 56,  # 2 x 2 merged tokens: the test images have several windows
            "tokens_per_second": 2,
        },
        image_token_id=tok.token_to_id("<|image_pad|>"),
        video_token_id=tok.token_to_id("<|video_pad|>"),
        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
        vision_end_token_id=tok.token_to_id("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def _qwen_write_tokenizer(
    transformers: Any, tok: Tokenizer, path: Path, template_in_config: bool
) -> None:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = QWEN_TEMPLATE
    fast.save_pretrained(path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    if template_in_config:  # the Hub's layout: the template inside tokenizer_config.json
        (path / "chat_template.jinja").unlink(missing_ok=True)
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = QWEN_TEMPLATE
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def _qwen_hub_config(nested: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's nested config.json rewritten as the Hub's flat one."""
    text = dict(nested.pop("text_config"))
    rope = text.pop("rope_parameters")
    flat = {**nested, **{k: v for k, v in text.items() if k != "model_type"}}
    flat["rope_theta"] = rope["rope_theta"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["model_type"] = "qwen2_5_vl"
    flat["tie_word_embeddings"] = False  # the Hub's checkpoints store lm_head
    vision = dict(flat["vision_config"])
    vision.pop("rope_parameters")
    vision["model_type"] = "qwen2_5_vl"
    flat["vision_config"] = vision
    return flat


@dataclass
class QwenCheckpoints:
    hf: Any  # Qwen2_5_VLForConditionalGeneration, float32, eval
    hub: Path  # the Hub's layout
    t5: Path  # transformers 5's layout
    image_processor: Any  # Qwen2VLImageProcessorPil with the checkpoint's settings


def build_qwen(root: Path, **processor: Any) -> QwenCheckpoints:
    """Both layouts under `root`; `processor`: Qwen2VLImageProcessorPil settings (e.g. a small
    `size` so that served images stay a few tokens)."""
    import transformers

    tok = qwen_tokenizer()
    torch.manual_seed(0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(_qwen_config(transformers, tok)).eval()
    with torch.no_grad():  # wider than the 0.02 init, so that greedy tokens vary
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15 if "embed" not in name else 0.3)
    hub, t5 = root / "hub", root / "t5"
    hf.save_pretrained(hub)
    shutil.copytree(hub, t5)
    image_processor = transformers.Qwen2VLImageProcessorPil(**processor)
    # Hub: flat config, preprocessor_config.json, visual.* / model.* / lm_head.* tensors.
    nested = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps(_qwen_hub_config(nested)))
    (hub / "generation_config.json").unlink()
    image_processor.save_pretrained(hub)
    state = load_file(hub / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, hub / "model.safetensors", metadata={"format": "pt"})
    _qwen_write_tokenizer(transformers, tok, hub, template_in_config=True)
    # transformers 5: nested processor_config.json, chat_template.jinja, model.visual.* /
    # model.language_model.* tensors, tied head stored nowhere, end tokens in generation_config.
    renamed = {
        ("model.language_model." + k[6:] if k.startswith("model.") else "model." + k): v
        for k, v in load_file(t5 / "model.safetensors").items()
    }
    save_file(renamed, t5 / "model.safetensors", metadata={"format": "pt"})
    settings = image_processor.to_dict()
    (t5 / "processor_config.json").write_text(json.dumps({"image_processor": settings}))
    _qwen_write_tokenizer(transformers, tok, t5, template_in_config=False)
    return QwenCheckpoints(hf, hub, t5, image_processor)


# ---- Qwen3-VL ---------------------------------------------------------------------------------

# Qwen3-VL's prompt layout: no default system turn, each image or video between vision marks
# (its processor then splits a video into timestamped frame pairs).
QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen3_config(transformers: Any, tok: Tokenizer) -> Any:
    """3 decoder layers (head_dim 32, not hidden / heads), a 3-block tower of 16 px patches with
    a 4 x 4 position table (resized to every grid) and deepstack after blocks 0 and 1."""
    return transformers.Qwen3VLConfig(
        text_config={
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            "eos_token_id": tok.token_to_id("<|im_end|>"),
        },
        vision_config={
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": 16,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0, 1],
        },
        image_token_id=tok.token_to_id("<|image_pad|>"),
        video_token_id=tok.token_to_id("<|video_pad|>"),
        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
        vision_end_token_id=tok.token_to_id("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def _qwen3_write_tokenizer(transformers: Any, tok: Tokenizer, path: Path, hub: bool) -> None:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = QWEN3_TEMPLATE
    fast.save_pretrained(path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    if hub:  # the Hub's Qwen3-VL repositories: chat_template.json
        (path / "chat_template.jinja").unlink(missing_ok=True)
        (path / "chat_template.json").write_text(json.dumps({"chat_template": QWEN3_TEMPLATE}))


def _qwen3_hub_config(nested: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's config.json as the Hub's (transformers 4.57) spells it: `rope_scaling`
    and `rope_theta` in text_config, the vision rope's theta implied, lm_head stored."""
    out = dict(nested)
    text = dict(out["text_config"])
    rope = dict(text.pop("rope_parameters"))
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    out["text_config"] = text
    vision = dict(out["vision_config"])
    vision.pop("rope_parameters")
    out["vision_config"] = vision
    out["tie_word_embeddings"] = False
    return out


@dataclass
class Qwen3Checkpoints:
    hf: Any  # Qwen3VLForConditionalGeneration, float32, eval
    hub: Path  # the Hub's layout
    t5: Path  # transformers 5's layout
    image_processor: Any  # Qwen2VLImageProcessorPil at patch 16 (Qwen3-VL has no class of its own)


def build_qwen3(root: Path, **processor: Any) -> Qwen3Checkpoints:
    """Both layouts under `root`; `processor`: extra Qwen2VLImageProcessorPil settings (e.g. a
    small `size`, so that served images stay a few tokens)."""
    import transformers

    tok = qwen_tokenizer()
    torch.manual_seed(0)
    hf = transformers.Qwen3VLForConditionalGeneration(_qwen3_config(transformers, tok)).eval()
    with torch.no_grad():  # wider than the 0.02 init, so that greedy tokens vary
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15 if "embed" not in name else 0.3)
    hub, t5 = root / "hub", root / "t5"
    hf.save_pretrained(t5)
    shutil.copytree(t5, hub)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3, **processor
    )
    # transformers 5: nested processor_config.json, chat_template.jinja, tied head stored
    # nowhere, end tokens in generation_config.json.
    settings = {"image_processor": image_processor.to_dict()}
    (t5 / "processor_config.json").write_text(json.dumps(settings, default=str))
    _qwen3_write_tokenizer(transformers, tok, t5, hub=False)
    # Hub: rope_scaling, preprocessor_config.json, chat_template.json, lm_head stored.
    nested = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps(_qwen3_hub_config(nested)))
    image_processor.save_pretrained(hub)
    state = load_file(hub / "model.safetensors")
    state["lm_head.weight"] = state["model.language_model.embed_tokens.weight"].clone()
    save_file(state, hub / "model.safetensors", metadata={"format": "pt"})
    _qwen3_write_tokenizer(transformers, tok, hub, hub=True)
    return Qwen3Checkpoints(hf, hub, t5, image_processor)


# ---- Gemma 3 ----------------------------------------------------------------------------------

GEMMA_SIZE, GEMMA_TOKENS = 224, 16
GEMMA_SPECIALS = [
    "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
]  # fmt: skip
_GEMMA_TEXT = (
    "the a cat dog sat on mat what is in this image describe picture red blue green here are "
    "some crops to help you see better original and user model compare both images which one "
    "left right big small colour shape circle square"
)
# Gemma 3's prompt layout (written here, not copied): turns open with <start_of_turn> and a role
# (the assistant's is "model"), images are marked <start_of_image>, text is trimmed.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _gemma_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = _GEMMA_TEXT.split()
    corpus = [" ".join(words[i:] + words[:i]) + "\n\n" for i in range(len(words))]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=GEMMA_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus * 4, trainer)
    return tok


def build_gemma(out: Path, **processor: Any) -> None:
    """A tiny Gemma 3 checkpoint as transformers 5 saves it, with random weights everywhere
    (transformers initialises the norms and the projector to zero). `processor`: extra
    Gemma3ImageProcessorPil settings (pan and scan).

    Sizes: the text model is 4 layers (0..2 local, 3 global), sliding window 8 (shorter than an
    image's 16 tokens, so the window cuts inside images and the prompts), hidden 64, 4 heads,
    2 kv heads, head_dim 16; the vision tower is 2 layers of width 32 at 224 px (Gemma 3's
    896 px is slow on CPU), patch 14 -> a 16 x 16 grid pooled to 4 x 4 = 16 tokens."""
    import transformers

    tok = _gemma_tokenizer()
    ids = {s: tok.token_to_id(s) for s in GEMMA_SPECIALS}
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    image_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": GEMMA_SIZE, "width": GEMMA_SIZE},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        **processor,
    )
    proc = transformers.Gemma3Processor(
        image_processor, hf_tok, chat_template=GEMMA_TEMPLATE, image_seq_length=GEMMA_TOKENS
    )
    cfg = transformers.Gemma3Config(
        text_config={
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "query_pre_attn_scalar": 24,
            "max_position_embeddings": 512,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": GEMMA_SIZE,
            "patch_size": 14,
            "vision_use_head": False,
        },
        mm_tokens_per_image=GEMMA_TOKENS,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        pad_token_id=ids["<pad>"],
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if "norm" in name else 0.4 if "projection" in name else 0.08
            param.normal_(0.0, scale)
    model.save_pretrained(out)
    proc.save_pretrained(out)


def gemma_hub_copy(src: Path, out: Path) -> None:
    """The same checkpoint in the Hub's published layout: flat preprocessor_config.json, the
    rope and sliding pattern in their old keys, `vision_tower.vision_model.*` and
    `language_model.model.*` tensors, the chat template inside tokenizer_config.json."""
    out.mkdir()
    shutil.copy(src / "tokenizer.json", out)
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = (src / "chat_template.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    proc = json.loads((src / "processor_config.json").read_text())
    (out / "preprocessor_config.json").write_text(json.dumps(proc.pop("image_processor")))
    (out / "processor_config.json").write_text(json.dumps(proc))
    cfg = json.loads((src / "config.json").read_text())
    text = cfg["text_config"]
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        text.pop(key, None)
    text.update(
        sliding_window_pattern=4,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    (out / "config.json").write_text(json.dumps(cfg))
    rename_tensors(src, out, gemma_hub_name)


def gemma_hub_name(name: str) -> str:
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


def rename_tensors(src: Path, out: Path, rename: Callable[[str], str]) -> None:
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {rename(n): f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

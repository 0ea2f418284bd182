"""A tiny random-weight LLaVA-OneVision checkpoint saved by transformers' own classes, with a small
BPE tokenizer (Qwen2's special tokens and `<image>` / `<video>` spelled as the real ones) and a
chat template written here in OneVision's prompt layout; shared by the core test
(tests/core/test_llava_onevision.py) and the end-to-end test.
transformers is a test dependency only.

Sizes: SigLIP tower of 2 layers, width 32, at 56 px with patch 14 (a tile is 4 x 4 = 16 tokens);
Qwen2 decoder of 2 layers, hidden 64; pinpoints up to 3 x 3 tiles and `anyres_max_2`, so that a
grid happens, is unpadded, and past two tiles' worth is downscaled.
"""

from __future__ import annotations

import functools
import importlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from tests.family_checkpoints import QWEN_SPECIALS, qwen_tokenizer

SIZE, PATCH, TOKENS = 56, 14, 16
PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112], [56, 168], [168, 56], [168, 168]]
ASPECT = "anyres_max_2"
SPECIALS = [*QWEN_SPECIALS, "<image>", "<video>"]
# OneVision's prompt layout (written here, not copied): a turn opens with its role and a space,
# its images come first, each text item on a line of its own.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<image>' }}"
    "{% elif item['type'] == 'video' %}{{ '<video>' }}{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}"
    "{{ '\n' + item['text'] }}{% endif %}{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class OnevisionCheckpoint:
    hf: Any  # LlavaOnevisionForConditionalGeneration, float32, eval
    hub: Path  # the Hub's layout (what transformers 5.25 saves: legacy names, flat processor)
    t5: Path  # transformers 5's in-memory names, nested processor_config.json
    image_processor: Any  # LlavaOnevisionImageProcessorPil with the checkpoint's settings
    tokenizer: Any  # PreTrainedTokenizerFast with the chat template

    def num_image_tokens(self, height: int, width: int, lone: bool) -> int:
        """LlavaOnevisionProcessor's count for one image (its constructor needs a video
        processor, which needs torchvision: its counting methods run on a stand-in)."""
        cls = importlib.import_module("transformers").LlavaOnevisionProcessor
        if not lone:
            return TOKENS + 1
        this = SimpleNamespace(
            image_processor=self.image_processor,
            num_image_tokens=TOKENS,
            vision_aspect_ratio=ASPECT,
        )
        this._get_unpadded_features = functools.partial(cls._get_unpadded_features, this)
        return int(cls._get_number_of_features(this, height, width, SIZE, SIZE))


def _tokenizer() -> Tokenizer:
    tok = qwen_tokenizer()
    tok.add_special_tokens(["<image>", "<video>"])
    return tok


def _config(transformers: Any, tok: Tokenizer) -> Any:
    return transformers.LlavaOnevisionConfig(
        text_config={
            "model_type": "qwen2",
            "vocab_size": 320,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "eos_token_id": tok.token_to_id("<|im_end|>"),
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": SIZE,
            "patch_size": PATCH,
            "vision_use_head": False,
        },
        image_token_index=tok.token_to_id("<image>"),
        video_token_index=tok.token_to_id("<video>"),
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio=ASPECT,
    )


def t5_name(name: str) -> str:
    """A legacy tensor name as transformers 5 holds it in memory."""
    for old, new in (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("image_newline", "model.image_newline"),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def build_onevision(root: Path) -> OnevisionCheckpoint:
    import transformers

    tok = _tokenizer()
    torch.manual_seed(0)
    hf = transformers.LlavaOnevisionForConditionalGeneration(_config(transformers, tok)).eval()
    with torch.no_grad():  # wider than the 0.02 init, so that greedy tokens vary
        for name, p in hf.named_parameters():
            if p.dim() > 1 or "newline" in name:
                p.normal_(0, 0.3 if "embed" in name or "newline" in name else 0.15)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    image_processor = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": SIZE, "width": SIZE}, image_grid_pinpoints=PINPOINTS
    )
    hub, t5 = root / "hub", root / "t5"
    hf.save_pretrained(hub)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(hub)
    image_processor.save_pretrained(hub)  # preprocessor_config.json, flat
    shutil.copytree(hub, t5)
    (t5 / "preprocessor_config.json").unlink()
    settings = image_processor.to_dict()
    (t5 / "processor_config.json").write_text(json.dumps({"image_processor": settings}))
    renamed = {t5_name(k): v for k, v in load_file(t5 / "model.safetensors").items()}
    save_file(renamed, t5 / "model.safetensors", metadata={"format": "pt"})
    return OnevisionCheckpoint(hf, hub, t5, image_processor, fast)

"""Loader parity: the core's in-house LLaVA modules against transformers' reference
`LlavaForConditionalGeneration` on the same checkpoint and inputs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.engine import Engine
from core.model import llava
from core.model.tokenizer import ChatTurn
from core.types import InferRequest, Result, SamplingParams

transformers = pytest.importorskip("transformers")
# Stated tolerance: both sides run float32 on the CPU; observed max abs difference is ~1e-6.
ATOL = 1e-4


def _inputs(model: llava.Llava, engine_tokenizer: object) -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    size = model.cfg.vision.image_size
    pixels = torch.randint(0, 256, (1, 3, size, size), generator=gen, dtype=torch.uint8)
    turns = [ChatTurn("user", "What colour is the circle?", 1)]
    ids = engine_tokenizer.encode_chat(turns, [model.cfg.tokens_per_tile])  # type: ignore[attr-defined]
    return ids, pixels


def _logits_both(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor, float]:
    engine = Engine(model_dir, "parity")
    ours = engine.model
    ids, pixels = _inputs(ours, engine.tokenizer)
    ref = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        expected = ref(
            input_ids=torch.tensor([ids]),
            pixel_values=ours.normalize(pixels),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        ).logits[0]
        feats = ours.encode_images(ours.normalize(pixels)).reshape(-1, ours.cfg.text.hidden_size)
        hidden = ours.language_model(ours.embed(torch.tensor(ids), feats), ours.new_cache())
        got = ours.lm_head(hidden)
    engine.close()
    return got, expected, float((got - expected).abs().max())


def test_demo_checkpoint_logits_match_transformers(model_dir: Path) -> None:
    got, expected, max_abs = _logits_both(model_dir)
    print(f"demo checkpoint: max abs logit difference {max_abs:.3e} (tolerance {ATOL})")
    assert got.shape == expected.shape
    assert max_abs < ATOL
    assert expected.std() > 0.05  # logits carry signal: a zero model would pass trivially


def test_greedy_output_matches_transformers(model_dir: Path) -> None:
    engine = Engine(model_dir, "parity")
    ours = engine.model
    ids, pixels = _inputs(ours, engine.tokenizer)
    ref = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    n = 16
    with torch.no_grad():
        out = ref.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=ours.normalize(pixels),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    expected = engine.tokenizer.decode(out[0, len(ids) :].tolist())

    async def run() -> Result:
        feats, _ = engine.encoder.encode(pixels.numpy())
        feats = feats.reshape(-1, feats.shape[-1])
        req = InferRequest(
            "t",
            "r",
            (ChatTurn("user", "What colour is the circle?", 1),),
            SamplingParams(max_new_tokens=n, min_new_tokens=n),
            (),
            "none",
        )
        result = None
        async for item in engine.generate(req, [feats], {}):
            if isinstance(item, Result):
                result = item
        assert result is not None
        return result

    result = asyncio.run(run())
    engine.close()
    assert result.output_tokens == n
    assert result.text == expected


def test_siglip_qwen2_checkpoint_saved_by_transformers(tmp_path: Path, model_dir: Path) -> None:
    """A second architecture pair, written by transformers itself (its current key layout)."""
    cfg = transformers.LlavaConfig(
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=16,
        ),
        text_config=transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=512,
        ),
        image_token_index=4,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    torch.manual_seed(1)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    assert (
        "siglip"
        in json.loads((tmp_path / "config.json").read_text())["vision_config"]["model_type"]
    )
    got, expected, max_abs = _logits_both(tmp_path)
    print(f"siglip+qwen2 checkpoint: max abs logit difference {max_abs:.3e}")
    assert max_abs < ATOL
    assert np.isfinite(got.numpy()).all() and expected.abs().max() > 0

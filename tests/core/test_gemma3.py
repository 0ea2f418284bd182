"""Gemma 3 as a family of the core: a tiny random-weight checkpoint saved by transformers' own
classes (and a Hub-layout copy of it), loaded by `core.model.gemma3.load`, run through the family
contract's `forward_paged` with a dense `attend` written here, against transformers'
`Gemma3ForConditionalGeneration` on the same inputs.

Sizes: the text model is 4 layers (0..2 local, 3 global), sliding window 8 (shorter than an image's
16 tokens, so the window cuts inside images and the prompts), hidden 64, 4 heads, 2 kv heads,
head_dim 16; the vision tower is 2 layers of width 32 at 224 px (Gemma 3's 896 px is slow on
CPU), patch 14 -> a 16 x 16 grid pooled to 4 x 4 = 16 tokens (mm_tokens_per_image 16)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.model import gemma3, gemma3_config
from core.model.config import ModelConfigError
from core.model.tokenizer import ChatTokenizer, ChatTurn
from tests.family_checkpoints import (
    GEMMA_SIZE,
    GEMMA_TOKENS,
    build_gemma,
    gemma_hub_copy,
    gemma_hub_name,
    rename_tensors,
)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
PIL = pytest.importorskip("PIL.Image")

ATOL = 1e-4  # float32 on both sides
SIZE, TOKENS, NEW_TOKENS = GEMMA_SIZE, GEMMA_TOKENS, 8


@dataclass
class Checkpoint:
    saved: Path  # as transformers 5 saves it
    hub: Path  # the Hub's layout
    ref: object  # transformers' model
    processor: object  # transformers' processor
    ours: gemma3.Gemma3 = field(init=False)
    tokenizer: ChatTokenizer = field(init=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    root = tmp_path_factory.mktemp("gemma3")
    build_gemma(root / "saved")
    gemma_hub_copy(root / "saved", root / "hub")
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        root / "saved", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    processor = transformers.AutoProcessor.from_pretrained(root / "saved")
    c = Checkpoint(root / "saved", root / "hub", ref, processor)
    c.ours = gemma3.load(c.saved)
    c.tokenizer = ChatTokenizer(c.saved, c.ours.cfg.image_token_id, c.ours.image_layout)
    return c


class DenseKV:
    """The engine's side of the contract, written out densely: every layer's keys and values
    so far, and the mask built explicitly (causal; the layer's sliding window; both ways inside
    one run of image tokens)."""

    def __init__(
        self, model: gemma3.Gemma3, bidirectional: bool = True, windows: bool = True
    ) -> None:
        self.model, self.bidirectional, self.windows = model, bidirectional, windows
        self.keys: list[torch.Tensor | None] = [None] * len(model.language_model.layers)
        self.values: list[torch.Tensor | None] = [None] * len(model.language_model.layers)
        self.blocks: list[int] = []  # per position: image run index, or -1 for text

    def run(self, ids: list[int], image_features: torch.Tensor | None) -> torch.Tensor:
        """Float32 logits of every new position."""
        start, image_id = len(self.blocks), self.model.cfg.image_token_id
        for token in ids:
            run = self.blocks[-1] if self.blocks else -1
            if run < 0:  # the token after text opens a new run (if it is an image token)
                run = max(self.blocks, default=-1) + 1
            self.blocks.append(run if token == image_id else -1)
        positions = torch.arange(start, start + len(ids))
        rope = self.model.rope(positions)
        x = self.model.embed(ids, image_features)
        decoder = self.model.language_model
        for n, layer in enumerate(decoder.layers):
            attend = self._attend(n, layer.sliding_window, positions)
            x = layer.forward_paged(x, rope, attend, lambda m, t: m(t))
        return self.model.lm_head(decoder.norm(x)).float()

    def _attend(
        self, layer: int, window: int | None, positions: torch.Tensor
    ) -> Callable[..., torch.Tensor]:
        def attend(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
        ) -> torch.Tensor:
            old_k, old_v = self.keys[layer], self.values[layer]
            if old_k is not None and old_v is not None:
                k, v = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)
            self.keys[layer], self.values[layer] = k, v
            blocks = torch.tensor(self.blocks)
            qpos, kpos = positions[:, None], torch.arange(k.shape[1])[None, :]
            same_image = (blocks[positions][:, None] == blocks[None, :]) & (blocks[None, :] >= 0)
            mask = (kpos <= qpos) | (same_image & self.bidirectional)
            if window is not None and self.windows:
                mask &= kpos > qpos - window
            groups = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            scores = (q @ k.transpose(1, 2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            return (probs @ v).transpose(0, 1).reshape(q.shape[1], -1)

        return attend


def _images(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8) for _ in range(count)]


def _messages(turns: list[ChatTurn]) -> list[dict[str, object]]:
    return [
        {
            "role": t.role,
            "content": [{"type": "image"}] * t.num_images + [{"type": "text", "text": t.text}],
        }
        for t in turns
    ]


def _reference_inputs(
    c: Checkpoint, turns: list[ChatTurn], images: list[np.ndarray], **kwargs: object
) -> dict[str, torch.Tensor]:
    proc = c.processor
    text = proc.apply_chat_template(_messages(turns), add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    pil = [PIL.fromarray(a) for a in images]
    return dict(proc(text=text, images=pil, return_tensors="pt", **kwargs))  # type: ignore[operator]


def _compare(
    c: Checkpoint, ids: list[int], pixels: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> tuple[float, list[int], list[int]]:
    """(max abs logit difference over the prompt and every decode step, our greedy tokens,
    transformers' greedy tokens)."""
    ours, ref = c.ours, c.ref
    eos = list(ours.cfg.text.eos_token_id)
    with torch.no_grad():
        expected = ref(**inputs).logits[0]  # type: ignore[operator]
        out = ref.generate(  # type: ignore[attr-defined]
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        kv = DenseKV(ours)
        got = kv.run(ids, ours.encode_images(pixels).flatten(0, 1))
        diff = float((got - expected).abs().max())
        assert expected.std() > 0.1  # logits carry signal: a zero model would pass trivially
        tokens: list[int] = []
        step = got[-1]
        for n in range(NEW_TOKENS):
            diff = max(diff, float((step - out.logits[n][0]).abs().max()))
            step = step.clone()
            step[eos] = float("-inf")  # min_new_tokens, as transformers applies it
            tokens.append(int(step.argmax()))
            step = kv.run([tokens[-1]], None)[-1]
    return diff, tokens, out.sequences[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    ("turns", "num_images"),
    [
        ([ChatTurn("user", "describe this picture", 1)], 1),
        ([ChatTurn("user", "compare both images: which one is red?", 2)], 2),
    ],
    ids=["one_image", "two_images"],
)
def test_logits_and_greedy_text_match_transformers(
    ckpt: Checkpoint, turns: list[ChatTurn], num_images: int
) -> None:
    images = _images(num_images, seed=num_images)
    inputs = _reference_inputs(ckpt, turns, images)
    ids = ckpt.tokenizer.encode_chat(turns, [TOKENS] * num_images)
    assert ids == inputs["input_ids"][0].tolist()  # the processor's prompt layout, id for id
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    normed = ckpt.ours.normalize(pixels)
    assert float((normed - inputs["pixel_values"]).abs().max()) < 1e-6
    inputs["pixel_values"] = normed
    diff, ours, theirs = _compare(ckpt, ids, normed, inputs)
    print(f"gemma3 {num_images} image(s): max abs logit difference {diff:.2e} (tolerance {ATOL})")
    assert diff <= ATOL
    assert ours == theirs
    print(f"greedy: {ours}")


def test_pan_and_scan_prompt_and_logits_match_transformers(ckpt: Checkpoint) -> None:
    """A wide image cut into 3 crops: the processor's "Here is the original image ..." layout,
    the full view then the crops, 16 tokens each, each its own bidirectional run."""
    wide = np.random.default_rng(7).integers(0, 256, (SIZE, 3 * SIZE, 3), dtype=np.uint8)
    turns = [ChatTurn("user", "what is in this image?", 1)]
    inputs = _reference_inputs(
        ckpt, turns, [wide], do_pan_and_scan=True, pan_and_scan_min_crop_size=32
    )
    views = inputs["pixel_values"].shape[0]
    assert views == 4
    ids = ckpt.tokenizer.expand(ckpt.tokenizer.encode_prompt(turns, [views]), [TOKENS] * views)
    assert ids == inputs["input_ids"][0].tolist()
    # The crops come resized by the processor: feed both models its pixels (no uint8 here).
    with torch.no_grad():
        ref = ckpt.ref(**inputs).logits[0]  # type: ignore[operator]
        feats, scores = ckpt.ours.encode_with_importance(inputs["pixel_values"])
        feats = feats.flatten(0, 1)
        got = DenseKV(ckpt.ours).run(ids, feats)
    diff = float((got - ref).abs().max())
    print(f"gemma3 pan-and-scan (4 views): max abs logit difference {diff:.2e}")
    assert scores.shape == (views, TOKENS)  # importance per visual token, for pruning
    assert diff <= ATOL


@pytest.mark.parametrize("rule", ["bidirectional", "windows"])
def test_each_mask_rule_matters(ckpt: Checkpoint, rule: str) -> None:
    """The image rule and the sliding window are load-bearing at these sizes: without either,
    the logits move (so the parity above could not pass with a wrong mask)."""
    turns = [ChatTurn("user", "describe this picture", 1)]
    ids = ckpt.tokenizer.encode_chat(turns, [TOKENS])
    pixels = torch.from_numpy(np.stack(_images(1, 1))).permute(0, 3, 1, 2).contiguous()
    with torch.no_grad():
        feats = ckpt.ours.encode_images(ckpt.ours.normalize(pixels)).flatten(0, 1)
        right = DenseKV(ckpt.ours).run(ids, feats)
        wrong = DenseKV(ckpt.ours, **{rule: False}).run(ids, feats)  # type: ignore[arg-type]
    assert ckpt.ours.bidirectional_images
    assert float((right - wrong).abs().max()) > 1e-2


def _same_model(a: gemma3.Gemma3, b: gemma3.Gemma3) -> None:
    assert a.cfg == b.cfg
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)


def test_hub_layout_loads_the_same_model(ckpt: Checkpoint) -> None:
    hub = gemma3.load(ckpt.hub)
    _same_model(hub, ckpt.ours)
    assert hub.cfg.text.local_layers == (True, True, True, False)  # from sliding_window_pattern
    assert hub.cfg.text.global_rope == gemma3_config.Rope(1e6, 8.0)  # from rope_scaling
    tok = ChatTokenizer(ckpt.hub, hub.cfg.image_token_id, hub.image_layout)  # template in json
    turns = [ChatTurn("user", "describe this picture", 1)]
    assert tok.encode_chat(turns, [TOKENS]) == ckpt.tokenizer.encode_chat(turns, [TOKENS])


def test_prefixed_names_and_an_untied_head_load(ckpt: Checkpoint, tmp_path: Path) -> None:
    """transformers' in-memory names (`model.language_model.*`, ...) with an explicit lm_head."""
    for name in ("config.json", "tokenizer.json", "processor_config.json"):
        shutil.copy(ckpt.saved / name, tmp_path)

    def rename(name: str) -> str:
        name = gemma_hub_name(name)
        return "model." + name.replace("language_model.model.", "language_model.", 1)

    rename_tensors(ckpt.saved, tmp_path, rename)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    assert "model.vision_tower.vision_model.post_layernorm.weight" in tensors
    head = torch.randn_like(tensors["model.language_model.embed_tokens.weight"])
    tensors["lm_head.weight"] = head
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = gemma3.load(tmp_path)
    assert torch.equal(model.lm_head.weight, head)
    emb = model.language_model.embed_tokens.weight
    assert torch.equal(emb, ckpt.ours.language_model.embed_tokens.weight)


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


MALFORMED: dict[str, tuple[Callable[[Path], None], str]] = {
    "model_type": (
        lambda d: _edit_config(d / "config.json", lambda c: c.update(model_type="gemma2")),
        "config.json model_type 'gemma2' is not gemma3",
    ),
    "softcap": (
        lambda d: _edit_config(
            d / "config.json", lambda c: c["text_config"].update(attn_logit_softcapping=50.0)
        ),
        "text_config.attn_logit_softcapping 50.0 is not supported",
    ),
    "rope": (
        lambda d: _edit_config(
            d / "config.json",
            lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(
                rope_type="yarn"
            ),
        ),
        "rope_type 'yarn' of full_attention layers is not supported",
    ),
    "layer_types": (
        lambda d: _edit_config(
            d / "config.json", lambda c: c["text_config"].update(layer_types=["full_attention"])
        ),
        "text_config.layer_types must list 4",
    ),
    "tokens_per_image": (
        lambda d: _edit_config(d / "config.json", lambda c: c.update(mm_tokens_per_image=15)),
        "mm_tokens_per_image 15 is not a square",
    ),
    "image_seq_length": (
        lambda d: _edit_config(
            d / "processor_config.json", lambda c: c.update(image_seq_length=256)
        ),
        "processor_config.json image_seq_length 256 != mm_tokens_per_image 16",
    ),
    "hidden_size": (
        lambda d: _edit_config(
            d / "config.json", lambda c: c["text_config"].update(hidden_size=96)
        ),
        "mm_input_projection_weight has shape (32, 64); the config implies (32, 96)",
    ),
    "missing_tensor": (
        lambda d: rename_tensors(
            d, d, lambda n: n.replace("layers.3.self_attn.k_norm", "layers.3.self_attn.x_norm")
        ),
        "lacks 1 tensor(s) the config implies, e.g. language_model.layers.3.self_attn.k_norm",
    ),
    "not_json": (
        lambda d: (d / "config.json").write_text("{'model_type': gemma3"),
        "config.json is not readable JSON",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoint_stops_with_one_line(
    ckpt: Checkpoint, tmp_path: Path, case: str
) -> None:
    shutil.copytree(ckpt.saved, tmp_path / "ck")
    break_it, expected = MALFORMED[case]
    break_it(tmp_path / "ck")
    with pytest.raises(ModelConfigError) as err:
        gemma3.load(tmp_path / "ck")
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_tokenizer_refuses_a_layout_it_cannot_spell(ckpt: Checkpoint) -> None:
    wrong = gemma3.GemmaImageLayout("<start_of_picture>", "<image_soft_token>", "<end_of_image>")
    with pytest.raises(ModelConfigError, match="lacks the special tokens"):
        ChatTokenizer(ckpt.saved, ckpt.ours.cfg.image_token_id, wrong)


def test_user_text_cannot_open_an_image(ckpt: Checkpoint) -> None:
    """`<start_of_image>` typed by a user is text: no image slot, no image token."""
    turns = [ChatTurn("user", "look <start_of_image> here", 0)]
    ids = ckpt.tokenizer.encode_prompt(turns)
    cfg = ckpt.ours.cfg
    assert cfg.image_token_id not in ids and cfg.boi_token_id not in ids


def test_bfloat16_runs_close_to_float32(ckpt: Checkpoint) -> None:
    """The weights cast to bfloat16 at load (the GPU's dtype) run the same layers without a
    dtype error, and stay near the float32 logits."""
    half = gemma3.load(ckpt.saved, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16
    turns = [ChatTurn("user", "describe this picture", 1)]
    ids = ckpt.tokenizer.encode_chat(turns, [TOKENS])
    pixels = torch.from_numpy(np.stack(_images(1, 1))).permute(0, 3, 1, 2).contiguous()
    with torch.no_grad():
        feats = ckpt.ours.encode_images(ckpt.ours.normalize(pixels))
        full = DenseKV(ckpt.ours).run(ids, feats.flatten(0, 1))
        feats = half.encode_images(half.normalize(pixels).to(torch.bfloat16))
        low = DenseKV(half).run(ids, feats.flatten(0, 1))
    err = float((full - low).abs().max() / full.abs().max())
    print(f"gemma3 bfloat16 vs float32: max abs logit difference / max logit {err:.3f}")
    assert err < 0.1

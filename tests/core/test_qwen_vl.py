"""Qwen2.5-VL as a family of the core: a tiny random-weight checkpoint saved by transformers'
own classes, in both layouts a checkpoint comes in, loaded by `core.model.qwen2_5_vl.load` and
run through the layers' `forward_paged` with a dense attention written here; logits and greedy
tokens against transformers' `Qwen2_5_VLForConditionalGeneration` on the same inputs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from core.model import qwen2_5_vl
from core.model.config import ModelConfigError
from core.model.qwen2_5_vl_vision import patchify
from core.model.tokenizer import ChatTokenizer, ChatTurn
from tests.family_checkpoints import QWEN_TEMPLATE as TEMPLATE
from tests.family_checkpoints import QwenCheckpoints as Checkpoints
from tests.family_checkpoints import build_qwen, qwen_video_patches

transformers = pytest.importorskip("transformers")
ATOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return build_qwen(tmp_path_factory.mktemp("qwen"))


def _pixels(seed: int, frames: int, height: int, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, 3, height, width), generator=gen, dtype=torch.uint8)


class DenseAttention:
    """Full causal attention over everything run so far, k/v concatenated per layer."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def layer(self, i: int) -> Callable[..., torch.Tensor]:
        def attend(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
        ) -> torch.Tensor:
            old_k, old_v = self.keys[i], self.values[i]
            if old_k is not None and old_v is not None:
                k, v = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)
            self.keys[i], self.values[i] = k, v
            n, total = q.shape[1], k.shape[1]
            mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
            )
            return out[0].transpose(0, 1).reshape(n, -1)

        return attend


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _run(
    model: qwen2_5_vl.QwenVL, embeds: torch.Tensor, positions: torch.Tensor, kv: DenseAttention
) -> torch.Tensor:
    rope = model.rope(positions)
    x = embeds
    for i, layer in enumerate(model.language_model.layers):
        x = layer.forward_paged(x, rope, kv.layer(i), _linear)
    return model.lm_head(model.language_model.norm(x))


@dataclass
class Case:
    ids: list[int]
    pixels: list[torch.Tensor]  # uint8, per visual item
    hf_inputs: dict[str, torch.Tensor]


def _image_case(ck: Checkpoints, sizes: list[tuple[int, int]]) -> Case:
    chat = ChatTokenizer(ck.t5, qwen2_5_vl.load_config(ck.t5).image_token_id)
    pixels = [_pixels(i, 1, h, w) for i, (h, w) in enumerate(sizes)]
    prompt = chat.encode_prompt([ChatTurn("user", "What colour is the circle?", len(sizes))])
    ids = chat.expand(prompt, [(h // 28) * (w // 28) for h, w in sizes])
    hf_in = ck.image_processor(  # type: ignore[operator]
        [p[0].permute(1, 2, 0).numpy() for p in pixels], do_resize=False, return_tensors="pt"
    )
    return Case(
        ids,
        pixels,
        {"pixel_values": hf_in["pixel_values"], "image_grid_thw": hf_in["image_grid_thw"]},
    )


def _video_case(ck: Checkpoints) -> Case:
    cfg = qwen2_5_vl.load_config(ck.t5)
    frames = _pixels(7, 4, 56, 84)
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(ck.t5)
    messages = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "How many are there?"}],
        }
    ]
    prompt = fast.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids: list[int] = []
    for token in prompt:
        ids += [token] * (2 * 2 * 3 if token == cfg.video_token_id else 1)
    pre = cfg.preprocess
    patches = qwen_video_patches(frames, pre.image_mean, pre.image_std)
    grid = torch.tensor([[2, 4, 6]])
    return Case(ids, [frames], {"pixel_values_videos": patches, "video_grid_thw": grid})


def _reference(ck: Checkpoints, case: Case, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    cfg = qwen2_5_vl.load_config(ck.t5)
    ids = torch.tensor([case.ids])
    types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    kwargs = {**case.hf_inputs, "mm_token_type_ids": types, "attention_mask": torch.ones_like(ids)}
    hf = ck.hf
    with torch.no_grad():
        logits = hf(input_ids=ids, **kwargs).logits[0]  # type: ignore[operator]
        out = hf.generate(  # type: ignore[attr-defined]
            input_ids=ids, **kwargs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
    return logits, out[0, len(case.ids) :].tolist()


def _ours(model: qwen2_5_vl.QwenVL, case: Case, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    with torch.no_grad():
        encoded = [model.encode_visual(p) for p in case.pixels]
        feats = torch.cat([f for f, _ in encoded]) if encoded else None
        positions, delta = model.prompt_positions(case.ids, [g for _, g in encoded])
        if positions is None:
            positions = torch.arange(len(case.ids))
        kv = DenseAttention(model.cfg.text.num_layers)
        logits = _run(model, model.embed(case.ids, feats), positions, kv)
        tokens = [int(logits[-1].argmax())]
        for _ in range(new_tokens - 1):
            step = torch.tensor([len(case.ids) + len(tokens) - 1 + delta])
            last = _run(model, model.embed(tokens[-1:], None), step, kv)
            tokens.append(int(last[-1].argmax()))
    return logits, tokens


@pytest.mark.parametrize("layout", ["hub", "t5"])
@pytest.mark.parametrize("kind", ["one_image", "two_images", "video"])
def test_logits_and_greedy_match_transformers(ckpt: Checkpoints, layout: str, kind: str) -> None:
    case = {
        "one_image": lambda: _image_case(ckpt, [(140, 196)]),
        "two_images": lambda: _image_case(ckpt, [(140, 196), (84, 56)]),
        "video": lambda: _video_case(ckpt),
    }[kind]()
    model = qwen2_5_vl.load(getattr(ckpt, layout))
    expected_logits, expected_tokens = _reference(ckpt, case, 8)
    logits, tokens = _ours(model, case, 8)
    max_abs = float((logits - expected_logits).abs().max())
    print(f"qwen2.5-vl {layout} {kind}: max abs logit difference {max_abs:.2e}")
    assert logits.shape == expected_logits.shape
    assert max_abs <= ATOL
    assert expected_logits.std() > 0.1  # the logits carry signal
    assert tokens == expected_tokens
    assert len(set(tokens)) > 1  # greedy output that varies, so the comparison means something


def test_patchify_matches_the_image_processor(ckpt: Checkpoints) -> None:
    model = qwen2_5_vl.load(ckpt.t5)
    pixels = _pixels(3, 1, 112, 168)
    ref = ckpt.image_processor(
        pixels[0].permute(1, 2, 0).numpy(), do_resize=False, return_tensors="pt"
    )  # type: ignore[operator]
    ours, grid = patchify(model.normalize(pixels), model.cfg.vision)
    assert grid == (1, 4, 6) and ref["image_grid_thw"].tolist() == [[1, 8, 12]]
    assert ours.shape == ref["pixel_values"].shape
    assert float((ours - ref["pixel_values"]).abs().max()) < 1e-5


def test_odd_video_repeats_its_last_frame(ckpt: Checkpoints) -> None:
    model = qwen2_5_vl.load(ckpt.t5)
    frames = _pixels(5, 3, 56, 56)
    padded = torch.cat([frames, frames[-1:]])
    odd, odd_grid = model.encode_visual(frames)
    even, even_grid = model.encode_visual(padded)
    assert odd_grid == even_grid == (2, 2, 2)
    assert torch.equal(odd, even)


def test_positions_after_a_long_video_follow_its_largest_position() -> None:
    # 3 temporal patches 4 s apart at 2 tokens/s: t positions 0, 8, 16; h, w 0..1. Text after
    # the video starts at 16 + 1 (the trained rule), not at start + max(h, w) = 2.
    ids = [9, 7, *[7] * 11, 5]
    positions, delta = qwen2_5_vl.mrope_positions(ids, [(3, 2, 2)], (6, 7), [4.0], 2.0)
    assert positions[:, 0].tolist() == [0, 0, 0]
    assert positions[0, 1:13].tolist() == [1] * 4 + [9] * 4 + [17] * 4
    assert positions[1, 1:5].tolist() == [1, 1, 2, 2] and positions[2, 1:5].tolist() == [1, 2, 1, 2]
    assert positions[:, 13].tolist() == [18, 18, 18]
    assert delta == 18 - 13


def test_chat_tokenizer_renders_the_template_like_transformers(ckpt: Checkpoints) -> None:
    for layout in (ckpt.hub, ckpt.t5):
        chat = ChatTokenizer(layout, qwen2_5_vl.load_config(layout).image_token_id)
        fast = transformers.PreTrainedTokenizerFast.from_pretrained(layout)
        fast.chat_template = TEMPLATE
        content = [
            {"type": "image"},
            {"type": "image"},
            {"type": "text", "text": "What is the circle?"},
        ]
        expected = fast.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert chat.encode_prompt([ChatTurn("user", "What is the circle?", 2)]) == expected
    assert qwen2_5_vl.load_config(ckpt.t5).text.eos_token_id == (
        fast.convert_tokens_to_ids("<|im_end|>"),
    )


def test_both_layouts_load_the_same_model(ckpt: Checkpoints) -> None:
    hub, t5 = qwen2_5_vl.load(ckpt.hub), qwen2_5_vl.load(ckpt.t5)
    assert hub.cfg.mrope_section == t5.cfg.mrope_section == (2, 3, 3)
    assert hub.cfg.preprocess == t5.cfg.preprocess
    assert hub.encoder_digest() == t5.encoder_digest()
    for (name, a), (_, b) in zip(hub.state_dict().items(), t5.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _broken(ckpt: Checkpoints, tmp_path: Path, change: Callable[[Path], None]) -> str:
    target = tmp_path / "broken"
    shutil.copytree(ckpt.t5, target)
    change(target)
    with pytest.raises(ModelConfigError) as info:
        qwen2_5_vl.load(target)
    message = str(info.value)
    assert "\n" not in message
    return message


def _edit_config(key: str, value: object) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
        (path / "config.json").write_text(json.dumps(cfg))

    return change


def _edit_text(key: str, value: object) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["text_config"][key] = value
        (path / "config.json").write_text(json.dumps(cfg))

    return change


def _drop_tensor(path: Path) -> None:
    state = load_file(path / "model.safetensors")
    state.pop("model.visual.merger.ln_q.weight")
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (_edit_config("vision_config", None), "vision_config is missing"),
        (_edit_config("model_type", "qwen9_vl"), "'qwen9_vl'"),
        (
            _edit_text("rope_parameters", {"rope_theta": 1e4, "mrope_section": [2, 3, 4]}),
            "mrope_section [2, 3, 4]",
        ),
        (
            _edit_text("rope_parameters", {"rope_type": "yarn", "mrope_section": [2, 3, 3]}),
            "'yarn'",
        ),
        (_edit_text("intermediate_size", 96), "has shape (256, 64); the config implies (192, 64)"),
        (lambda p: (p / "model.safetensors").unlink(), "no *.safetensors"),
        (
            lambda p: (p / "model.safetensors").write_bytes(b"not a checkpoint"),
            "model.safetensors is not",
        ),
        (_drop_tensor, "lacks 1 tensor(s) the config implies, e.g. visual.merger.ln_q.weight"),
        (lambda p: (p / "config.json").write_text("{"), "config.json is not readable JSON"),
    ],
)
def test_malformed_checkpoint_is_one_line(
    ckpt: Checkpoints, tmp_path: Path, change: Callable[[Path], None], words: str
) -> None:
    assert words in _broken(ckpt, tmp_path, change)


def test_the_image_reaches_the_logits(ckpt: Checkpoints) -> None:
    """Differently seeded images give different logits: the vision path reaches the output."""
    model = qwen2_5_vl.load(ckpt.t5)
    case = _image_case(ckpt, [(140, 196)])
    other = Case(case.ids, [_pixels(99, 1, 140, 196)], case.hf_inputs)
    a, _ = _ours(model, case, 1)
    b, _ = _ours(model, other, 1)
    assert float((a - b).abs().max()) > 1e-2
    assert np.isfinite(a.numpy()).all()

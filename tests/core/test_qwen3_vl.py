"""Qwen3-VL as a family of the core: a tiny random-weight checkpoint saved by transformers' own
classes, in both layouts a checkpoint comes in, loaded by `core.model.qwen3_vl.load` and run
through the layers' `forward_paged` (deepstack inputs as each layer's `extra`) with the dense
attention of test_qwen_vl; logits and greedy tokens against transformers'
`Qwen3VLForConditionalGeneration` on the same inputs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.model import qwen3_vl
from core.model.config import ModelConfigError
from core.model.family import DeepstackModel, load_model
from core.model.qwen2_5_vl_vision import patchify
from core.model.tokenizer import ChatTokenizer, ChatTurn
from tests.core.test_qwen_vl import DenseAttention, _linear, _pixels
from tests.family_checkpoints import QWEN3_TEMPLATE, Qwen3Checkpoints, build_qwen3
from tests.helpers import run_in_child

transformers = pytest.importorskip("transformers")
ATOL = 1e-4  # float32 on both sides
VIDEO_WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Qwen3Checkpoints:
    return build_qwen3(tmp_path_factory.mktemp("qwen3"))


def _video_patches(frames: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3-VL video processor's flatten order, transcribed (it needs
    torchvision, which is absent here): an odd count's last frame repeated, then
    (batch, t, temporal, c, h/m, m, p, w/m, m, p) permuted."""
    frames = torch.cat([frames, frames[-1:].expand(frames.shape[0] % 2, -1, -1, -1)])
    x = (frames.float() / 255 - 0.5) / 0.5
    t, c, h, w = x.shape
    x = x.view(1, t // 2, 2, c, h // 32, 2, 16, w // 32, 2, 16)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(t // 2 * (h // 16) * (w // 16), c * 2 * 16 * 16)


@dataclass
class Case:
    ids: list[int]
    pixels: list[torch.Tensor]  # uint8, per visual item in prompt order
    hf_inputs: dict[str, torch.Tensor]


def _prompt(
    ck: Qwen3Checkpoints, content: list[dict[str, str]], videos: list[torch.Tensor]
) -> list[int]:
    """The processor's prompt: the template rendered, each video's wrapper replaced by its
    timestamped frame pairs, each image slot repeated to its tokens by the caller."""
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(ck.t5)
    text = fast.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    for video in videos:
        seconds = qwen3_vl.frame_seconds(list(range(video.shape[0])), fps=2.0)
        per_frame = (video.shape[2] // 32) * (video.shape[3] // 32)
        text = text.replace(VIDEO_WRAPPER, qwen3_vl.video_placeholder(seconds, per_frame), 1)
    return list(fast(text, add_special_tokens=False)["input_ids"])


def _case(ck: Qwen3Checkpoints, items: list[tuple[str, int, int, int]]) -> Case:
    """items: (kind, frames, height, width) in prompt order."""
    cfg = qwen3_vl.load_config(ck.t5)
    pixels = [_pixels(i, f, h, w) for i, (_, f, h, w) in enumerate(items)]
    content = [{"type": kind} for kind, *_ in items] + [{"type": "text", "text": "How many?"}]
    videos = [p for p, (kind, *_) in zip(pixels, items, strict=True) if kind == "video"]
    images = [p for p, (kind, *_) in zip(pixels, items, strict=True) if kind == "image"]
    prompt = _prompt(ck, content, videos)
    image_tokens = iter((p.shape[2] // 32) * (p.shape[3] // 32) for p in images)
    ids: list[int] = []
    for token in prompt:
        ids += [token] * (next(image_tokens) if token == cfg.image_token_id else 1)
    hf_in: dict[str, torch.Tensor] = {}
    if images:
        out = ck.image_processor(  # type: ignore[operator]
            [p[0].permute(1, 2, 0).numpy() for p in images], do_resize=False, return_tensors="pt"
        )
        hf_in |= {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    if videos:
        hf_in["pixel_values_videos"] = torch.cat([_video_patches(v) for v in videos])
        grids = [[(v.shape[0] + 1) // 2, v.shape[2] // 16, v.shape[3] // 16] for v in videos]
        hf_in["video_grid_thw"] = torch.tensor(grids)
    return Case(ids, pixels, hf_in)


CASES = {
    "one_image": [("image", 1, 160, 224)],
    "two_images": [("image", 1, 160, 224), ("image", 1, 96, 64)],
    "video": [("video", 4, 64, 96)],
    "image_and_video": [("image", 1, 96, 128), ("video", 3, 64, 64)],
}


def _reference(ck: Qwen3Checkpoints, case: Case, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    cfg = qwen3_vl.load_config(ck.t5)
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


def _run(
    model: qwen3_vl.Qwen3VL,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    kv: DenseAttention,
    extras: list[torch.Tensor | None],
) -> torch.Tensor:
    rope = model.rope(positions)
    x = embeds
    for i, layer in enumerate(model.language_model.layers):
        x = layer.forward_paged(x, rope, kv.layer(i), _linear, extras[i])
    return model.lm_head(model.language_model.norm(x))


def _ours(model: qwen3_vl.Qwen3VL, case: Case, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    with torch.no_grad():
        encoded = [model.encode_visual(p) for p in case.pixels]
        feats = torch.cat([f for f, _ in encoded]) if encoded else None
        positions, delta = model.prompt_positions(case.ids, [g for _, g in encoded])
        if positions is None:
            positions = torch.arange(len(case.ids))
        kv = DenseAttention(model.cfg.text.num_layers)
        extras = model.deepstack_inputs(case.ids, feats)
        logits = _run(model, model.embed(case.ids, feats), positions, kv, extras)
        tokens = [int(logits[-1].argmax())]
        for _ in range(new_tokens - 1):
            step = torch.tensor([len(case.ids) + len(tokens) - 1 + delta])
            no_extras = model.deepstack_inputs(tokens[-1:], None)
            last = _run(model, model.embed(tokens[-1:], None), step, kv, no_extras)
            tokens.append(int(last[-1].argmax()))
    return logits, tokens


@pytest.mark.parametrize("layout", ["hub", "t5"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_logits_and_greedy_match_transformers(
    ckpt: Qwen3Checkpoints, layout: str, kind: str
) -> None:
    case = _case(ckpt, CASES[kind])
    model = qwen3_vl.load(getattr(ckpt, layout))
    expected_logits, expected_tokens = _reference(ckpt, case, 8)
    logits, tokens = _ours(model, case, 8)
    max_abs = float((logits - expected_logits).abs().max())
    print(f"qwen3-vl {layout} {kind}: max abs logit difference {max_abs:.2e}")
    assert logits.shape == expected_logits.shape
    assert max_abs <= ATOL
    assert expected_logits.std() > 0.1  # the logits carry signal
    assert tokens == expected_tokens
    assert len(set(tokens)) > 1  # greedy output that varies, so the comparison means something


def test_deepstack_reaches_the_logits(ckpt: Qwen3Checkpoints) -> None:
    """Without the deepstack inputs the logits move: the comparison above covers them."""
    model = qwen3_vl.load(ckpt.t5)
    case = _case(ckpt, CASES["one_image"])
    with torch.no_grad():
        (feats, grid) = model.encode_visual(case.pixels[0])
        positions, _ = model.prompt_positions(case.ids, [grid])
        assert positions is not None
        embeds = model.embed(case.ids, feats)
        extras = model.deepstack_inputs(case.ids, feats)
        assert [e is None for e in extras] == [False, False, True]
        hidden = model.cfg.text.hidden_size
        assert feats.shape == (5 * 7, 3 * hidden)
        rows = torch.tensor([i == model.cfg.image_token_id for i in case.ids])
        assert extras[0] is not None and not extras[0][~rows].any()
        with_deepstack = _run(model, embeds, positions, DenseAttention(3), extras)
        without = _run(model, embeds, positions, DenseAttention(3), [None] * 3)
    assert float((with_deepstack - without).abs().max()) > 1e-2


def test_patchify_matches_the_image_processor(ckpt: Qwen3Checkpoints) -> None:
    model = qwen3_vl.load(ckpt.t5)
    pixels = _pixels(3, 1, 128, 192)
    ref = ckpt.image_processor(  # type: ignore[operator]
        pixels[0].permute(1, 2, 0).numpy(), do_resize=False, return_tensors="pt"
    )
    ours, grid = patchify(model.normalize(pixels), model.cfg.vision)
    assert grid == (1, 4, 6) and ref["image_grid_thw"].tolist() == [[1, 8, 12]]
    assert float((ours - ref["pixel_values"]).abs().max()) < 1e-5


def test_positions_give_every_frame_pair_t_equal_start(ckpt: Qwen3Checkpoints) -> None:
    """Two frame pairs of 1 x 2 tokens back to back, then text: each pair starts where the
    text before it ends, t does not advance inside a pair, text resumes at start + max(h, w)."""
    model = qwen3_vl.load(ckpt.t5)
    video = model.cfg.video_token_id
    ids = [100, video, video, 101, video, video, 102]
    positions, delta = model.prompt_positions(ids, [(2, 1, 2)])
    assert positions is not None
    assert positions.tolist() == [
        [0, 1, 1, 3, 4, 4, 6],
        [0, 1, 1, 3, 4, 4, 6],
        [0, 1, 2, 3, 4, 5, 6],
    ]
    assert delta == 0


def test_interleaved_axes_follow_transformers() -> None:
    # Qwen3-VL's released layout: 64 pairs, section (24, 20, 20).
    axes = qwen3_vl.interleaved_axes((24, 20, 20), 64).tolist()
    assert axes[:6] == [0, 1, 2, 0, 1, 2] and axes[60:] == [0, 0, 0, 0]
    assert [axes.count(a) for a in range(3)] == [24, 20, 20]


def test_frame_seconds_average_each_pair() -> None:
    assert qwen3_vl.frame_seconds([0, 2, 4, 6], fps=4.0) == [0.25, 1.25]
    assert qwen3_vl.frame_seconds([0, 2, 4], fps=2.0) == [0.5, 2.0]  # last frame repeated


def test_chat_tokenizer_renders_the_template_like_transformers(ckpt: Qwen3Checkpoints) -> None:
    for layout in (ckpt.hub, ckpt.t5):
        chat = ChatTokenizer(layout, qwen3_vl.load_config(layout).image_token_id)
        fast = transformers.PreTrainedTokenizerFast.from_pretrained(layout)
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "How many?"}]
        expected = fast(
            fast.apply_chat_template(
                [{"role": "user", "content": content}],
                chat_template=QWEN3_TEMPLATE,
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )["input_ids"]
        assert chat.encode_prompt([ChatTurn("user", "How many?", 2)]) == expected
    assert qwen3_vl.load_config(ckpt.t5).text.eos_token_id == (
        fast.convert_tokens_to_ids("<|im_end|>"),
    )


def test_both_layouts_load_the_same_model(ckpt: Qwen3Checkpoints) -> None:
    hub, t5 = qwen3_vl.load(ckpt.hub), qwen3_vl.load(ckpt.t5)
    assert hub.cfg.text.tie_word_embeddings is False  # stored lm_head, read as stored
    assert replace(hub.cfg, text=replace(hub.cfg.text, tie_word_embeddings=True)) == t5.cfg
    assert hub.cfg.preprocess.image_mean == (0.5, 0.5, 0.5)
    assert hub.cfg.text.head_dim == 32 and hub.cfg.num_deepstack == 2
    assert hub.encoder_digest() == t5.encoder_digest()
    for (name, a), (_, b) in zip(hub.state_dict().items(), t5.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _broken(ckpt: Qwen3Checkpoints, tmp_path: Path, change: Callable[[Path], None]) -> str:
    target = tmp_path / "broken"
    shutil.copytree(ckpt.t5, target)
    change(target)
    with pytest.raises(ModelConfigError) as info:
        qwen3_vl.load(target)
    message = str(info.value)
    assert "\n" not in message
    return message


def _edit(section: str | None, key: str, value: object) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        target = cfg if section is None else cfg[section]
        if value is None:
            target.pop(key)
        else:
            target[key] = value
        (path / "config.json").write_text(json.dumps(cfg))

    return change


def _drop_tensor(path: Path) -> None:
    state = load_file(path / "model.safetensors")
    state.pop("model.visual.deepstack_merger_list.1.norm.weight")
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (_edit(None, "vision_config", None), "vision_config is missing"),
        (_edit(None, "text_config", None), "text_config is missing"),
        (_edit(None, "model_type", "qwen2_5_vl"), "'qwen2_5_vl' is not one of ['qwen3_vl']"),
        (
            _edit("text_config", "rope_parameters", {"rope_type": "default", "mrope_section": [8]}),
            "mrope_section [8]",
        ),
        (_edit("text_config", "attention_bias", True), "attention_bias true"),
        (
            _edit("text_config", "intermediate_size", 96),
            "has shape (256, 64); the config implies (192, 64)",
        ),
        (_edit("text_config", "hidden_act", "gelu"), "text hidden_act 'gelu' is not silu"),
        (_edit("vision_config", "num_position_embeddings", 15), "15 is not a square"),
        (_edit("vision_config", "deepstack_visual_indexes", [0, 5]), "[0, 5] must name"),
        (_edit("vision_config", "out_hidden_size", 32), "out_hidden_size 32 != text"),
        (
            _drop_tensor,
            "lacks 1 tensor(s) the config implies, e.g. visual.deepstack_merger_list.1.norm",
        ),
        (lambda p: (p / "model.safetensors").unlink(), "no *.safetensors"),
        (lambda p: (p / "config.json").write_text("[]"), "config.json is not a JSON object"),
    ],
)
def test_malformed_checkpoint_is_one_line(
    ckpt: Qwen3Checkpoints, tmp_path: Path, change: Callable[[Path], None], words: str
) -> None:
    assert words in _broken(ckpt, tmp_path, change)


def _causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """A whole prompt's causal attention, built on the device (no host-made mask)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


def fake_cuda_prefill(model_dir: str, ids: list[int], shapes: list[list[int]]) -> None:
    """Runs in a child process (`test_a_prefill_runs_on_cuda_in_bf16`): FakeTensorMode runs the
    vision transformer, the deepstack inputs and a prefill through `forward_paged` with every
    weight a bf16 CUDA tensor. FakeTensorMode refuses a host tensor mixed into device work; the
    trace shows nothing computed on the device landing on the host."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.core.test_llm_device import CUDA, _fake_on_cuda, _getitem, _Trace

    cfg = qwen3_vl.load_config(Path(model_dir))
    with torch.device("meta"):
        model = qwen3_vl.Qwen3VL(cfg)
    # Python indexing of a fake CUDA tensor opens a device guard, which a torch without CUDA
    # cannot: test_llm_device's `_getitem` stands in. Setting `Tensor.__getitem__` cannot be
    # undone (0-d tensors stay sequences for `torch.tensor`), hence the child process.
    torch.Tensor.__getitem__ = _getitem  # type: ignore[method-assign,assignment]
    with FakeTensorMode(allow_non_fake_inputs=False), _Trace() as trace, torch.no_grad():
        _fake_on_cuda(model, torch.bfloat16)
        with torch.device(CUDA):
            model.reset_buffers()
        pixels = [torch.empty(shape, dtype=torch.uint8, device=CUDA) for shape in shapes]
        trace.recording = True
        encoded = [model.encode_visual(p) for p in pixels]
        feats = torch.cat([f for f, _ in encoded])
        positions, _ = model.prompt_positions(ids, [g for _, g in encoded])
        assert positions is not None
        extras = model.deepstack_inputs(ids, feats)
        rope = model.rope(positions.to(CUDA))
        x = model.embed(ids, feats)
        for layer, extra in zip(model.language_model.layers, extras, strict=True):
            x = layer.forward_paged(x, rope, _causal, _linear, extra)
        logits = model.lm_head(model.language_model.norm(x))
    assert logits.device.type == "cuda" and logits.dtype == torch.bfloat16
    # The image's 3 x 4 tokens and the video's 2 frame pairs of 2 x 2; 64 + 2 deepstack x 64.
    assert feats.shape == (12 + 2 * 4, 3 * 64)
    assert logits.shape == (len(ids), cfg.text.vocab_size)
    ops = trace.ops
    assert not [op for op, ins, made in ops if "cuda" in ins and any(m[0] != "cuda" for m in made)]
    print("fake cuda prefill ok", len(ops), "ops")


def test_a_prefill_runs_on_cuda_in_bf16(ckpt: Qwen3Checkpoints) -> None:
    """`fake_cuda_prefill` for the image-and-video prompt, in a child process."""
    case = _case(ckpt, CASES["image_and_video"])
    shapes = [list(p.shape) for p in case.pixels]
    out = run_in_child("tests.core.test_qwen3_vl.fake_cuda_prefill", str(ckpt.t5), case.ids, shapes)
    assert "fake cuda prefill ok" in out


def test_the_registry_serves_it_with_its_deepstack_rows(ckpt: Qwen3Checkpoints) -> None:
    """`load_model` picks Qwen3-VL by model_type; `encode_item` keeps the deepstack columns
    (the cache stores them) and ranks tokens by their first `hidden` columns; `deepstack_rows`
    maps each visual token, in order, to its row of those columns, and text tokens to -1."""
    model = load_model(ckpt.t5)
    assert isinstance(model, qwen3_vl.Qwen3VL) and isinstance(model, DeepstackModel)
    case = _case(ckpt, CASES["one_image"])
    hidden, image = model.cfg.text.hidden_size, model.cfg.image_token_id
    with torch.no_grad():
        feats, importance = model.encode_item(case.pixels[0])
        expected, _ = model.encode_visual(case.pixels[0])
    assert torch.equal(feats, expected) and feats.shape == (35, 3 * hidden)
    assert torch.equal(importance, feats[:, :hidden].norm(dim=-1))
    found = model.deepstack_rows(case.ids, feats)
    assert found is not None
    rows, table = found
    visual = [i for i, t in enumerate(case.ids) if t == image]
    assert rows[visual].tolist() == list(range(35))
    assert (rows[[i for i, t in enumerate(case.ids) if t != image]] == -1).all()
    assert torch.equal(table, feats[:, hidden:])
    assert model.deepstack_rows([1, 2, 3], None) is None
    with pytest.raises(ValueError, match="35 visual tokens but 34 feature rows"):
        model.deepstack_rows(case.ids, feats[:34])

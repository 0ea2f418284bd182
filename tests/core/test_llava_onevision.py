"""LLaVA-OneVision as a family of the core: a tiny random-weight checkpoint saved by transformers'
own classes, in both layouts, loaded by `core.model.llava_onevision.load` and run through the
layers' `forward_paged` with a dense attention (tests/core/test_qwen_vl.py); prompt ids, logits
and greedy tokens against transformers' `LlavaOnevisionForConditionalGeneration` fed by its own
processor, for a lone image (a multi-tile grid, unpadded and downscaled) and for two images (one
padded view each); the feature layout (`arrange`) against transformers' `pack_image_features`
over many image sizes and grids; admission's count (`shared.preprocess`) against the processor's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from core.model import family, llava_onevision
from core.model.config import ModelConfigError
from core.model.preprocessing import rule_for
from core.model.tokenizer import ChatTokenizer, ChatTurn
from gateway import decode
from gateway.config import LimitsConfig
from gateway.pipeline import decode_spec, plan_media
from gateway.sniff import sniff
from shared.preprocess import PreprocessRule, anyres_grid_size, best_pinpoint
from tests.core.test_qwen_vl import DenseAttention, _linear
from tests.gateway.test_preprocess_rules import GENERATED, Worker, _to_uint8, _upright
from tests.gateway.test_preprocess_rules import _check as _check_pixels
from tests.onevision_checkpoint import (
    ASPECT,
    PINPOINTS,
    SIZE,
    TOKENS,
    OnevisionCheckpoint,
    build_onevision,
)

transformers = pytest.importorskip("transformers")
ATOL = 1e-4  # float32 on both sides
QUESTION = "What colour is the circle?"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> OnevisionCheckpoint:
    return build_onevision(tmp_path_factory.mktemp("onevision"))


def _image(seed: int, width: int, height: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _hf_inputs(ck: OnevisionCheckpoint, images: list[np.ndarray]) -> dict[str, Any]:
    """What LlavaOnevisionProcessor makes of one prompt showing `images`: the template rendered
    by transformers' tokenizer, each `<image>` repeated to the processor's count, and the image
    processor's pixels for one sample of that many images."""
    content: list[dict[str, str]] = [{"type": "image"} for _ in images]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}]
    prompt = ck.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = dict(ck.image_processor([images], return_tensors="pt"))
    image_id = ck.tokenizer.convert_tokens_to_ids("<image>")
    counts = iter(
        ck.num_image_tokens(int(h), int(w), len(images) == 1) for h, w in out["image_sizes"]
    )
    ids = [i for t in prompt for i in ([t] * next(counts) if t == image_id else [t])]
    out["input_ids"] = torch.tensor([ids])
    return out


def _item_tokens(model: llava_onevision.LlavaOnevision, views: int, w: int, h: int) -> int:
    """Admission's count of an item: one view, or the base tile and the arranged grid."""
    if views == 1:
        return TOKENS + 1
    ph, pw = best_pinpoint(w, h, model.pinpoints)
    side = int(TOKENS**0.5)
    _, (out_h, out_w) = anyres_grid_size(ph // SIZE, pw // SIZE, side, w, h, model.anyres_max)
    return TOKENS + out_h * (out_w + 1)


def _run(
    model: llava_onevision.LlavaOnevision, embeds: torch.Tensor, start: int, kv: DenseAttention
) -> torch.Tensor:
    rope = model.rope(torch.arange(start, start + embeds.shape[0]))
    x = embeds
    for i, layer in enumerate(model.language_model.layers):
        x = layer.forward_paged(x, rope, kv.layer(i), _linear)
    return model.lm_head(model.language_model.norm(x))


def _check(ck: OnevisionCheckpoint, model_dir: Path, images: list[np.ndarray]) -> None:
    model = family.load_model(model_dir)
    assert isinstance(model, llava_onevision.LlavaOnevision)
    hf_in = _hf_inputs(ck, images)
    # The prompt: our template rendering and expansion give the processor's ids.
    chat = ChatTokenizer(model_dir, model.cfg.image_token_id)
    prompt = chat.encode_prompt([ChatTurn("user", QUESTION, len(images))])
    pixels = hf_in["pixel_values"][0]  # (views, 3, S, S) per image, padded to the most views
    lone = len(images) == 1
    per_item = []
    with torch.no_grad():
        for i, image in enumerate(images):
            h, w = image.shape[:2]
            views = pixels.shape[0] if lone else 1
            ph, pw = best_pinpoint(w, h, model.pinpoints) if lone else (SIZE, SIZE)
            feats = model.encode_images(hf_in["pixel_values"][i][:views])
            arranged = model.arrange(feats, ph // SIZE, pw // SIZE, w, h)
            assert arranged.shape[0] == _item_tokens(model, views, w, h)
            per_item.append(arranged)
    ids = chat.expand(prompt, [f.shape[0] for f in per_item])
    assert ids == hf_in["input_ids"][0].tolist()
    hf_args = {k: hf_in[k] for k in ("pixel_values", "image_sizes", "batch_num_images")}
    with torch.no_grad():
        ref = ck.hf(input_ids=hf_in["input_ids"], **hf_args).logits[0]
        kv = DenseAttention(model.cfg.text.num_layers)
        logits = _run(model, model.embed(ids, torch.cat(per_item)), 0, kv)
        diff = (logits - ref).abs().max().item()
        print(f"{model_dir.name} {len(images)} image(s): max abs logit difference {diff:.2e}")
        assert diff <= ATOL
        out = ck.hf.generate(
            input_ids=hf_in["input_ids"], **hf_args, max_new_tokens=8, do_sample=False
        )[0, len(ids) :].tolist()
        tokens, last = [], logits[-1]
        for _ in range(8):
            tokens.append(int(last.argmax()))
            embed = model.embed([tokens[-1]], None)
            last = _run(model, embed, len(ids) + len(tokens) - 1, kv)[-1]
    assert tokens == out


@pytest.mark.parametrize("layout", ["hub", "t5"])
def test_lone_image_grid_matches_transformers(ckpt: OnevisionCheckpoint, layout: str) -> None:
    # 150 x 100 picks a 2 x 3 grid... of 3 x 3 tiles at most: unpadded and downscaled.
    _check(ckpt, getattr(ckpt, layout), [_image(1, 150, 100)])


def test_two_images_one_view_each_match_transformers(ckpt: OnevisionCheckpoint) -> None:
    _check(ckpt, ckpt.t5, [_image(2, 90, 60), _image(3, 40, 70)])


@pytest.mark.parametrize(
    ("width", "height"),
    [(150, 100), (100, 150), (56, 56), (300, 40), (40, 300), (113, 57), (57, 113), (500, 490)],
)
def test_arrange_matches_pack_image_features(
    ckpt: OnevisionCheckpoint, width: int, height: int
) -> None:
    model = family.load_model(ckpt.t5)
    assert isinstance(model, llava_onevision.LlavaOnevision)
    ph, pw = best_pinpoint(width, height, model.pinpoints)
    views = (ph // SIZE) * (pw // SIZE) + 1
    feats = torch.randn(views, TOKENS, model.cfg.text.hidden_size, generator=torch.Generator())
    with torch.no_grad():
        ours = model.arrange(feats, ph // SIZE, pw // SIZE, width, height)
        theirs, lens = ckpt.hf.model.pack_image_features(
            [feats], torch.tensor([[height, width]]), ckpt.hf.model.image_newline, ASPECT
        )
    assert ours.shape == theirs[0].shape
    assert torch.equal(ours, theirs[0])
    assert int(lens[0]) == _item_tokens(model, views, width, height)


def test_best_pinpoint_is_select_best_resolution() -> None:
    from transformers.image_processing_utils import select_best_resolution

    points = tuple((h, w) for h, w in PINPOINTS)
    for width in range(20, 400, 17):
        for height in range(20, 400, 23):
            want = select_best_resolution((height, width), PINPOINTS)
            assert best_pinpoint(width, height, points) == tuple(want)


def test_refusals_name_the_key(ckpt: OnevisionCheckpoint, tmp_path: Path) -> None:
    def broken(change: dict[str, Any]) -> str:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(ckpt.t5, out)
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(change)
        (out / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelConfigError) as err:
            family.load_model(out)
        return str(err.value)

    assert "vision_aspect_ratio" in broken({"vision_aspect_ratio": "pad"})
    assert "image_grid_pinpoints" in broken({"image_grid_pinpoints": [[56, 60]]})
    assert "image_grid_pinpoints" in broken({"image_grid_pinpoints": "big"})
    text = json.loads((ckpt.t5 / "config.json").read_text())["text_config"]
    assert "lacks" in broken({"text_config": {**text, "num_hidden_layers": 3}})


# ---- the gateway's pixels against LlavaOnevisionImageProcessorPil -----------------------------

PIXEL_CASES = [
    "odd-png-641x479",
    "tall-jpeg-37x1001",
    "alpha-png-300x200",
    "jpeg-777x555 (two crops)",
]
PIXEL_CASES += ["webp-1200x400 (pan and scan)", "tiny-png-20x30 (min_pixels)"]
WIDE_LIMITS = LimitsConfig(max_tiles=36)  # every one of the default pinpoints may be chosen


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


def _hub_rule(tmp: Path) -> tuple[PreprocessRule, Any]:
    """A Hub OneVision checkpoint's rule (SigLIP at 384 px, the default 36 pinpoints, mean and
    std 0.5), read by `rule_for` from the configs the processor and model save."""
    processor = transformers.LlavaOnevisionImageProcessorPil(
        image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps({"model_type": "llava_onevision"}))
    return rule_for(tmp, "llava_onevision"), processor


def _views(worker: Worker, data: bytes, rule: PreprocessRule, detail: str) -> np.ndarray:
    fmt = sniff(data)
    lim = WIDE_LIMITS
    probe_args = {"fmt": fmt, "max_pixels": lim.max_pixels, "max_side": lim.max_side}
    body = worker.run("probe", {**probe_args, "max_frames": 1}, data).body
    probe = decode.Probe(int(body["width"]), int(body["height"]), 1)
    plan = plan_media(0, probe, False, detail, rule, lim)
    spec = decode_spec(fmt, plan.grid, (0,), rule, (0, 0, 0), lim)
    (array,) = worker.run("decode", spec.to_json(), data).arrays
    assert array.shape == rule.item_shape(plan.grid.rows, plan.grid.cols)
    return np.asarray(array)


@pytest.mark.parametrize("name", PIXEL_CASES)
def test_gateway_pixels_match_the_processor(worker: Worker, tmp_path: Path, name: str) -> None:
    rule, processor = _hub_rule(tmp_path)
    assert rule.kind == "tiles" and rule.tokens_per_tile == 729 and len(rule.canvases) == 36
    data = GENERATED[name]()
    img = _upright(data)
    # A lone image at detail=high: the whole image squashed, then the best canvas's tiles.
    lone = processor([img])["pixel_values"][0]
    want = np.stack([_to_uint8(np.asarray(v), processor) for v in lone])
    got = _views(worker, data, rule, "high")
    if want.shape[0] == 2:  # the processor's 1 x 1 grid: the gateway sends one padded view
        assert got.shape[0] == 1
    else:
        _check_pixels(got, want, name)
    # One image among several (detail=low): padded to a square with the mean, resized.
    many = processor([[img, img]])["pixel_values"][0]
    want = _to_uint8(np.asarray(many[0]), processor)[None]
    _check_pixels(_views(worker, data, rule, "low"), want, name)

"""LLaVA-OneVision served end to end: the tiny random-weight checkpoint of
tests/onevision_checkpoint.py behind a real core and a real gateway; real PNG / JPEG files go
through the gateway's sandboxed workers (laid out per the core's anyres rule) and the answer is
compared with transformers' greedy generation on its own processor's pixels for the same file:
the same 8 tokens (text), and the logprob of each within 1e-3.

A lone image at detail=high is the processor's lone-image layout (the whole image, then a grid
of tiles, unpadded and downscaled by the model); images at detail=low are one padded view each,
the processor's layout for several images. A repeat is a cache hit; a compression profile and a
video are refused."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from PIL import Image

from shared.proto import gateway_pb2
from tests.conftest import Stack, start_stack, stop_stack
from tests.integration.test_families_e2e import (
    Reference,
    _ask,
    _check,
    _generate,
    _messages,
    _picture,
)
from tests.onevision_checkpoint import OnevisionCheckpoint, build_onevision

transformers = pytest.importorskip("transformers")


@dataclass
class Served:
    stack: Stack
    ck: OnevisionCheckpoint


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("onevision")
    ck = build_onevision(root)
    (root / "logs").mkdir()
    # 9 grid cells: the checkpoint's largest pinpoint (3 x 3 tiles) may be chosen.
    stack = start_stack(ck.t5, root / "logs", VISOR_LIMITS_MAX_TILES="9")
    yield Served(stack, ck)
    stop_stack(stack)


def _reference(ck: OnevisionCheckpoint, media: list[bytes]) -> Reference:
    """transformers on its processor's pixels: one image alone, or several (one view each)."""
    images = [Image.open(io.BytesIO(m)) for m in media]
    pixels = ck.image_processor([images], return_tensors="pt")
    prompt = ck.tokenizer.apply_chat_template(
        _messages(len(media)), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    image_id = ck.hf.config.image_token_id
    counts = iter(
        ck.num_image_tokens(int(h), int(w), len(media) == 1) for h, w in pixels["image_sizes"]
    )
    ids = [i for t in prompt for i in ([t] * next(counts) if t == image_id else [t])]
    input_ids = torch.tensor([ids])
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        **{k: pixels[k] for k in ("pixel_values", "image_sizes", "batch_num_images")},
    }
    return _generate(ck.hf, ck.tokenizer, inputs)


WIDE = _picture(150, 100, 1, "PNG")  # a 3 x 3 grid, unpadded to 8 x 12 tokens, downscaled
TALL = _picture(60, 130, 2, "JPEG")  # a 3 x 1 grid


@pytest.mark.parametrize("picture", [WIDE, TALL], ids=["wide", "tall"])
def test_lone_image_at_high_detail_matches_transformers(served: Served, picture: bytes) -> None:
    answer = _ask(served.stack, [picture])
    assert answer.final.usage.visual_tokens_after > 2 * 16  # a grid, not one view
    _check(answer, _reference(served.ck, [picture]), "onevision one image")


def test_images_at_low_detail_match_transformers_several_images(served: Served) -> None:
    media = [WIDE, TALL]
    answer = _ask(served.stack, media, detail=gateway_pb2.DETAIL_LOW)
    assert answer.final.usage.visual_tokens_after == 2 * (16 + 1)  # a view and a newline each
    _check(answer, _reference(served.ck, media), "onevision two images")


def test_a_repeat_is_served_from_the_cache(served: Served) -> None:
    picture = _picture(120, 90, 3, "PNG")
    first = _ask(served.stack, [picture]).final
    again = _ask(served.stack, [picture]).final
    assert not first.cache[0].hit and again.cache[0].hit
    assert "encode" in first.timings_ms and "encode" not in again.timings_ms
    assert "arrange" in again.timings_ms and again.text == first.text


def test_a_compression_profile_is_refused(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _ask(served.stack, [WIDE], "balanced")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "profile" in (err.value.details() or "")

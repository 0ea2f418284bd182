"""`detail` and `max_visual_tokens` through a real gateway and core serving a native (Qwen2.5-VL)
and a fixed (Gemma 3) checkpoint: the size or views the gateway declares, counted by the core as
`visual_tokens_before`, follow the level and the question's intent, and the request's bound
holds; the core admits every one of them (a refusal would fail the request).

Sizes: Qwen's processor allows 4..64 merged tokens per image (a 224 px square is 8 x 8 at
`high`); Gemma's views are 224 px with 16 tokens each, pan and scan making three crops of a
400 x 130 image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shared.proto import gateway_pb2
from tests.conftest import Stack, start_stack, stop_stack
from tests.family_checkpoints import build_gemma, build_qwen
from tests.helpers import generate, request
from tests.integration.test_families_e2e import PAN_AND_SCAN, _picture

pytest.importorskip("transformers")
AUTO, LOW, HIGH = gateway_pb2.DETAIL_AUTO, gateway_pb2.DETAIL_LOW, gateway_pb2.DETAIL_HIGH
READING, COLOUR, OTHER = "What number is written here?", "What colour is the circle?", "Why?"
SQUARE = _picture(224, 224, 4, "PNG")
WIDE = _picture(400, 130, 5, "JPEG")


def _stack(root: Path, model: Path) -> Stack:
    (root / "logs").mkdir()
    return start_stack(model, root / "logs")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("qwen-detail")
    build_qwen(root, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64})
    stack = _stack(root, root / "t5")
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("gemma-detail")
    build_gemma(root / "model", **PAN_AND_SCAN)
    stack = _stack(root, root / "model")
    yield stack
    stop_stack(stack)


def _tokens(stack: Stack, image: bytes, prompt: str, detail: int, bound: int = 0) -> int:
    req = request(prompt, (image,), max_new_tokens=2)
    req.detail = detail  # type: ignore[assignment]
    req.max_visual_tokens = bound
    out = generate(stack.gateway, req)
    assert out.code == grpc.StatusCode.OK and out.final is not None, (out.code, out.message)
    return int(out.final.usage.visual_tokens_before)


def test_native_budget_follows_the_level_and_the_question(qwen: Stack) -> None:
    assert _tokens(qwen, SQUARE, COLOUR, HIGH) == 64  # the rule's max_pixels
    assert _tokens(qwen, SQUARE, READING, AUTO) == 64  # fine: as much as high
    assert _tokens(qwen, SQUARE, OTHER, AUTO) == 16  # general: half of each side
    assert _tokens(qwen, SQUARE, COLOUR, AUTO) == 4  # coarse: a quarter, here min_pixels
    assert _tokens(qwen, SQUARE, READING, LOW) == 4


def test_native_max_visual_tokens_bounds_every_level(qwen: Stack) -> None:
    assert _tokens(qwen, SQUARE, READING, AUTO, 10) == 9  # 3 x 3: the largest square within
    assert _tokens(qwen, SQUARE, COLOUR, HIGH, 40) == 36
    assert _tokens(qwen, SQUARE, OTHER, AUTO, 40) == 16  # the level is tighter
    assert _tokens(qwen, SQUARE, READING, HIGH, 1) == 4  # min_pixels is the floor
    assert _tokens(qwen, WIDE, READING, HIGH, 20) <= 20


def test_fixed_views_follow_the_level_and_the_bound(gemma: Stack) -> None:
    whole, crops = 16, 3 * 16
    assert _tokens(gemma, WIDE, COLOUR, HIGH) == whole + crops
    assert _tokens(gemma, WIDE, READING, AUTO) == whole + crops
    assert _tokens(gemma, WIDE, COLOUR, AUTO) == whole
    assert _tokens(gemma, WIDE, OTHER, AUTO) == whole
    assert _tokens(gemma, WIDE, READING, LOW) == whole
    assert _tokens(gemma, WIDE, READING, HIGH, 48) == 48  # the whole image and two crops
    assert _tokens(gemma, WIDE, READING, HIGH, 40) == whole  # no room for two crops

"""`detail=auto` and `max_visual_tokens` through a real gateway and core: the grid the gateway
declares (the core's `visual_tokens_before` counts its tiles) follows the question's intent and
shrinks under the request's bound."""

from __future__ import annotations

import grpc

from bench.quality import suite
from shared.proto import gateway_pb2
from tests.conftest import Stack
from tests.helpers import generate, request

PER_TILE = 64  # the demo encoder's tokens per tile (8 x 8 patches of 28 px)


def _tokens(stack: Stack, prompt: str, detail: int, max_visual_tokens: int = 0) -> int:
    image = suite.item(suite.Split.EVAL, 0, 0, "fine_detail").png()  # 448 x 448: a 2 x 2 grid
    req = request(prompt, (image,), max_new_tokens=2)
    req.detail = detail  # type: ignore[assignment]
    req.max_visual_tokens = max_visual_tokens
    out = generate(stack.gateway, req)
    assert out.code == grpc.StatusCode.OK and out.final is not None, (out.code, out.message)
    return int(out.final.usage.visual_tokens_before)


def test_auto_reads_the_question_and_max_visual_tokens_bounds_the_grid(stack: Stack) -> None:
    auto, high, low = gateway_pb2.DETAIL_AUTO, gateway_pb2.DETAIL_HIGH, gateway_pb2.DETAIL_LOW
    grid = 5 * PER_TILE  # thumbnail + 2 x 2 cells
    assert _tokens(stack, "What small number is written?", high) == grid
    assert _tokens(stack, "What small number is written?", auto) == grid
    assert _tokens(stack, "What colour is the background?", auto) == PER_TILE
    assert _tokens(stack, "What small number is written?", low) == PER_TILE
    # The request's bound: four tiles' worth leaves no room for a 2 x 2 grid and its thumbnail;
    # the image stays one tile for either level (a 1 x 2 grid keeps no more of a square image).
    bound = 4 * PER_TILE
    assert _tokens(stack, "What small number is written?", high, bound) == PER_TILE
    assert _tokens(stack, "What small number is written?", auto, bound) == PER_TILE
    assert _tokens(stack, "What small number is written?", high, grid) == grid  # exactly fits

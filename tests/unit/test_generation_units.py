"""Sampling and streaming text with stop strings."""

from __future__ import annotations

import torch

from core.generate import TextStream, sample
from core.types import SamplingParams


def _decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_stop_string_is_held_back_and_cut() -> None:
    stream = TextStream(_decode, ("END",))
    out = [stream.push(ord(c)) for c in "abcEN"]
    assert "".join(out) == "abc"  # "EN" may start "END": held back
    assert stream.push(ord("D")) == "" and stream.stopped
    assert stream.text == "abc"


def test_false_stop_prefix_is_released() -> None:
    stream = TextStream(_decode, ("END",))
    emitted = "".join(stream.push(ord(c)) for c in "aENx")
    assert emitted + stream.flush() == "aENx" and not stream.stopped


def test_sampling() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(max_new_tokens=1), gen) == 1
    top1 = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=1)
    assert {sample(logits, top1, gen) for _ in range(20)} == {1}
    nucleus = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.5)
    assert {sample(logits, nucleus, gen) for _ in range(20)} == {1}
    wide = SamplingParams(max_new_tokens=1, temperature=5.0, seed=3)
    a = [sample(logits, wide, torch.Generator().manual_seed(3)) for _ in range(5)]
    b = [sample(logits, wide, torch.Generator().manual_seed(3)) for _ in range(5)]
    assert a == b
    assert len({sample(logits, wide, gen) for _ in range(200)}) == 4

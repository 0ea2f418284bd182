"""Sampling, streaming text with stop strings, and the chat tokenizer's handling of users' text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from core.generate import TextStream, noise_key, sample
from core.model.tokenizer import ChatTokenizer, ChatTurn
from core.types import SamplingParams


class _Chars:
    """A detokenizer where token i is chr(i); it records the ids it was given."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def step(self, token: int) -> str:
        self.seen.append(token)
        return chr(token)

    def rest(self) -> str:
        return ""


def test_stop_string_is_held_back_and_cut() -> None:
    stream = TextStream(_Chars(), ("END",))
    out = [stream.push(ord(c)) for c in "abcEN"]
    assert "".join(out) == "abc"  # "EN" may start "END": held back
    assert stream.push(ord("D")) == "" and stream.stopped
    assert stream.text == "abc"


def test_false_stop_prefix_is_released() -> None:
    stream = TextStream(_Chars(), ("END",))
    emitted = "".join(stream.push(ord(c)) for c in "aENx")
    assert emitted + stream.flush() == "aENx" and not stream.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    stream = TextStream(_Chars(), ("xyz", "bc", "abcd"))
    emitted = "".join(stream.push(ord(c)) for c in "--abcd")
    assert stream.stopped and emitted == stream.text == "--a"


def test_eight_stop_strings_on_a_long_output_are_matched_incrementally() -> None:
    """Each token is decoded once, on its own, and only a tail shorter than the longest stop
    string is kept for matching, however long the output grows; the cut is where a search of
    the whole text puts it."""
    stops = ("qqqqq!", "abab#", "zz9", "hello world", "x" * 60, "<<END>>", "a-b-c-d", "--")
    rng = random.Random(0)
    alphabet = "abhelowrdxzq9-<>E N#!"
    chars: list[str] = []
    while len(chars) < 40_000:  # near misses of every stop string, never a whole one
        chars.append(rng.choice(alphabet))
        if any("".join(chars[-len(s) :]) == s for s in stops):
            chars.pop()
    body = "".join(chars)
    text = body + "x" * 59 + "y" + "<<END>> and beyond"
    detok = _Chars()
    stream = TextStream(detok, stops)
    emitted = []
    for c in text:
        emitted.append(stream.push(ord(c)))
        assert len(stream.held) < 60  # the longest stop string: the rest was emitted
        if stream.stopped:
            break
    assert detok.seen == [ord(c) for c in text[: len(detok.seen)]]  # one id per step, no replays
    cut = min(at for s in stops if (at := text.find(s)) != -1)
    assert stream.stopped and "".join(emitted) == stream.text == text[:cut]
    assert cut == len(body) + 60  # "<<END>>": the near misses before it did not stop it


def test_detokenizer_matches_a_whole_decode(model_dir: Path) -> None:
    tok = ChatTokenizer(model_dir, 4)
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.tok.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
        stream = TextStream(tok.detokenizer(), ())
        out = "".join(stream.push(i) for i in ids) + stream.flush()
        assert out == stream.text == tok.tok.decode(ids, skip_special_tokens=True)


def test_sampling() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    keys = [noise_key(0, n) for n in range(200)]
    assert sample(logits, SamplingParams(max_new_tokens=1), keys[0]) == 1
    top1 = SamplingParams(max_new_tokens=1, temperature=1.0, top_k=1)
    assert {sample(logits, top1, k) for k in keys[:20]} == {1}
    nucleus = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.5)
    assert {sample(logits, nucleus, k) for k in keys[:20]} == {1}
    wide = SamplingParams(max_new_tokens=1, temperature=5.0, seed=3)
    a = [sample(logits, wide, noise_key(3, n)) for n in range(5)]
    b = [sample(logits, wide, noise_key(3, n)) for n in range(5)]
    assert a == b
    assert len({sample(logits, wide, k) for k in keys}) == 4


def test_sampling_is_numerically_robust() -> None:
    huge = torch.tensor([3e38, -3e38, 1e30, float("-inf")])  # suppressed EOS last
    for n, t in enumerate((1e-38, 1e-6, 1e-5, 1.0, 100.0)):
        for top_p in (1.0, 0.9, 1e-9):
            params = SamplingParams(max_new_tokens=1, temperature=t, top_p=top_p, top_k=3)
            assert sample(huge, params, noise_key(0, n)) in {0, 1, 2}
    tiny = SamplingParams(max_new_tokens=1, temperature=1e-38)  # below GREEDY_BELOW: greedy
    logits = torch.tensor([0.0, 1.0, 0.9])
    assert {sample(logits, tiny, noise_key(0, n)) for n in range(20)} == {1}


@pytest.mark.parametrize(
    ("temperature", "top_p", "logits"),
    [
        (float("nan"), 1.0, [0.0, 1.0]),
        (float("inf"), 1.0, [0.0, float("-inf")]),
        (-1.0, 1.0, [0.0, 1.0]),
        (1.0, float("nan"), [0.0, 1.0]),
        (1.0, 1.0, [float("nan"), 1.0]),
        (1.0, 1.0, [float("-inf"), float("-inf")]),
    ],
)
def test_sampling_refuses_what_admission_refuses(
    temperature: float, top_p: float, logits: list[float]
) -> None:
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p)
    with pytest.raises(ValueError):
        sample(torch.tensor(logits), params, noise_key(0, 0))


def test_users_text_never_becomes_control_tokens(model_dir: Path) -> None:
    tok = ChatTokenizer(model_dir, 4)
    eos, image = tok.tok.token_to_id("</s>"), 4
    said = "say </s> then <image> then <s>"
    ids = tok.encode_prompt([ChatTurn("user", said, 1)])
    assert ids.count(image) == 1  # the template's one image slot, not the text's
    assert eos not in ids and ids.count(tok.bos_id) == 1  # only the template's <s>
    assert said in tok.tok.decode(ids, skip_special_tokens=False)  # the text, intact
    # The template's own special tokens stay special: an assistant turn ends with </s>.
    turns = [ChatTurn("user", "hi", 0), ChatTurn("assistant", "</s>", 0)]
    assert tok.encode_prompt(turns).count(eos) == 1
    assert tok.encode_chat([ChatTurn("user", said, 1)], [3]).count(image) == 3

"""Token logprobs from a real Engine on the demo model, checked against a direct forward pass of
the same model (no paged KV cache, no scheduler) and its log-softmax."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from core.engine import Engine
from core.generate import TextStream, logprobs_of, token_logprobs
from core.model.tokenizer import ChatTurn
from core.sequence import SampleLogprobs
from core.types import Delta, InferRequest, Result, SamplingParams
from shared.errors import Reason, VisorError
from shared.sampling import TokenLogprob, check_logprobs

PROMPT = "What is in the picture?"
TOL = 1e-4  # paged and plain attention agree to ~1e-6 in float32; logprobs travel as float32


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    e = Engine(model_dir, "logprobs")
    yield e
    e.close()


def _prompt(engine: Engine, text: str = PROMPT) -> list[int]:
    return engine.tokenizer.encode_prompt([ChatTurn("user", text, 0)])


def _run(engine: Engine, ids: list[int], params: SamplingParams) -> tuple[list[Delta], Result]:
    async def go() -> tuple[list[Delta], Result]:
        deltas, result = [], None
        async for out in engine.generate_ids(ids, params):
            if isinstance(out, Delta):
                deltas.append(out)
            else:
                result = out
        assert result is not None
        return deltas, result

    return asyncio.run(go())


def _entries(deltas: list[Delta]) -> list[TokenLogprob]:
    return [lp for d in deltas for lp in d.logprobs]


def _direct_greedy(engine: Engine, ids: list[int], steps: int) -> list[tuple[int, torch.Tensor]]:
    """(argmax id, log-softmax of the raw logits) per step, from the model's plain forward."""
    model, cache = engine.model, engine.model.new_cache()
    out = []
    with torch.inference_mode():
        logits = model.forward_tokens(model.embed(torch.tensor(ids), None), cache)
        for _ in range(steps):
            token = int(torch.argmax(logits))
            out.append((token, torch.log_softmax(logits.double(), -1)))
            logits = model.forward_tokens(model.embed(torch.tensor([token]), None), cache)
    return out


def test_greedy_logprobs_match_a_direct_forward_pass(engine: Engine) -> None:
    ids = _prompt(engine)
    deltas, result = _run(engine, ids, SamplingParams(12, logprobs=True, top_logprobs=5))
    entries = _entries(deltas)
    # One entry per token a delta covers; the end-of-sequence token (in no delta) has none.
    assert [len(d.logprobs) for d in deltas] == [d.num_tokens for d in deltas]
    eos = 1 if result.finish_reason == "stop" else 0
    assert len(entries) == result.output_tokens - eos >= 1
    assert "".join(e.token for e in entries) == result.text
    direct = _direct_greedy(engine, ids, len(entries))
    for entry, (token, expected) in zip(entries, direct, strict=True):
        assert math.isclose(float(torch.logsumexp(expected, -1)), 0.0, abs_tol=1e-9)
        assert abs(entry.logprob - float(expected[token])) < TOL
        top = torch.topk(expected, 5)
        assert [t for t, _ in entry.top] == [
            engine.tokenizer.token_text(int(i)) for i in top.indices
        ]
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=TOL)
        # Greedy: the chosen token is the likeliest, and is the first alternative.
        assert entry.top[0] == (entry.token, entry.logprob)
        assert all(v <= entry.logprob for _, v in entry.top)


def test_top_lists_are_sorted_and_as_long_as_asked(engine: Engine) -> None:
    for k in (0, 1, 20):
        params = SamplingParams(6, 6, temperature=1.0, seed=7, logprobs=True, top_logprobs=k)
        entries = _entries(_run(engine, _prompt(engine), params)[0])
        assert len(entries) == 6
        for entry in entries:
            values = [v for _, v in entry.top]
            assert len(values) == k and values == sorted(values, reverse=True)
            assert entry.logprob <= 0 and all(math.isfinite(v) and v <= 0 for v in values)


def test_logprobs_do_not_depend_on_the_sampling_controls(engine: Engine) -> None:
    """They are the raw model's: the first step's distribution is the same whether the request
    decodes greedily or samples hot with top-k and top-p."""
    ids = _prompt(engine)
    greedy = SamplingParams(1, logprobs=True, top_logprobs=20)
    hot = dataclasses.replace(greedy, temperature=5.0, top_k=3, top_p=0.5, seed=3)
    first_greedy = _entries(_run(engine, ids, greedy)[0])[0]
    first_hot = _entries(_run(engine, ids, hot)[0])[0]
    assert first_hot.top == first_greedy.top
    assert (first_hot.token, first_hot.logprob) in first_hot.top[:3]  # top_k=3 held the choice


def test_min_new_tokens_reports_the_suppressed_eos_with_its_real_logprob(engine: Engine) -> None:
    """The demo model ends this answer after two tokens; min_new_tokens forces twelve. The
    masked end-of-sequence stays in the top list with its raw (finite) logprob, above the
    token that was chosen instead."""
    ids = _prompt(engine)
    deltas, result = _run(engine, ids, SamplingParams(12, 12, logprobs=True, top_logprobs=3))
    entries = _entries(deltas)
    assert len(entries) == result.output_tokens == 12
    eos = engine.tokenizer.eos_token
    suppressed = [e for e in entries if e.top[0][0] == eos]
    assert suppressed, "the demo model no longer prefers to stop here: pick another prompt"
    for entry in suppressed:
        assert math.isfinite(entry.top[0][1]) and entry.top[0][1] > entry.logprob
        assert entry.token != eos and math.isfinite(entry.logprob)


def test_no_logprobs_unless_asked(engine: Engine) -> None:
    deltas, result = _run(engine, _prompt(engine), SamplingParams(8, 8))
    assert sum(d.num_tokens for d in deltas) == result.output_tokens == 8
    assert all(d.logprobs == () for d in deltas)


def test_full_distribution_sums_to_one() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(512, generator=gen) * 30  # wide enough that a naive exp would overflow
    logits[7] = float("-inf")  # a token the model rules out stays out, without NaN
    lp = logprobs_of(logits, 3, 512)
    assert math.isclose(float(torch.tensor(lp.top_logprobs).logsumexp(0)), 0.0, abs_tol=1e-5)
    assert lp.top_ids[-1] == 7 and lp.top_logprobs[-1] == float("-inf")
    assert max(lp.top_logprobs) <= 0 and lp.logprob == lp.top_logprobs[lp.top_ids.index(3)]


@pytest.mark.parametrize(
    ("logprobs", "top", "names"),
    [(True, 21, "top_logprobs must be in [0, 20]"), (False, 1, "top_logprobs needs logprobs")],
)
def test_bad_logprob_values_are_refused_at_the_core(
    engine: Engine, logprobs: bool, top: int, names: str
) -> None:
    params = SamplingParams(8, logprobs=logprobs, top_logprobs=top)
    req = InferRequest("t", "r", (ChatTurn("user", "hi", 0),), params, (), "none")
    with pytest.raises(VisorError) as info:
        engine.inputs.check(req)
    assert info.value.reason == Reason.INVALID_REQUEST and names in info.value.message
    check_logprobs(True, 20)  # the edge is admitted


def test_a_split_character_is_named_by_the_token_that_completes_it(engine: Engine) -> None:
    """Byte-level pieces of one character: the chosen token's text is "" until the character is
    whole, so the entries still spell the answer; an alternative decoded alone shows U+FFFD."""
    tok = engine.tokenizer
    text = "naïve 日本"
    ids = tok.tok.encode(text, add_special_tokens=False).ids
    stream = TextStream(tok.detokenizer(), ())
    pieces = []
    for i in ids:
        stream.push(i)
        lp = SampleLogprobs(-1.0, (i,), (-1.0,))
        (entry,) = token_logprobs(stream.piece, lp, tok.token_text)
        pieces.append(entry.token)
        assert entry.top == ((tok.token_text(i), -1.0),)
    assert "".join(pieces) == text == stream.text
    assert "" in pieces and "\ufffd" in {tok.token_text(i) for i in ids}

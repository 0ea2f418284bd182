"""Structured output in a real Engine on the demo model: the compiler and its cache, the mask the
runner applies (only to the constrained rows of a step), the end of generation when the grammar
is complete, min_new_tokens against a complete grammar, and the matchers the runner frees."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import llguidance
import pytest
import torch

from core.engine import Engine
from core.model.tokenizer import ChatTurn
from core.structured import GrammarCompiler, MaskedRow, TokenMasks, unpack
from core.types import Delta, InferRequest, Result, SamplingParams
from shared.errors import Reason, VisorError
from shared.sampling import ResponseFormat

CODE = r"[A-Z]{2}-[0-9]{3}"
YES_NO = 'start: "yes" | "no"'


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    e = Engine(model_dir, "structured")
    yield e
    e.close()


def _ids(engine: Engine, text: str = "Answer.") -> list[int]:
    return engine.tokenizer.encode_prompt([ChatTurn("user", text, 0)])


async def _collect(engine: Engine, ids: list[int], params: SamplingParams) -> Result:
    result = None
    async for out in engine.generate_ids(ids, params):
        if not isinstance(out, Delta):
            result = out
    assert result is not None
    return result


def _run(engine: Engine, *params: SamplingParams) -> list[Result]:
    """Runs the requests concurrently (they share steps), each on the same prompt."""

    async def go() -> list[Result]:
        return list(await asyncio.gather(*(_collect(engine, _ids(engine), p) for p in params)))

    return asyncio.run(go())


async def _matchers_left(engine: Engine) -> dict[int, llguidance.LLMatcher]:
    """The runner's matchers, read on the model thread once they are gone or after 2 s: the
    runner drops a request's state at the step after the scheduler finished it (an abort runs
    on the model thread between two steps)."""
    for _ in range(200):
        left = await engine.run(lambda: engine.runner.matchers)
        if not left:
            break
        await asyncio.sleep(0.01)
    return left


def _fmt(kind: str, text: str) -> ResponseFormat:
    return ResponseFormat(kind, text)


def test_unpack_reads_bit_i_of_word_w_as_token_32w_plus_i() -> None:
    bits = torch.arange(32, dtype=torch.int32)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (bit 31 is the int32 sign bit)
    mask[0, 1] = 1 << 4  # token 36
    allowed = unpack(mask, bits, 40)
    assert allowed.shape == (1, 40)
    assert allowed[0].nonzero().flatten().tolist() == [3, 31, 36]
    assert unpack(mask, bits, 70)[0, 64:].sum() == 0  # past the mask's width: forbidden


def test_mask_allows_exactly_the_tokens_the_grammar_accepts(engine: Engine) -> None:
    grammar = engine.grammars.compile(_fmt("regex", CODE))
    matcher = grammar.matcher()
    vocab = engine.model.cfg.text.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    masked = TokenMasks(vocab).apply(logits, [MaskedRow(matcher, 1)])
    assert torch.equal(logits, before)  # raw logits untouched (logprobs read them)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    finite = set(torch.isfinite(masked[1]).nonzero().flatten().tolist())
    accepted = {t for t in range(vocab) if grammar.matcher().try_consume_tokens([t]) == 1}
    assert finite == accepted and finite
    text = engine.tokenizer.token_text
    assert all(re.fullmatch(r"[A-Z]{1,2}", text(t)) for t in finite)  # the first step: letters
    assert not torch.isfinite(masked[1][sorted(engine.eos_ids)]).any()  # incomplete: no EOS


def test_compiled_grammars_are_cached_and_evicted_least_recently_used(model_dir: Path) -> None:
    tok = (model_dir / "tokenizer.json").read_text()
    compiler = GrammarCompiler(tok, 512, {2}, cache_size=2)
    a, b, c = (_fmt("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(a) is first and compiler.num_compiled == 1
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent: c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is first and compiler.num_compiled == 3
    compiler.compile(b)
    assert compiler.num_compiled == 4


@pytest.mark.parametrize(
    "fmt",
    [
        _fmt("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/secret-x"}}}'),
        _fmt("json_schema", '{"type": "array", "uniqueItems": true}'),  # cannot be enforced
        _fmt("json_schema", "not json secret-x"),
        _fmt("json_schema", '["secret-x"]'),
        _fmt("regex", "[a-z(secret-x"),
        _fmt("grammar", "start: secret_x"),
    ],
)
def test_formats_that_do_not_compile_are_refused_naming_the_kind(
    engine: Engine, fmt: ResponseFormat
) -> None:
    with pytest.raises(VisorError) as err:
        engine.grammars.compile(fmt)
    assert err.value.reason == Reason.INVALID_REQUEST
    assert f"response_format.{fmt.kind}" in str(err.value) and "secret" not in str(err.value)


def test_a_format_over_the_grammar_limits_is_refused(model_dir: Path) -> None:
    tok = (model_dir / "tokenizer.json").read_text()
    tight = GrammarCompiler(tok, 512, {2}, cache_size=4, max_grammar_size=50)
    small = _fmt("regex", "[a-c]+")
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(20)}}
    tight.compile(small)
    with pytest.raises(VisorError, match=r"response_format\.json_schema .*limits") as err:
        tight.compile(_fmt("json_schema", json.dumps(schema)))
    assert err.value.reason == Reason.INVALID_REQUEST and tight.num_compiled == 1


def test_admission_caps_the_format_size(engine: Engine) -> None:
    big = _fmt("regex", "a" * (engine.inputs.max_format_bytes + 1))
    req = InferRequest(
        "t", "r", (ChatTurn("user", "hi", 0),), SamplingParams(4, response_format=big), (), ""
    )
    with pytest.raises(VisorError, match="max_format_bytes") as err:
        engine.inputs.check(req)
    assert err.value.reason == Reason.INVALID_REQUEST


def test_constrained_and_free_rows_share_steps_and_only_the_constrained_is_masked(
    engine: Engine,
) -> None:
    free = SamplingParams(24, min_new_tokens=24)
    solo = _run(engine, free)[0]
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    constrained = SamplingParams(64, response_format=_fmt("json_schema", json.dumps(schema)))
    together = _run(engine, free, constrained, free)
    assert together[0].text == together[2].text == solo.text  # greedy, unmasked: unchanged
    answer = json.loads(together[1].text)
    assert set(answer) == {"n"} and 0 <= answer["n"] <= 999
    assert together[1].finish_reason == "stop"
    assert asyncio.run(_matchers_left(engine)) == {}  # freed once the sequences left


def test_a_complete_grammar_stops_without_an_eos_token(engine: Engine) -> None:
    params = SamplingParams(40, response_format=_fmt("regex", CODE))
    result = _run(engine, params)[0]
    assert re.fullmatch(CODE, result.text) and result.finish_reason == "stop"
    # Each letter or digit is at most one token; no EOS was sampled after the last one.
    assert result.output_tokens == len(engine.tokenizer.tok.encode(result.text).ids) <= 6


def test_min_new_tokens_never_extends_a_complete_grammar(engine: Engine) -> None:
    yes_no = SamplingParams(30, min_new_tokens=20, response_format=_fmt("grammar", YES_NO))
    number = SamplingParams(
        30, min_new_tokens=12, temperature=1.0, seed=3, response_format=_fmt("regex", "[0-9]+")
    )
    short, long = _run(engine, yes_no, number)
    assert short.text in {"yes", "no"} and short.finish_reason == "stop"
    # While the grammar allows more, EOS waits for min_new_tokens like everywhere else.
    assert re.fullmatch("[0-9]+", long.text) and long.output_tokens >= 12


def test_a_cancelled_constrained_request_frees_its_matcher(engine: Engine) -> None:
    params = SamplingParams(200, min_new_tokens=200, response_format=_fmt("regex", "[a-z ]+"))

    async def go() -> None:
        stream = engine.generate_ids(_ids(engine), params)
        async for out in stream:
            if isinstance(out, Delta):
                break
        await stream.aclose()  # type: ignore[attr-defined]
        assert await _matchers_left(engine) == {}

    asyncio.run(go())


def test_a_matcher_copy_starts_fresh_each_time(engine: Engine) -> None:
    grammar = engine.grammars.compile(_fmt("grammar", YES_NO))
    one = grammar.matcher()
    yes = engine.tokenizer.tok.encode("yes").ids
    assert one.consume_tokens(yes) and one.is_stopped()
    two = grammar.matcher()
    assert not two.is_stopped() and isinstance(two, llguidance.LLMatcher)

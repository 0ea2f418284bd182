"""The engine on the demo model: admission refuses bad sampling values, stop-string lists and
header geometry before any compute (a huge declared grid in milliseconds, without allocating
for it), counts a request at the limit as generation does, tokenises once (generation runs the
admitted ids), holds a queue place from admission, and a sequence whose sampling fails ends
alone while its step-mates finish."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from core import compression
from core.config import SchedulerConfig
from core.engine import Engine
from core.input_processor import Admitted
from core.model.tokenizer import ChatTurn
from core.types import InferRequest, ItemSpec, Result, SamplingParams
from shared.errors import Reason, VisorError


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    e = Engine(model_dir, "admission")
    yield e
    e.close()


def _item(engine: Engine, rows: int = 1, cols: int = 1) -> ItemSpec:
    size, cells = engine.info.image_size, rows * cols
    tiles = cells + 1 if cells > 1 else cells
    return ItemSpec("0" * 64, engine.info.preprocess_version, size, rows, cols, "uint8",
                    (tiles, 3, size, size))  # fmt: skip


def _req(
    params: SamplingParams, items: tuple[ItemSpec, ...] = (), text: str = "What is it?"
) -> InferRequest:
    turns = (ChatTurn("user", text, len(items)),)
    return InferRequest("t", "r1", turns, params, items, "none")


def _refused(engine: Engine, req: InferRequest) -> VisorError:
    with pytest.raises(VisorError) as info:
        engine.inputs.check(req)
    return info.value


@pytest.mark.parametrize(
    ("params", "names"),
    [
        (SamplingParams(8, temperature=float("nan")), "temperature"),
        (SamplingParams(8, temperature=float("inf")), "temperature"),
        (SamplingParams(8, 2, temperature=float("-inf")), "temperature"),
        (SamplingParams(8, temperature=1.0, top_p=float("nan")), "top_p"),
        (SamplingParams(8, temperature=1.0, top_k=2**31), "top_k"),
        (SamplingParams(8, 9), "min_new_tokens"),
        (SamplingParams(0), "max_new_tokens"),
        (SamplingParams(8, stop=("a",) * 17), "max_stop_strings (16)"),
        (SamplingParams(8, stop=("a" * 257,)), "max_stop_bytes (256)"),
    ],
)
def test_bad_sampling_values_are_refused_at_the_core(
    engine: Engine, params: SamplingParams, names: str
) -> None:
    err = _refused(engine, _req(params))
    assert err.reason == Reason.INVALID_REQUEST and names in err.message


def test_tiny_temperature_is_admitted(engine: Engine) -> None:
    engine.inputs.check(_req(SamplingParams(8, temperature=1e-38, top_k=1000)))


def test_a_huge_declared_grid_is_refused_in_milliseconds(engine: Engine) -> None:
    cases = {
        "grid": _req(SamplingParams(8), (_item(engine, 1024, 1024),)),
        "items": _req(SamplingParams(8), (_item(engine),) * 65),
        "empty grid": _req(SamplingParams(8), (_item(engine, 0, 3),)),
        "image places": dataclasses.replace(
            _req(SamplingParams(8)), turns=(ChatTurn("user", "hi", 2**32 - 1),)
        ),
    }
    reasons = {}
    for name, req in cases.items():
        tracemalloc.start()
        t0 = time.perf_counter()
        err = _refused(engine, req)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert elapsed < 0.05 and peak < 1 << 20, (name, elapsed, peak)
        reasons[name] = err.reason
    assert reasons == {
        "grid": Reason.INVALID_REQUEST,
        "items": Reason.IMAGE_COUNT_LIMIT,
        "empty grid": Reason.INVALID_REQUEST,
        "image places": Reason.INVALID_REQUEST,
    }


def test_a_grid_within_the_caps_but_over_budget_is_refused_before_encoding(
    model_dir: Path,
) -> None:
    small = Engine(model_dir, "budget", scheduler=SchedulerConfig(max_request_tokens=1000))
    try:
        t0 = time.perf_counter()
        err = _refused(small, _req(SamplingParams(8), (_item(small, 3, 5),) * 2))  # 2 x 16 tiles
        assert err.reason == Reason.TOKEN_BUDGET and time.perf_counter() - t0 < 0.05
    finally:
        small.close()


def _features(engine: Engine, tiles: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    rows = tiles * engine.info.tokens_per_tile
    hidden = engine.model.cfg.text.hidden_size
    feats = rng.normal(0, 0.5, (rows, hidden)).astype(np.float32)
    return feats, rng.random(rows).astype(np.float32)


@pytest.mark.parametrize("profile", list(compression.PROFILES))
def test_a_request_exactly_at_the_limit_is_admitted_and_served(
    model_dir: Path, profile: str
) -> None:
    """Admission's arithmetic count of visual and text tokens is exactly what generation then
    holds: at the limit the request runs; one token over, admission refuses it."""
    probe = Engine(model_dir, "probe")
    item = _item(probe, 1, 2)  # two cells + thumbnail
    req = dataclasses.replace(_req(SamplingParams(4, 4), (item,)), profile=profile)
    feats, importance = _features(probe, 3)
    chosen = compression.profile(profile)
    compressed = compression.compress_item(feats, importance, 3, chosen)[0]
    need = len(probe.tokenizer.encode_chat(list(req.turns), [compressed.shape[0]])) + 4
    probe.close()
    exact = Engine(model_dir, "exact", scheduler=SchedulerConfig(max_request_tokens=need))
    try:
        exact.inputs.check(req)

        async def run() -> Result:
            outs = [o async for o in exact.generate(req, [compressed], {})]
            assert isinstance(outs[-1], Result)
            return outs[-1]

        assert asyncio.run(run()).output_tokens == 4
        exact.inputs.max_request_tokens = need - 1  # the same engine, one token less of room
        assert _refused(exact, req).reason == Reason.TOKEN_BUDGET
    finally:
        exact.close()


async def _collect(engine: Engine, req: InferRequest | Admitted) -> Result:
    result = None
    async for out in engine.generate(req, [], {}):
        if isinstance(out, Result):
            result = out
    assert result is not None
    return result


@pytest.mark.parametrize(
    "bad",
    [
        SamplingParams(6, temperature=float("nan")),
        SamplingParams(6, 3, temperature=float("inf")),  # inf / -inf (suppressed EOS) is NaN
        SamplingParams(6, temperature=1.0, top_p=float("nan")),
    ],
)
def test_a_failing_sequence_ends_alone(engine: Engine, bad: SamplingParams) -> None:
    """Past admission (which would refuse it), a bad sampling value fails its own request with
    INTERNAL in the runner; the request sharing its steps finishes as it would alone."""
    good = _req(SamplingParams(24, 24), text="Describe the picture in detail.")
    alone = asyncio.run(_collect(engine, good))

    async def together() -> list[Result | BaseException]:
        bad_req = dataclasses.replace(_req(bad), request_id="bad")
        # Admitted with sound values, then given the bad ones, as if a check had let them by.
        sound = await engine.inputs.admit(dataclasses.replace(bad_req, params=SamplingParams(6)))
        smuggled = dataclasses.replace(sound, req=bad_req)
        jobs = [_collect(engine, good), _collect(engine, smuggled), _collect(engine, good)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    first, failed, second = asyncio.run(together())
    assert isinstance(failed, VisorError) and failed.reason == Reason.INTERNAL
    for out in (first, second):
        assert isinstance(out, Result), out
        assert (out.text, out.output_tokens) == (alone.text, 24)
    sched = engine.scheduler
    assert not sched.running and not sched.num_waiting
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_generation_runs_the_ids_admission_tokenised(engine: Engine) -> None:
    """The conversation is tokenised once, at admission: an admitted record whose ids are those
    of another question answers that question, not a second tokenisation of its turns."""
    params = SamplingParams(12, 12)
    mine = _req(params, text="What is it?")
    other = _req(params, text="Describe the picture in detail.")

    async def go() -> tuple[Result, Result]:
        other_alone = await _collect(engine, other)
        swapped = await engine.inputs.admit(mine)
        their_ids = (await engine.inputs.admit(other)).prompt_ids
        return other_alone, await _collect(
            engine, dataclasses.replace(swapped, prompt_ids=their_ids)
        )

    want, got = asyncio.run(go())
    assert got.text == want.text and got.text_tokens == want.text_tokens


def test_an_admitted_request_holds_its_queue_place_until_it_runs(model_dir: Path) -> None:
    """Admission takes the place (a request being received and encoded counts as waiting), so
    past max_waiting the next one is refused before any encoding; leaving gives it back."""
    one = Engine(model_dir, "queue", scheduler=SchedulerConfig(max_waiting=1))
    req = _req(SamplingParams(2))

    async def go() -> None:
        with await one.inputs.admit(req):
            with pytest.raises(VisorError) as err:
                await one.inputs.admit(req)
            assert err.value.reason == Reason.OVERLOADED
        with await one.inputs.admit(req) as again:  # given back when the first left
            result = await _collect(one, again)
            assert result.output_tokens == 2
        with await one.inputs.admit(req):  # it reached the scheduler and finished: free again
            pass

    try:
        asyncio.run(go())
    finally:
        one.close()

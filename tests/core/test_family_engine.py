"""The scheduler and paged engine on the real tiny Qwen2.5-VL, Qwen3-VL and Gemma 3 checkpoints
(tests/family_checkpoints.py), through `Engine` as the servicer drives it (admission of declared
items, the family's encoder, grids from the rule): a request's logprobs are bitwise the same alone
and in a batch (batch-invariant mode), a second request on the same image hits the prefix cache
and answers identically, and greedy text survives preemption. Gemma's items include a
pan-and-scan image of four views: four bidirectional runs of one item. Qwen3-VL's images cross
KV block boundaries, so its deepstack inputs meet prefill chunks and prefix hits that start
inside an image."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from core.config import SchedulerConfig
from core.engine import Engine, VisualItem
from core.model.tokenizer import ChatTurn
from core.types import Delta, InferRequest, ItemSpec, SamplingParams
from tests.family_checkpoints import build_gemma, build_qwen, build_qwen3

pytest.importorskip("transformers")
_ids = itertools.count()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    build_qwen(root / "qwen")
    build_qwen3(root / "qwen3")
    build_gemma(root / "gemma", do_pan_and_scan=True, pan_and_scan_min_crop_size=32)
    return {"qwen": root / "qwen" / "t5", "qwen3": root / "qwen3" / "t5", "gemma": root / "gemma"}


def _pixels(family: str, seed: int) -> list[np.ndarray]:
    """A request's items: Qwen one 56 x 84 image, or two; Qwen3 the same at 32 px per token (15
    tokens each: two of them cross the first two block boundaries); Gemma one view, or a whole
    image with three crops."""
    rng = np.random.default_rng(seed)
    shapes = {
        "qwen": [(1, 3, 56, 84), (1, 3, 84, 56)],
        "qwen3": [(1, 3, 96, 160), (1, 3, 160, 96)],
        "gemma": [(1, 3, 224, 224), (4, 3, 224, 224)],
    }[family][: 1 + seed % 2]
    return [rng.integers(0, 256, s, dtype=np.uint8) for s in shapes]


def _grid(engine: Engine, shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) an item of `shape` declares: native sides in merged tokens, or the
    pan-and-scan crops (1 x views - 1) after the whole image."""
    rule = engine.info.rule
    if rule.kind == "native":
        return shape[2] // rule.factor, shape[3] // rule.factor
    return (1, shape[0] - 1) if shape[0] > 1 else (1, 1)


async def _ask(
    engine: Engine, pixels: list[np.ndarray], max_new: int = 8, tenant: str = "t"
) -> tuple[str, list[float]]:
    """(text, each token's logprob) of a greedy answer on `pixels`, as the servicer runs it."""
    info, rule = engine.info, engine.info.rule
    items = tuple(
        ItemSpec(
            hashlib.sha256(p.tobytes()).hexdigest(),
            info.preprocess_version,
            rule.resolution,
            *_grid(engine, p.shape),
            "uint8",
            p.shape,
        )
        for p in pixels
    )
    params = SamplingParams(max_new, min_new_tokens=max_new, logprobs=True)
    turns = (ChatTurn("user", "What colour is the circle?", len(items)),)
    req = InferRequest(tenant, f"r{next(_ids)}", turns, params, items, "none")
    admitted = await engine.inputs.admit(req)
    feats = [f.reshape(-1, f.shape[-1]) for f, _ in map(engine.encoder.encode, pixels)]
    keys = [hashlib.sha256(p.tobytes()).digest() for p in pixels]
    visual = [VisualItem(rule.grid(p.shape)) for p in pixels]
    text, logprobs = "", []
    async for out in engine.generate(admitted, feats, {}, None, keys, visual):
        if isinstance(out, Delta):
            text += out.text
            logprobs += [lp.logprob for lp in out.logprobs]
    assert len(logprobs) == max_new
    return text, logprobs


@pytest.fixture(scope="module", params=["qwen", "qwen3", "gemma"])
def engine(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> Iterator[Engine]:
    e = Engine(checkpoints[request.param], request.param, batch_invariant=True)
    yield e
    e.close()


def _family(engine: Engine) -> str:
    return engine.info.core_id


def test_logprobs_are_bitwise_the_same_alone_and_batched(engine: Engine) -> None:
    family = _family(engine)

    async def run() -> tuple[list[float], list[float]]:
        alone = await _ask(engine, _pixels(family, 1), tenant="alone")
        # Another tenant: no prefix hit, the same tokens computed inside a batch of three.
        batched = await asyncio.gather(
            _ask(engine, _pixels(family, 1), tenant="batched"),
            _ask(engine, _pixels(family, 2), tenant="batched"),
            _ask(engine, _pixels(family, 3), max_new=12, tenant="batched"),
        )
        return alone[1], batched[0][1]

    alone, batched = asyncio.run(run())
    assert alone == batched  # float equality: bitwise
    assert max(alone) - min(alone) > 0.01  # the steps differ: the comparison means something


def test_a_repeated_image_hits_the_prefix_cache_and_answers_the_same(engine: Engine) -> None:
    family, kv = _family(engine), engine.kv_manager
    pixels = _pixels(family, 5)
    first = asyncio.run(_ask(engine, pixels, tenant="prefix"))
    hits = kv.num_hit_tokens
    again = asyncio.run(_ask(engine, pixels, tenant="prefix"))
    visual = sum(engine.info.rule.visual_tokens(p.shape) for p in pixels)
    assert kv.num_hit_tokens - hits >= visual  # the image's tokens came from the cache
    assert again == first
    other = asyncio.run(_ask(engine, _pixels(family, 7), tenant="prefix"))
    assert other != first  # a different image: its own answer


def test_greedy_text_survives_preemption(checkpoints: dict[str, Path]) -> None:
    """1 MiB of KV blocks against requests that need about twice that together: the scheduler
    preempts and recomputes, and every answer is the one the request gets alone."""
    for family, path in checkpoints.items():
        sc = SchedulerConfig(kv_cache_mb=1, max_batch_tokens=512)
        e = Engine(path, family, scheduler=sc, batch_invariant=True)
        try:
            capacity = e.kv_manager.num_blocks * sc.block_size
            count = -(-2 * capacity // 220)
            pixels = [_pixels(family, seed) for seed in range(count)]

            async def run(e: Engine = e, pixels: list[list[np.ndarray]] = pixels) -> list[str]:
                out = await asyncio.gather(
                    *(_ask(e, p, 160, f"t{i}") for i, p in enumerate(pixels))
                )
                return [text for text, _ in out]

            together = asyncio.run(run())
            assert e.scheduler.num_preemptions > 0
            alone = [asyncio.run(_ask(e, p, 160, "solo"))[0] for p in pixels]
            assert together == alone
            assert len(set(alone)) > 1
        finally:
            e.close()


def _image_runs(engine: Engine, pixels: list[np.ndarray]) -> list[tuple[int, int]]:
    """[start, end) of each image's tokens in the prompt `_ask` sends."""
    tok, rule = engine.tokenizer, engine.info.rule
    turns = [ChatTurn("user", "What colour is the circle?", len(pixels))]
    ids = tok.expand(tok.encode_prompt(turns), [rule.visual_tokens(p.shape) for p in pixels])
    starts = [i for i, t in enumerate(ids) if t == tok.image_token_id and ids[i - 1] != t]
    return [(s, s + rule.visual_tokens(p.shape)) for s, p in zip(starts, pixels, strict=True)]


def test_deepstack_inside_an_image_matches_the_unchunked_run(checkpoints: dict[str, Path]) -> None:
    """Qwen3-VL, two images crossing block boundaries: prefilled in 16-token chunks (each image
    split between two chunks), and on a prefix hit whose recomputed part starts inside the
    first image (a request sharing only that image), the logprobs are bitwise those of a
    one-chunk prefill with no hit."""
    first, second = _pixels("qwen3", 1)
    other = [first, _pixels("qwen3", 3)[1]]
    whole = Engine(checkpoints["qwen3"], "qwen3", batch_invariant=True)
    chunked = Engine(
        checkpoints["qwen3"],
        "qwen3",
        scheduler=SchedulerConfig(max_prefill_chunk=16, max_batch_tokens=16),
        batch_invariant=True,
    )
    try:
        runs = _image_runs(whole, [first, second])
        assert [s < 16 < e for s, e in runs] == [True, False]  # a chunk ends inside image 1
        assert [s < 32 < e for s, e in runs] == [False, True]  # and one inside image 2
        alone = asyncio.run(_ask(whole, [first, second], tenant="a"))
        assert asyncio.run(_ask(chunked, [first, second], tenant="a")) == alone
        expected = asyncio.run(_ask(whole, other, tenant="b"))  # another tenant: no hit
        hits = whole.kv_manager.num_hit_tokens
        got = asyncio.run(_ask(whole, other, tenant="a"))
        hit = whole.kv_manager.num_hit_tokens - hits
        assert runs[0][0] < hit < runs[0][1]  # the recomputed part starts inside image 1
        assert got == expected
        assert got != alone  # the second image differs: so does the answer
    finally:
        whole.close()
        chunked.close()


@pytest.mark.parametrize("family", ["qwen", "qwen3", "gemma"])
def test_fast_mode_on_onednn_weights_matches_the_bitwise_mode(
    checkpoints: dict[str, Path], family: str
) -> None:
    """Fast mode on the CPU runs every decoder linear on oneDNN (`paged.pack_linears`): Qwen's
    QKV biases, Gemma's tied LM head and Qwen3's deepstack rows give the bitwise mode's
    logprobs to float32 rounding."""
    fast = Engine(checkpoints[family], family, batch_invariant=False)
    exact = Engine(checkpoints[family], family, batch_invariant=True)
    try:
        assert fast.model.lm_head.weight.numel() == 0  # laid out for oneDNN, the plain copy gone
        got = asyncio.run(_ask(fast, _pixels(family, 1), tenant="t"))
        want = asyncio.run(_ask(exact, _pixels(family, 1), tenant="t"))
        np.testing.assert_allclose(got[1], want[1], atol=1e-3)
    finally:
        fast.close()
        exact.close()

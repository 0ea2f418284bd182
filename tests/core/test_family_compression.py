"""Compression profiles on the native (Qwen2.5-VL) and fixed (Gemma 3) families, on the real tiny
checkpoints (tests/family_checkpoints.py) through `Engine` as the servicer drives it: admission of
declared items under the profile, the family's encoder, compression unit by unit as the rule lays
the tokens out (Qwen: each temporal patch's (h, w) grid; Gemma: each view's 4 x 4), the rule's
grids for the rope. Every profile serves and brings the LLM what admission counted; a pruned or
merged Qwen image keeps each kept token's original (t, h, w) position and the text after it starts
where it would uncompressed; a Gemma view's bidirectional run shrinks to its kept tokens. The
runner's request state is read by wrapping `ModelRunner._new_state` (it still builds it)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from core import compression
from core.engine import Engine, VisualItem
from core.model.qwen2_5_vl import QwenVL
from core.model.qwen2_5_vl_vision import received_attention, window_order
from core.model.text import _rotate
from core.model.tokenizer import ChatTurn
from core.outputs import NewRequestData
from core.types import InferRequest, ItemSpec, Result, SamplingParams
from tests.family_checkpoints import build_gemma, build_qwen

pytest.importorskip("transformers")
_ids = itertools.count()
NEW_TOKENS = 4
# Qwen: a 4 x 6 and a 6 x 4 grid of merged tokens; Gemma: one view, and a whole image + 3 crops.
SHAPES = {
    "qwen": [(1, 3, 112, 168), (1, 3, 168, 112)],
    "gemma": [(1, 3, 224, 224), (4, 3, 224, 224)],
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    root = tmp_path_factory.mktemp("families")
    build_qwen(root / "qwen")
    build_gemma(root / "gemma", do_pan_and_scan=True, pan_and_scan_min_crop_size=32)
    built = {"qwen": Engine(root / "qwen" / "t5", "qwen"), "gemma": Engine(root / "gemma", "gemma")}
    yield built
    for e in built.values():
        e.close()


@dataclass
class Served:
    result: Result
    counted: tuple[int, ...]  # per item, the visual tokens admission counted
    kept: list[compression.Kept | None]  # per item, what compression kept
    new: NewRequestData  # what the runner got
    state: object  # the runner's request state built from it


def _pixels(family: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, s, dtype=np.uint8) for s in SHAPES[family]]


def _item(engine: Engine, p: np.ndarray) -> ItemSpec:
    info, rule = engine.info, engine.info.rule
    if rule.kind == "native":
        rows, cols = p.shape[2] // rule.factor, p.shape[3] // rule.factor
    else:
        rows, cols = (1, p.shape[0] - 1) if p.shape[0] > 1 else (1, 1)
    digest = hashlib.sha256(p.tobytes()).hexdigest()
    return ItemSpec(digest, info.preprocess_version, rule.resolution, rows, cols, "uint8", p.shape)


def _spy(engine: Engine) -> list[tuple[NewRequestData, object]]:
    """Records each request state the runner builds (the runner still builds and uses it)."""
    runner = engine.runner
    seen: list[tuple[NewRequestData, object]] = []
    build: Callable[[NewRequestData], object] = runner._new_state

    def record(new: NewRequestData) -> object:
        state = build(new)
        seen.append((new, state))
        return state

    runner._new_state = record  # type: ignore[method-assign,assignment]
    return seen


def _serve(engine: Engine, pixels: list[np.ndarray], profile: str) -> Served:
    """One greedy request as the servicer runs it: admit, encode, compress, generate."""
    seen = _spy(engine)
    rule, chosen = engine.info.rule, compression.profile(profile)
    items = tuple(_item(engine, p) for p in pixels)
    turns = (ChatTurn("user", "What colour is the circle?", len(items)),)
    params = SamplingParams(NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    req = InferRequest(f"t{next(_ids)}", f"r{next(_ids)}", turns, params, items, profile)

    async def run() -> tuple[Result, tuple[int, ...], list[compression.Kept | None]]:
        admitted = await engine.inputs.admit(req)
        feats, kept, before = [], [], 0
        for p, item in zip(pixels, items, strict=True):
            f, imp = engine.encoder.encode(p)
            f, imp = f.reshape(-1, f.shape[-1]), imp.reshape(-1)
            before += f.shape[0]
            out, k = compression.compress_by_rule(rule, item.shape, f, imp, chosen, seed=1)
            feats.append(out)
            kept.append(k)
        keys = [hashlib.sha256(p.tobytes()).digest() for p in pixels]
        visual = [VisualItem(rule.grid(p.shape), k) for p, k in zip(pixels, kept, strict=True)]
        result = None
        async for out in engine.generate(admitted, feats, {}, before, keys, visual):
            if isinstance(out, Result):
                result = out
        assert result is not None
        return result, admitted.num_visual, kept

    try:
        result, counted, kept = asyncio.run(run())
    finally:
        del engine.runner._new_state  # back to the class's method
    ((new, state),) = seen
    return Served(result, counted, kept, new, state)


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_every_profile_serves_what_admission_counted(
    engines: dict[str, Engine], family: str
) -> None:
    engine, pixels = engines[family], _pixels(family, 1)
    full = [engine.info.rule.visual_tokens(p.shape) for p in pixels]
    served = {name: _serve(engine, pixels, name) for name in compression.PROFILES}
    for name, s in served.items():
        r = s.result
        assert r.output_tokens == NEW_TOKENS, name
        assert r.visual_tokens_before == sum(full), name
        assert r.visual_tokens_after == sum(s.counted), name  # admission counted exactly this
        assert r.text_tokens == served["none"].result.text_tokens, name
        assert len(s.new.features) == len(pixels)
        assert [f.shape[0] for f in s.new.features] == list(s.counted)
        if name != "none":
            assert all(c < f for c, f in zip(s.counted, full, strict=True)), name
    after = {name: s.result.visual_tokens_after for name, s in served.items()}
    # Qwen: 24 tokens per image; Gemma: 16 per view, 1 + 4 views. Per unit: low-latency keeps
    # 30 %, balanced 50 %, high-precision 70 % by attention then merges down to 60 %.
    want = {
        "qwen": {"none": 48, "low-latency": 14, "balanced": 24, "high-precision": 28},
        "gemma": {"none": 80, "low-latency": 25, "balanced": 40, "high-precision": 50},
    }[family]
    assert after == want


@pytest.mark.parametrize("profile", ["balanced", "high-precision"])
def test_qwen_kept_tokens_keep_their_original_positions(
    engines: dict[str, Engine], profile: str
) -> None:
    """Each kept (or merged-into) token has the (t, h, w) it had in the uncompressed request,
    the text after each image the positions it had there, and so has every generated token."""
    engine = engines["qwen"]
    image_id = engine.model.cfg.image_token_id
    pixels = _pixels("qwen", 2)
    whole, pruned = _serve(engine, pixels, "none"), _serve(engine, pixels, profile)
    full_ids, ids = list(whole.new.prompt_token_ids), list(pruned.new.prompt_token_ids)
    full_pos, pos = whole.state.positions, pruned.state.positions  # type: ignore[attr-defined]
    assert full_pos is not None and pos is not None and pos.shape == (3, len(ids))
    columns, at, full_at = [], 0, 0
    for k in pruned.kept:
        assert k is not None and 0 < len(k.indices) < k.num_tokens
        start, full_start = ids.index(image_id, at), full_ids.index(image_id, full_at)
        assert start - at == full_start - full_at  # the same text before it
        columns += range(full_at, full_start)
        columns += (full_start + k.indices).tolist()
        at, full_at = start + len(k.indices), full_start + k.num_tokens
        # The text after the image starts where it would uncompressed, on all three axes.
        assert pos[:, at].tolist() == full_pos[:, full_at].tolist()
    columns += range(full_at, len(full_ids))
    assert pos.tolist() == full_pos[:, columns].tolist()
    assert not torch.equal(pos[:, : len(ids)], full_pos[:, : len(ids)])  # gaps where tokens went
    delta, full_delta = pruned.state.delta, whole.state.delta  # type: ignore[attr-defined]
    assert len(ids) + delta == len(full_ids) + full_delta  # the first generated token's position


def test_gemma_view_runs_shrink_to_their_kept_tokens(engines: dict[str, Engine]) -> None:
    """A four-view image under `balanced` is four bidirectional runs of half a view (8 of 16)
    each, on the image tokens; positions stay the sequence indices (1-D rope, as LLaVA's)."""
    engine = engines["gemma"]
    image_id = engine.model.cfg.image_token_id
    served = _serve(engine, _pixels("gemma", 3), "balanced")
    spans = served.state.spans  # type: ignore[attr-defined]
    assert [e - s for s, e in spans] == [8] * 5  # one view, then the whole image and 3 crops
    ids = served.new.prompt_token_ids
    assert [i for i, t in enumerate(ids) if t == image_id] == [
        i for s, e in spans for i in range(s, e)
    ]
    assert len(served.new.kept) == len(spans)  # the runner has each run's kept tokens
    assert all(k is not None and k.num_tokens == 16 for k in served.new.kept)
    assert served.state.positions is None and served.state.delta == 0  # type: ignore[attr-defined]


def test_qwen_importance_is_the_attention_received_in_the_last_full_block(
    engines: dict[str, Engine],
) -> None:
    """`encode_item`'s importance, recomputed naively: the last full-attention block's softmax
    over its whole input (no chunks), averaged over heads and queries per patch, then over each
    merged token's 2 x 2 patches, in the tokens' raster order."""
    model = engines["qwen"].model
    assert isinstance(model, QwenVL)
    visual, cfg = model.visual, model.cfg.vision
    last = max(cfg.fullatt_block_indexes)
    pixels = torch.from_numpy(_pixels("qwen", 4)[0])
    seen: dict[str, torch.Tensor] = {}

    def grab(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen["x"], seen["cos"], seen["sin"] = args[0], *args[1]

    hook = visual.blocks[last].register_forward_pre_hook(grab)
    try:
        with torch.inference_mode():
            feats, importance = model.encode_item(pixels)
    finally:
        hook.remove()
    with torch.inference_mode():
        block = visual.blocks[last]
        x = block.norm1(seen["x"])
        n, heads = x.shape[0], block.attn.num_heads
        q, k, _ = block.attn.qkv(x).view(n, 3, heads, -1).permute(1, 2, 0, 3).unbind(0)
        q, k = _rotate(q, seen["cos"], seen["sin"]), _rotate(k, seen["cos"], seen["sin"])
        probs = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)  # one frame
        per_patch = probs.mean(dim=(0, 1))
    grid = (1, pixels.shape[2] // cfg.merge_pixels, pixels.shape[3] // cfg.merge_pixels)
    order, _ = window_order(grid, cfg.window_size // cfg.merge_pixels)
    want = per_patch.view(-1, 4).mean(dim=1)[torch.argsort(order)]
    assert importance.shape == (feats.shape[0],) == (24,)
    assert torch.allclose(importance, want, atol=1e-6)
    assert not torch.allclose(importance, feats.norm(dim=-1))
    # Chunked queries give the same sums as the whole matrix at once.
    chunked = received_attention(q, k, [n], max_scores=heads * n * 5)
    assert torch.allclose(chunked, per_patch, atol=1e-6)

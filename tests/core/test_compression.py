"""Visual-token compression methods and profiles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core import compression
from shared.errors import VisorError
from shared.preprocess import PreprocessRule


def _tile(n: int = 196, hidden: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, hidden)).astype(np.float32), rng.random(n).astype(np.float32)


@pytest.mark.parametrize("method", ["attention", "entropy", "spatial", "adaptive", "random"])
def test_pruning_keeps_the_target_in_raster_order(method: str) -> None:
    feats, scores = _tile()
    out, kept_scores = compression.apply(method, feats, scores, 59, seed=1)
    assert out.shape == (59, 32)
    rows = [int(np.flatnonzero((feats == row).all(axis=1))[0]) for row in out]
    assert rows == sorted(rows)  # survivors are original tokens, in their original order
    assert np.array_equal(kept_scores, scores[rows])


def test_attention_keeps_the_most_attended() -> None:
    feats, scores = _tile()
    _, kept = compression.apply("attention", feats, scores, 10)
    assert set(np.round(kept, 6)) == set(np.round(np.sort(scores)[-10:], 6))


def test_random_is_seeded() -> None:
    feats, scores = _tile()
    a = compression.apply("random", feats, scores, 20, seed=3)[0]
    assert np.array_equal(a, compression.apply("random", feats, scores, 20, seed=3)[0])
    assert not np.array_equal(a, compression.apply("random", feats, scores, 20, seed=4)[0])


def test_merge_averages_near_duplicates_first() -> None:
    feats, scores = _tile(8, 4)
    dup = feats.copy()
    dup[1] = dup[0] + 1e-3  # token 1 nearly equals token 0 (A = evens, B = odds)
    out, merged = compression.apply("merge", dup, scores, 7)
    assert out.shape == (7, 4)
    assert np.allclose(out[0], (dup[0] + dup[1]) / 2, atol=1e-3)  # the pair became one token
    assert np.isclose(merged.sum(), scores.sum())  # importance is conserved through merges
    many, _ = compression.apply("merge", *_tile(), 50)
    assert many.shape == (50, 32)  # several bipartite rounds


def test_pool_quarters_a_square_grid() -> None:
    feats, scores = _tile(196)
    out, pooled = compression.apply("pool", feats, scores, 49)
    assert out.shape == (49, 32)
    grid = feats.reshape(14, 14, 32)
    assert np.allclose(out[0], grid[:2, :2].mean(axis=(0, 1)))
    assert np.isclose(pooled.sum(), scores.sum())


def test_profiles() -> None:
    feats, scores = _tile()
    two_tiles_f, two_tiles_s = np.concatenate([feats, feats]), np.concatenate([scores, scores])
    sizes = {}
    for name in compression.PROFILES:
        out = compression.compress_item(two_tiles_f, two_tiles_s, 2, compression.profile(name))[0]
        sizes[name] = out.shape[0]
    assert sizes == {
        "none": 392,
        "low-latency": 2 * 59,
        "balanced": 2 * 98,
        "high-precision": 2 * 118,
    }
    with pytest.raises(VisorError) as info:
        compression.profile("ultra")
    assert info.value.reason.value == "INVALID_REQUEST"


@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 16, 64, 169, 576, 577])
def test_admission_counts_what_compression_produces(tokens: int) -> None:
    """Admission counts an item's visual tokens from its grid alone; the count must be what the
    profile's steps really leave (a rounding mismatch refused requests at the limit late)."""
    feats, scores = _tile(3 * tokens, 8)
    for chosen in compression.PROFILES.values():
        out = compression.compress_item(feats, scores, 3, chosen, seed=1)[0]
        assert compression.visual_tokens(tokens, 3, chosen) == out.shape[0], chosen.name


@pytest.mark.parametrize("name", ["low-latency", "balanced", "high-precision"])
def test_kept_indices_name_the_original_tokens(name: str) -> None:
    """Each compressed row stands for one original token (merged rows: the token merged into),
    increasing within each tile; a pruned row is exactly that token's features."""
    rng = np.random.default_rng(4)
    feats = rng.normal(size=(2 * 49, 16)).astype(np.float32)
    scores = rng.random(2 * 49).astype(np.float32)
    chosen = compression.profile(name)
    out, kept = compression.compress_item(feats, scores, 2, chosen)
    assert kept is not None and kept.num_tokens == 98 and kept.indices.shape == (out.shape[0],)
    assert np.array_equal(out, compression.compress_item(feats, scores, 2, chosen)[0])
    for tile in (kept.indices[kept.indices < 49], kept.indices[kept.indices >= 49]):
        assert np.all(np.diff(tile) > 0)
    if name != "high-precision":  # pruning only: the rows are the tokens themselves
        assert np.array_equal(out, feats[kept.indices])
    _, pooled = compression.compress_item(
        feats[:49], scores[:49], 1, compression.Profile("p", (compression.Step("pool", 0.25),))
    )
    # 7 x 7: four windows a row, the last one column wide (an odd edge is kept, not dropped)
    assert pooled is not None and pooled.indices.tolist()[:5] == [0, 2, 4, 6, 14]
    assert len(pooled.indices) == 16
    assert compression.compress_item(feats, scores, 2, compression.profile("none"))[1] is None


NATIVE = PreprocessRule(
    "native", (0.5,) * 3, (0.5,) * 3, "bicubic", patch_size=14, merge_size=2,
    temporal_patch_size=2, min_pixels=784, max_pixels=1003520,
)  # fmt: skip
FIXED = PreprocessRule(
    "fixed", (0.5,) * 3, (0.5,) * 3, "bilinear", image_size=896, tokens_per_image=256,
    pan_and_scan=True, min_crop_size=256, max_num_crops=4, min_ratio_to_activate=1.2,
)  # fmt: skip
POOL = compression.Profile("pool", (compression.Step("pool", 0.25),))


def test_units_per_rule() -> None:
    """Qwen's unit is a temporal patch's (h, w) grid of merged tokens, Gemma's a view's 16 x 16,
    the tiled family's a tile's square (none with a class token)."""
    assert compression.layout(NATIVE, (1, 3, 140, 84)) == compression.Layout(1, (5, 3))
    assert compression.layout(FIXED, (4, 3, 896, 896)) == compression.Layout(4, (16, 16))
    tiled = dataclasses.replace(FIXED, kind="tiles", tokens_per_tile=577, pan_and_scan=False)
    assert compression.layout(tiled, (5, 3, 896, 896)) == compression.Layout(5, None)


def test_pool_follows_a_wide_grid_and_keeps_its_odd_edges() -> None:
    """A 3 x 5 grid pools to 2 x 3 windows: the last row and column are windows of their own,
    each the mean of its tokens, named by its top-left token."""
    feats, scores = _tile(15, 4)
    out, kept = compression.compress_item(feats, scores, 1, POOL, grid=(3, 5))
    assert kept is not None and kept.indices.tolist() == [0, 2, 4, 10, 12, 14]
    grid = feats.reshape(3, 5, 4)
    assert np.allclose(out[1], grid[:2, 2:4].mean(axis=(0, 1)))
    assert np.allclose(out[2], grid[:2, 4].mean(axis=0))
    assert np.allclose(out[5], grid[2, 4])
    # Read as a square it would not be one: without the grid nothing is pooled.
    assert compression.compress_item(feats, scores, 1, POOL)[0].shape == (15, 4)


@pytest.mark.parametrize("shape", [(1, 3, 28, 28), (1, 3, 140, 84), (1, 3, 28, 392)])
def test_item_tokens_count_what_native_compression_produces(shape: tuple[int, ...]) -> None:
    tokens = NATIVE.visual_tokens(shape)
    feats, scores = _tile(tokens, 8)
    for chosen in (*compression.PROFILES.values(), POOL):
        out, _ = compression.compress_by_rule(NATIVE, shape, feats, scores, chosen, seed=2)
        assert compression.item_tokens(NATIVE, shape, chosen) == out.shape[0], chosen.name


def test_kept_splits_into_views() -> None:
    """An item's kept tokens as one `Kept` per view, indexed from the view's start (the runner
    gets one per run of image tokens)."""
    feats, scores = _tile(3 * 256, 8)
    _, kept = compression.compress_by_rule(
        FIXED, (3, 3, 896, 896), feats, scores, compression.profile("balanced")
    )
    assert kept is not None
    views = kept.split(3)
    assert [(v.num_tokens, len(v.indices)) for v in views] == [(256, 128)] * 3
    assert np.array_equal(
        np.concatenate([v.indices + 256 * i for i, v in enumerate(views)]), kept.indices
    )
    assert kept.split(1) == (kept,)

"""Visual-token compression methods and profiles."""

from __future__ import annotations

import numpy as np
import pytest

from core import compression
from shared.errors import VisorError


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
        out = compression.compress_item(two_tiles_f, two_tiles_s, 2, compression.profile(name))
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
        out = compression.compress_item(feats, scores, 3, chosen, seed=1)
        assert compression.visual_tokens(tokens, 3, chosen) == out.shape[0], chosen.name


@pytest.mark.parametrize("name", ["low-latency", "balanced", "high-precision"])
def test_kept_indices_name_the_original_tokens(name: str) -> None:
    """Each compressed row stands for one original token (merged rows: the token merged into),
    increasing within each tile; a pruned row is exactly that token's features."""
    rng = np.random.default_rng(4)
    feats = rng.normal(size=(2 * 49, 16)).astype(np.float32)
    scores = rng.random(2 * 49).astype(np.float32)
    chosen = compression.profile(name)
    out, kept = compression.compress_item_kept(feats, scores, 2, chosen)
    assert kept is not None and kept.num_tokens == 98 and kept.indices.shape == (out.shape[0],)
    assert np.array_equal(out, compression.compress_item(feats, scores, 2, chosen))
    for tile in (kept.indices[kept.indices < 49], kept.indices[kept.indices >= 49]):
        assert np.all(np.diff(tile) > 0)
    if name != "high-precision":  # pruning only: the rows are the tokens themselves
        assert np.array_equal(out, feats[kept.indices])
    _, pooled = compression.compress_item_kept(
        feats[:49], scores[:49], 1, compression.Profile("p", (compression.Step("pool", 0.25),))
    )
    # 7 x 7: four windows a row, the last one column wide (an odd edge is kept, not dropped)
    assert pooled is not None and pooled.indices.tolist()[:5] == [0, 2, 4, 6, 14]
    assert len(pooled.indices) == 16
    assert compression.compress_item_kept(feats, scores, 2, compression.profile("none"))[1] is None

"""Visual-token compression, applied between the feature cache and the LLM (so one cached entry
serves every profile). Each method maps one tile's (tokens, hidden) features, with the tile's
per-token importance, to fewer tokens; kept tokens stay in their original (raster) order.

Methods:
- `attention`: keep the tokens the class token attends to most (the stored importance).
- `entropy`: keep the tokens whose feature distribution (softmax over channels) has the lowest
  entropy, i.e. the most peaked, least background-like ones.
- `spatial`: keep an evenly spread subset of the patch grid (a coverage prior, content-blind).
- `adaptive`: the mean of the attention and entropy ranks.
- `random`: a seeded uniform subset; the baseline every other method must beat.
- `merge`: ToMe-style bipartite soft matching: tokens alternate into sets A and B, each A token
  is matched to its most similar B token, and the most similar pairs are averaged (weighted by how
  many tokens each already holds) until the target count is reached.
- `pool`: 2x2 average pooling over the patch grid (a quarter of the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import Reason, VisorError

METHODS = ("attention", "entropy", "spatial", "adaptive", "random", "merge", "pool")


@dataclass(frozen=True, slots=True)
class Step:
    method: str  # one of METHODS
    keep: float  # fraction of the tile's original tokens left after this step


@dataclass(frozen=True, slots=True)
class Kept:
    """Which of an item's visual tokens its compressed features stand for."""

    num_tokens: int  # the item's tokens before compression
    indices: np.ndarray  # int64, increasing: the original index of each kept (or merged) token


@dataclass(frozen=True, slots=True)
class Profile:
    name: str  # the name requests use
    steps: tuple[Step, ...]  # applied in order


PROFILES = {
    "none": Profile("none", ()),
    "low-latency": Profile("low-latency", (Step("adaptive", 0.3),)),
    "balanced": Profile("balanced", (Step("adaptive", 0.5),)),
    "high-precision": Profile("high-precision", (Step("attention", 0.7), Step("merge", 0.6))),
}


def profile(name: str) -> Profile:
    found = PROFILES.get(name or "none")
    if found is None:
        raise VisorError(
            Reason.INVALID_REQUEST, f"unknown compression profile; available: {', '.join(PROFILES)}"
        )
    return found


def tile_target(tokens: int, step: Step) -> int:
    """Tokens a tile of `tokens` keeps after `step` (a method may keep fewer, never more)."""
    return max(1, round(tokens * step.keep))


def visual_tokens(tokens_per_tile: int, num_tiles: int, chosen: Profile) -> int:
    """The most visual tokens an item of `num_tiles` tiles brings to the LLM under `chosen`:
    arithmetic on the declared grid, so admission can count before any pixel or token exists,
    with the same targets `compress_item` uses."""
    kept = tokens_per_tile
    for step in chosen.steps:
        kept = min(kept, tile_target(tokens_per_tile, step))
    return num_tiles * kept


def compress_item(
    features: np.ndarray, importance: np.ndarray, num_tiles: int, chosen: Profile, seed: int = 0
) -> np.ndarray:
    """(tiles * tokens, hidden) features -> compressed (tokens', hidden), tile by tile."""
    return compress_item_kept(features, importance, num_tiles, chosen, seed)[0]


def compress_item_kept(
    features: np.ndarray, importance: np.ndarray, num_tiles: int, chosen: Profile, seed: int = 0
) -> tuple[np.ndarray, Kept | None]:
    """`compress_item`, and which original token each output row stands for (a merged row: the
    token it was merged into; a pooled one: its window's first); None when nothing changed."""
    if not chosen.steps:
        return features, None
    tokens = features.shape[0] // num_tiles
    out, kept = [], []
    for t in range(num_tiles):
        feats = features[t * tokens : (t + 1) * tokens].astype(np.float32)
        scores = importance[t * tokens : (t + 1) * tokens].astype(np.float32)
        index = np.arange(tokens)
        for step in chosen.steps:
            target = tile_target(tokens, step)
            feats, scores, rows = _apply(step.method, feats, scores, target, seed + t)
            index = index[rows]
        out.append(feats.astype(features.dtype, copy=False))
        kept.append(index + t * tokens)
    return np.concatenate(out), Kept(features.shape[0], np.concatenate(kept))


def apply(
    method: str, feats: np.ndarray, scores: np.ndarray, target: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """One method on one tile; returns (features, their importance) with `target` rows or fewer."""
    feats, scores, _ = _apply(method, feats, scores, target, seed)
    return feats, scores


def _apply(
    method: str, feats: np.ndarray, scores: np.ndarray, target: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`apply`, plus the input row each output row stands for (increasing)."""
    n = feats.shape[0]
    if target >= n:
        return feats, scores, np.arange(n)
    if method == "merge":
        return _merge(feats, scores, target)
    if method == "pool":
        return _pool(feats, scores)
    if method == "random":
        rng = np.random.default_rng(seed)
        keep = rng.choice(n, target, replace=False)
    elif method == "spatial":
        keep = np.unique(np.linspace(0, n - 1, target).round().astype(np.int64))
    else:
        keep = np.argsort(-_score(method, feats, scores), kind="stable")[:target]
    keep = np.sort(keep)
    return feats[keep], scores[keep], keep


def _score(method: str, feats: np.ndarray, scores: np.ndarray) -> np.ndarray:
    if method == "attention":
        return _rank(scores)
    if method == "entropy":
        return _rank(-_entropy(feats))
    if method == "adaptive":
        mixed: np.ndarray = (_rank(scores) + _rank(-_entropy(feats))) / 2
        return mixed
    raise ValueError(f"unknown compression method {method!r}; one of {METHODS}")


def _rank(values: np.ndarray) -> np.ndarray:
    """Ranks in [0, 1]: 1 for the largest value."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values), dtype=np.float32)
    ranks[order] = np.arange(len(values), dtype=np.float32)
    return ranks / max(1, len(values) - 1)


def _entropy(feats: np.ndarray) -> np.ndarray:
    z = feats - feats.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    entropy: np.ndarray = -(p * np.log(p + 1e-12)).sum(axis=1)
    return entropy


def _merge(
    feats: np.ndarray, scores: np.ndarray, target: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    size = np.ones(len(feats), dtype=np.float32)
    index = np.arange(len(feats))
    while len(feats) > target:
        a, b = np.arange(0, len(feats), 2), np.arange(1, len(feats), 2)
        unit = feats / (np.linalg.norm(feats, axis=1, keepdims=True) + 1e-6)
        sim = unit[a] @ unit[b].T
        best = sim.argmax(axis=1)
        r = min(len(feats) - target, len(a))
        merged_a = np.argsort(-sim[np.arange(len(a)), best], kind="stable")[:r]
        feats, scores, size = feats.copy(), scores.copy(), size.copy()
        for i in merged_a:  # r vector updates; the matching itself was one matrix product
            src, dst = a[i], b[best[i]]
            total = size[src] + size[dst]
            feats[dst] = (feats[dst] * size[dst] + feats[src] * size[src]) / total
            scores[dst] = scores[dst] + scores[src]
            size[dst] = total
        keep = np.setdiff1d(np.arange(len(feats)), a[merged_a])
        feats, scores, size = feats[keep], scores[keep], size[keep]  # raster order kept
        index = index[keep]
    return feats, scores, index


def _pool(feats: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    side = round(len(feats) ** 0.5)
    if side * side != len(feats) or side < 2:
        return feats, scores, np.arange(len(feats))  # not a square grid (a class token): leave it
    half = side // 2
    grid = feats[: side * side].reshape(side, side, -1)[: half * 2, : half * 2]
    pooled = grid.reshape(half, 2, half, 2, -1).mean(axis=(1, 3)).reshape(half * half, -1)
    s = scores.reshape(side, side)[: half * 2, : half * 2].reshape(half, 2, half, 2).sum((1, 3))
    corner = (np.arange(half)[:, None] * 2 * side + np.arange(half)[None, :] * 2).reshape(-1)
    return pooled, s.reshape(-1), corner

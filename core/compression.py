"""Visual-token compression, applied between the feature cache and the LLM (so one cached entry
serves every profile). Each method maps one unit's (tokens, hidden) features, with the unit's
per-token importance, to fewer tokens; kept tokens stay in their original (raster) order.

A unit is what a family's encoder lays out as one grid of tokens (`layout`): a tile of the tiled
family, a view of a fixed-view family (Gemma 3: 16 x 16 pooled tokens), a temporal patch of a
native-resolution family (Qwen: an (h, w) grid of merged tokens). Every unit of an item keeps the
same number of tokens, so a view's run of image tokens shrinks evenly.

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
- `pool`: 2x2 average pooling over the unit's grid (a quarter of the tokens; a window at an odd
  edge is what is left of it, so no row or column is dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.errors import Reason, VisorError
from shared.preprocess import PreprocessRule

METHODS = ("attention", "entropy", "spatial", "adaptive", "random", "merge", "pool")


@dataclass(frozen=True, slots=True)
class Step:
    method: str  # one of METHODS
    keep: float  # fraction of the unit's original tokens left after this step


@dataclass(frozen=True, slots=True)
class Kept:
    """Which of an item's visual tokens its compressed features stand for."""

    num_tokens: int  # the item's tokens before compression
    indices: np.ndarray  # int64, increasing: the original index of each kept (or merged) token

    def split(self, parts: int) -> tuple[Kept, ...]:
        """This item's kept tokens as `parts` equal units (views) of their own, each indexed
        from its start: an item shown as several runs of image tokens."""
        if parts == 1:
            return (self,)
        size = self.num_tokens // parts
        part = self.indices // size
        return tuple(Kept(size, self.indices[part == p] - p * size) for p in range(parts))


Grid = tuple[int, int]  # a unit's (rows, cols) of tokens, row-major


@dataclass(frozen=True, slots=True)
class Layout:
    """How an item's visual tokens fall into the units compression works on one at a time."""

    num_units: int  # tiles, views, or temporal patches
    grid: Grid | None  # each unit's (rows, cols); None = not a grid (a class token leads it)


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


def layout(rule: PreprocessRule, shape: tuple[int, ...]) -> Layout:
    """The units of an item of (checked) `shape` under `rule`: Qwen's temporal patches of
    (h, w) merged tokens; a tile or view's square of pooled patches (LLaVA's with a class
    token is no grid)."""
    if rule.kind == "native":
        t, h, w = rule.grid(shape)
        return Layout(t, (h, w))
    per_unit = rule.tokens_per_tile if rule.kind == "tiles" else rule.tokens_per_image
    side = math.isqrt(per_unit)
    return Layout(shape[0], (side, side) if side * side == per_unit else None)


def item_tokens(rule: PreprocessRule, shape: tuple[int, ...], chosen: Profile) -> int:
    """The visual tokens an item of (checked) `shape` brings to the LLM under `chosen`: the
    rule's count, then the profile's per unit (`visual_tokens`)."""
    units = layout(rule, shape)
    per_unit = rule.visual_tokens(shape) // units.num_units
    return visual_tokens(per_unit, units.num_units, chosen, units.grid)


def tile_target(tokens: int, step: Step) -> int:
    """Tokens a unit of `tokens` keeps after `step` (a method may keep fewer, never more)."""
    return max(1, round(tokens * step.keep))


def visual_tokens(
    tokens_per_tile: int, num_tiles: int, chosen: Profile, grid: Grid | None = None
) -> int:
    """The visual tokens an item of `num_tiles` units brings to the LLM under `chosen`:
    arithmetic on the declared grid, so admission can count before any pixel or token exists,
    with the same targets `compress_item` uses. `grid`: each unit's (rows, cols), by default
    the square of `tokens_per_tile` if it is one."""
    grid = _grid(tokens_per_tile, grid)
    kept = tokens_per_tile
    for step in chosen.steps:
        if step.method != "pool":
            kept = min(kept, tile_target(tokens_per_tile, step))
        elif grid is not None and kept == tokens_per_tile:  # pooling needs the whole grid
            kept = -(-grid[0] // 2) * -(-grid[1] // 2)
    return num_tiles * kept


def compress_item(
    features: np.ndarray,
    importance: np.ndarray,
    num_tiles: int,
    chosen: Profile,
    seed: int = 0,
    grid: Grid | None = None,
) -> tuple[np.ndarray, Kept | None]:
    """(units * tokens, hidden) features -> compressed (tokens', hidden), unit by unit, and which
    original token each output row stands for (a merged row: the token it was merged into; a
    pooled one: its window's first); None when nothing changed.
    `grid`: each unit's (rows, cols) as in `visual_tokens`."""
    if not chosen.steps:
        return features, None
    tokens = features.shape[0] // num_tiles
    whole = _grid(tokens, grid)
    out, kept = [], []
    for t in range(num_tiles):
        feats = features[t * tokens : (t + 1) * tokens].astype(np.float32)
        scores = importance[t * tokens : (t + 1) * tokens].astype(np.float32)
        index = np.arange(tokens)
        for step in chosen.steps:
            target = tile_target(tokens, step)
            unit_grid = whole if len(index) == tokens else None  # a grid until a step cuts it
            feats, scores, rows = _apply(step.method, feats, scores, target, seed + t, unit_grid)
            index = index[rows]
        out.append(feats.astype(features.dtype, copy=False))
        kept.append(index + t * tokens)
    return np.concatenate(out), Kept(features.shape[0], np.concatenate(kept))


def compress_by_rule(
    rule: PreprocessRule,
    shape: tuple[int, ...],
    features: np.ndarray,
    importance: np.ndarray,
    chosen: Profile,
    seed: int = 0,
) -> tuple[np.ndarray, Kept | None]:
    """`compress_item` on an item of (checked) `shape`, unit by unit as `rule` lays its
    tokens out: what `item_tokens` counted at admission."""
    units = layout(rule, shape)
    return compress_item(features, importance, units.num_units, chosen, seed, units.grid)


def apply(
    method: str,
    feats: np.ndarray,
    scores: np.ndarray,
    target: int,
    seed: int = 0,
    grid: Grid | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One method on one unit; returns (features, their importance) with `target` rows or fewer
    (`pool`: its windows, whatever the target). `grid` as in `visual_tokens`."""
    feats, scores, _ = _apply(method, feats, scores, target, seed, _grid(len(feats), grid))
    return feats, scores


def _grid(tokens: int, grid: Grid | None) -> Grid | None:
    """The unit's grid: the one given, else the square of `tokens` if it is one."""
    if grid is not None:
        return grid
    side = math.isqrt(tokens)
    return (side, side) if side * side == tokens else None


def _apply(
    method: str, feats: np.ndarray, scores: np.ndarray, target: int, seed: int, grid: Grid | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`apply`, plus the input row each output row stands for (increasing)."""
    n = feats.shape[0]
    if method == "pool":
        return _pool(feats, scores, grid)
    if target >= n:
        return feats, scores, np.arange(n)
    if method == "merge":
        return _merge(feats, scores, target)
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


def _pool(
    feats: np.ndarray, scores: np.ndarray, grid: Grid | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """2x2 windows over the (rows, cols) grid: features averaged, importance summed, each
    window named by its top-left token; a window at an odd edge holds what is left."""
    if grid is None or grid[0] * grid[1] != len(feats):
        return feats, scores, np.arange(len(feats))  # not a grid (a class token): leave it
    rows, cols = grid
    window = (np.arange(rows)[:, None] // 2) * -(-cols // 2) + np.arange(cols)[None, :] // 2
    window = window.reshape(-1)  # each token's window, windows row-major
    count = np.bincount(window).astype(np.float32)
    pooled = np.zeros((len(count), feats.shape[1]), dtype=np.float32)
    np.add.at(pooled, window, feats)
    pooled /= count[:, None]
    first = np.unique(window, return_index=True)[1]  # each window's top-left token, increasing
    return pooled, np.bincount(window, weights=scores).astype(np.float32), first

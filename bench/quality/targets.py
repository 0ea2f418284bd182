"""Dense training targets: per patch of the encoder's grid, what the renderer drew there and what
the object it belongs to is (shape kind, colour, the object's centre row and column, how many
shapes of its kind the scene holds; for text the patch's own digit, its place, and the whole
number's first and second digit), and the foreground the class token's attention (the
`attention` pruner's score) is taught to look at.

Object-level targets on every patch of an object make each visual token self-sufficient: a
token that survives pruning still says where its object is and how many of its kind there are.

They exist only during training: an auxiliary linear head reads them off the projected visual
tokens, and is thrown away with its loss; the checkpoint keeps the LLaVA layout. They give every
visual token a direct signal, so the tower learns what the answers need in minutes instead of
waiting for it to be discovered through the answer tokens alone.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench.quality import suite

# head name -> classes; class 0 is always "nothing here". `row`/`col` are sized for the
# finest grid a demo tower uses (16 px patches at 224 px).
_GRID_MAX = suite.SIZE // 16
HEADS = {
    "kind": len(suite.SHAPES) + 2,
    "colour": len(suite.COLOURS) + 1,
    "row": _GRID_MAX + 1,
    "col": _GRID_MAX + 1,
    "count": suite.MAX_COUNT + 1,
    "digit": 11,
    "order": 3,
    "first": 11,
    "second": 12,  # 1 = the number has no second digit
}
_COLOUR_INDEX = {c: i + 1 for i, c in enumerate(suite.COLOURS)}
_TEXT_KIND = len(suite.SHAPES) + 1
_H = {name: i for i, name in enumerate(HEADS)}


def _inside(part: suite.Part, cx: np.ndarray, cy: np.ndarray) -> np.ndarray:
    x0, y0, x1, y1 = part.box
    box = (cx >= x0) & (cx <= x1) & (cy >= y0) & (cy <= y1)
    if part.label == "circle":
        r = (x1 - x0) / 2
        return np.asarray(((cx - (x0 + r)) ** 2 + (cy - (y0 + r)) ** 2) <= r * r)
    if part.label == "triangle":
        return np.asarray(box & (np.abs(cx - (x0 + x1) / 2) <= (cy - y0) / 2))
    return box


_SUB = 4  # samples per patch side when measuring how much of a patch a part covers


def _covered(part: suite.Part, grid: int, patch: int) -> np.ndarray:
    """(grid, grid) bool: the patches a quarter or more covered by `part`, and always the one
    holding its centre, so that a part smaller than a patch still owns a token."""
    offsets = (np.arange(_SUB) + 0.5) * patch / _SUB
    points = (np.arange(grid)[:, None] * patch + offsets[None, :]).reshape(-1)
    cx, cy = np.meshgrid(points, points)
    share = _inside(part, cx, cy).reshape(grid, _SUB, grid, _SUB).mean(axis=(1, 3))
    out = share >= 0.25
    x, y = suite.centre(part)
    out[min(grid - 1, int(y // patch)), min(grid - 1, int(x // patch))] = True
    return out


def patch_targets(item: suite.Item, grid: int, patch: int) -> np.ndarray:
    """(grid * grid, len(HEADS)) class indices, raster order."""
    out = np.zeros((grid, grid, len(HEADS)), dtype=np.int64)
    kinds = [p.label for p in item.parts if not p.order]
    digits = sorted((p.order, int(p.label)) for p in item.parts if p.order)
    first = digits[0][1] + 1 if digits else 0
    second = digits[1][1] + 2 if len(digits) > 1 else 1
    for part in item.parts:
        hit = _covered(part, grid, patch)
        if part.order:  # a digit
            out[hit, _H["kind"]] = _TEXT_KIND
            out[hit, _H["digit"]] = int(part.label) + 1
            out[hit, _H["order"]] = part.order
            out[hit, _H["first"]], out[hit, _H["second"]] = first, second
        else:
            x0, y0, x1, y1 = part.box
            out[hit, _H["kind"]] = suite.SHAPES.index(part.label) + 1
            out[hit, _H["colour"]] = _COLOUR_INDEX[part.colour]
            out[hit, _H["row"]] = min(grid - 1, int((y0 + y1) / 2 // patch)) + 1
            out[hit, _H["col"]] = min(grid - 1, int((x0 + x1) / 2 // patch)) + 1
            out[hit, _H["count"]] = min(suite.MAX_COUNT, kinds.count(part.label))
    return out.reshape(grid * grid, len(HEADS))


def focus_mask(
    item: suite.Item, grid: int, patch: int, focus: tuple[int, ...] | None = None
) -> np.ndarray:
    """(grid * grid,) bool: the patches of what a question is about (the item's own unless
    `focus` names parts)."""
    out = np.zeros((grid, grid), dtype=bool)
    for i in item.focus if focus is None else focus:
        out |= _covered(item.parts[i], grid, patch)
    return out.reshape(-1)


def retrieval_loss(probs: torch.Tensor, relevant: torch.Tensor) -> torch.Tensor:
    """-log of the attention mass a probe head puts on the relevant keys (visual tokens, or a
    question's words), per query; queries with none (or none left after compression) are
    skipped."""
    has = relevant.any(-1)
    if not bool(has.any()):
        return probs.new_zeros(())
    mass = (probs * relevant.float()).sum(-1)
    return -torch.log(mass[has] + 1e-6).mean()


def _rms(x: torch.Tensor) -> torch.Tensor:
    """The read-outs see what they read through an RMS normalisation, as the decoder's next layer
    does: what a head can separate there, that layer's keys and values can too."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class DenseHead(nn.Module):
    """Training-only: per-token logits for every head."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, sum(HEADS.values()))
        self.accuracy: dict[str, float] = {}  # last batch, per head, over patches with a target

    def loss(self, feats: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.proj(_rms(feats)).split(list(HEADS.values()), dim=-1)
        total = feats.new_zeros(())
        for i, (name, head) in enumerate(zip(HEADS, logits, strict=True)):
            want = targets[..., i]
            flat, goal = head.reshape(-1, head.shape[-1]), want.reshape(-1)
            if name == "kind":  # what is here, background included: both sides weigh the same
                each = F.cross_entropy(flat, goal, reduction="none")
                fg = goal > 0
                parts = [each[m].mean() for m in (fg, ~fg) if bool(m.any())]
                total = total + torch.stack(parts).mean()
            elif bool((goal > 0).any()):  # what the object is: only where there is one
                total = total + F.cross_entropy(flat, goal, ignore_index=0)
            some = want > 0
            if bool(some.any()):
                self.accuracy[name] = float((head.argmax(-1) == want)[some].float().mean())
        return total / len(HEADS)


class RelationHead(nn.Module):
    """Training-only: at the second shape noun of a spatial question, from the decoder's hidden
    state there, whether the first shape lies left of the second, whether above it, and the
    question's answer (`RELATION` logits). Teaching these where both shapes are already named
    makes the decoder bring the first noun's position to the second (a hop the answer alone did
    not teach within the budget: spatial stayed at chance); the answer then copies one bit."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, len(RELATION))
        self.accuracy: dict[str, float] = {}  # last batch, per output, over defined targets

    def loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(N, H) hidden states, (N, len(RELATION)) targets in {0, 1}, NaN where undefined."""
        defined = ~torch.isnan(target)
        if not bool(defined.any()):
            return hidden.new_zeros(())
        logits = self.proj(_rms(hidden))
        goal = target.nan_to_num(0.0)
        for i, name in enumerate(RELATION):
            m = defined[:, i]
            if bool(m.any()):
                right = (logits[:, i] > 0) == (goal[:, i] > 0.5)
                self.accuracy[name] = float(right[m].float().mean())
        return F.binary_cross_entropy_with_logits(logits[defined], goal[defined])


RELATION = ("left", "above", "yes")  # first shape left of the second; above it; the answer
RELATION_MARGIN = 20  # pixels: closer than this along an axis, that axis' sign is not taught


def relation_target(item: suite.Item, q: suite.Question) -> list[float]:
    """A spatial question's `RelationHead` targets (1.0 / 0.0, NaN where the axis is too close)."""
    (ax, ay), (bx, by) = (suite.centre(item.parts[i]) for i in q.focus)
    signs = [
        float("nan") if abs(a - b) < RELATION_MARGIN else float(a < b)
        for a, b in ((ax, bx), (ay, by))
    ]
    return [*signs, float(q.answer == "yes")]


def importance_loss(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy from the class token's attention (renormalised over patches) to the uniform
    distribution over foreground patches."""
    fg = (targets[..., _H["kind"]] > 0).float()
    has = fg.sum(-1) > 0
    if not bool(has.any()):
        return scores.new_zeros(())
    p = scores / scores.sum(-1, keepdim=True).clamp_min(1e-9)
    t = fg / fg.sum(-1, keepdim=True).clamp_min(1)
    return -(t * torch.log(p + 1e-9)).sum(-1)[has].mean()

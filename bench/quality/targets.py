"""Dense training targets: per patch of the encoder's grid, what the renderer drew there (shape
kind, colour, object centre, digit and its place in the number), and the foreground the class
token's attention (the `attention` pruner's score) is taught to look at.

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

# head name -> classes; class 0 is always "nothing here".
HEADS = {
    "kind": len(suite.SHAPES) + 2,
    "colour": len(suite.COLOURS) + 1,
    "centre": 2,
    "digit": 11,
    "order": 3,
}
_COLOUR_INDEX = {c: i + 1 for i, c in enumerate(suite.COLOURS)}
_TEXT_KIND = len(suite.SHAPES) + 1


def _inside(part: suite.Part, cx: np.ndarray, cy: np.ndarray) -> np.ndarray:
    x0, y0, x1, y1 = part.box
    box = (cx >= x0) & (cx <= x1) & (cy >= y0) & (cy <= y1)
    if part.label == "circle":
        r = (x1 - x0) / 2
        return np.asarray(((cx - (x0 + r)) ** 2 + (cy - (y0 + r)) ** 2) <= r * r)
    if part.label == "triangle":
        return np.asarray(box & (np.abs(cx - (x0 + x1) / 2) <= (cy - y0) / 2))
    return box


def patch_targets(item: suite.Item, grid: int, patch: int) -> np.ndarray:
    """(grid * grid, len(HEADS)) class indices, raster order."""
    centres = (np.arange(grid) + 0.5) * patch
    cx, cy = np.meshgrid(centres, centres)
    out = np.zeros((grid, grid, len(HEADS)), dtype=np.int64)
    for part in item.parts:
        hit = _inside(part, cx, cy)
        if part.order:  # a digit
            out[hit, 0], out[hit, 3], out[hit, 4] = _TEXT_KIND, int(part.label) + 1, part.order
        else:
            out[hit, 0] = suite.SHAPES.index(part.label) + 1
            out[hit, 1] = _COLOUR_INDEX[part.colour]
            x0, y0, x1, y1 = part.box
            col = min(grid - 1, int((x0 + x1) / 2 // patch))
            row = min(grid - 1, int((y0 + y1) / 2 // patch))
            out[row, col, 2] = 1
    return out.reshape(grid * grid, len(HEADS))


def focus_mask(item: suite.Item, grid: int, patch: int) -> np.ndarray:
    """(grid * grid,) bool: the patches of what the question is about."""
    centres = (np.arange(grid) + 0.5) * patch
    cx, cy = np.meshgrid(centres, centres)
    out = np.zeros((grid, grid), dtype=bool)
    for i in item.focus:
        out |= _inside(item.parts[i], cx, cy)
    return out.reshape(-1)


def retrieval_loss(probs: torch.Tensor, relevant: torch.Tensor) -> torch.Tensor:
    """-log of the attention mass a probe head puts on the relevant visual tokens (rows with
    none left after compression are skipped)."""
    has = relevant.any(-1)
    if not bool(has.any()):
        return probs.new_zeros(())
    mass = (probs * relevant.float()).sum(-1)
    return -torch.log(mass[has] + 1e-6).mean()


class DenseHead(nn.Module):
    """Training-only: per-token logits for every head."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, sum(HEADS.values()))

    def loss(self, feats: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Read through an RMS normalisation, as the decoder's first layer reads the tokens: what
        # the head can separate, the decoder's keys and values can too.
        normed = feats * torch.rsqrt(feats.pow(2).mean(-1, keepdim=True) + 1e-6)
        logits = self.proj(normed).split(list(HEADS.values()), dim=-1)
        total = feats.new_zeros(())
        for i, head in enumerate(logits):
            total = total + F.cross_entropy(
                head.reshape(-1, head.shape[-1]), targets[..., i].reshape(-1)
            )
        return total / len(HEADS)


def importance_loss(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy from the class token's attention (renormalised over patches) to the uniform
    distribution over foreground patches."""
    fg = (targets[..., 0] > 0).float()
    has = fg.sum(-1) > 0
    if not bool(has.any()):
        return scores.new_zeros(())
    p = scores / scores.sum(-1, keepdim=True).clamp_min(1e-9)
    t = fg / fg.sum(-1, keepdim=True).clamp_min(1)
    return -(t * torch.log(p + 1e-9)).sum(-1)[has].mean()

"""The demo model's training on the resolution scenarios (`suite.DETAIL`): every image goes
through the gateway's own grid choice (`gateway.tiling.grid_for`, at a detail level drawn per
item) and tiling (`gateway.decode.preprocess`), so a row holds as many visual tokens as the engine
would give that request: one tile, or a thumbnail and the grid's cells, per image.

The loss is the answer's tokens and end-of-sequence, as in `bench.quality.train`, plus the dense
per-patch targets (`bench.quality.targets`) on the cells of a `fine_detail` grid: those cells show
its small digits at full size, one per token, and the tower learns to read them there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from bench.quality import suite, targets
from core.model.llava import Llava
from core.model.tokenizer import ChatTokenizer, ChatTurn
from gateway import decode, tiling

IGNORE = -100
LEVELS = ("low", "auto", "high")
LEVEL_SHARE = (0.2, 0.5, 0.3)  # how often a training item is shown at each detail level
MAX_TILES = 6  # `[limits] max_tiles`' default: the grids the gateway would lay out


def tiles(
    img: Image.Image, detail: str, question: str, size: int, fill: tuple[int, int, int]
) -> tuple[np.ndarray, tiling.Grid]:
    """(tiles, 3, size, size) uint8 as the gateway sends this image at `detail`, and its grid."""
    grid = tiling.grid_for(detail, *img.size, tiling.Budget(size, MAX_TILES), question)
    spec = decode.Spec("PNG", size, fill, grid.rows, grid.cols, (0,), 1 << 26, 1 << 14)
    return decode.preprocess(img, spec), grid


def cell_targets(it: suite.Item, grid: tiling.Grid, size: int, patch: int) -> np.ndarray:
    """(cells, tokens, heads) dense targets for the cells of a scale-1 grid over `it.image`
    (the grid's cells are crops of the image itself when it is exactly `grid` tiles large)."""
    side = size // patch
    out = []
    for r in range(grid.rows):
        for c in range(grid.cols):
            dx, dy = c * size, r * size
            parts = tuple(
                dataclasses.replace(p, box=_shift(p.box, dx, dy))
                for p in it.parts
                if dx <= suite.centre(p)[0] < dx + size and dy <= suite.centre(p)[1] < dy + size
            )
            out.append(targets.patch_targets(dataclasses.replace(it, parts=parts), side, patch))
    return np.stack(out)


def _shift(box: tuple[int, int, int, int], dx: int, dy: int) -> tuple[int, int, int, int]:
    x0, y0, x1, y1 = box
    return x0 - dx, y0 - dy, x1 - dx, y1 - dy


def _level(rng: np.random.Generator) -> str:
    return str(LEVELS[int(rng.choice(len(LEVELS), p=LEVEL_SHARE))])


def _encode(
    model: Llava, items: list[suite.Item], rng: np.random.Generator
) -> tuple[torch.Tensor, list[list[int]], list[tuple[int, np.ndarray]]]:
    """Every image's tiles through the tower: (tiles, tokens, hidden), the visual tokens per
    image of each row, and (first tile, targets) for each fine_detail grid's cells."""
    vc = model.cfg.vision
    r, g, b = (round(m * 255) for m in model.cfg.image_mean[:3])
    stacks, counts, dense = [], [], []
    at = 0
    for it in items:
        detail, row = _level(rng), []
        for img in it.images:
            t, grid = tiles(img, detail, it.question, vc.image_size, (r, g, b))
            if (
                it.scenario == "fine_detail"
                and grid.num_tiles > 1
                and img.size
                == (
                    grid.cols * vc.image_size,
                    grid.rows * vc.image_size,
                )
            ):
                dense.append((at + 1, cell_targets(it, grid, vc.image_size, vc.patch_size)))
            stacks.append(t)
            row.append(len(t) * (vc.image_size // vc.patch_size) ** 2)
            at += len(t)
        counts.append(row)
    pixels = torch.from_numpy(np.concatenate(stacks))
    feats, _ = model.encode_with_importance(model.normalize(pixels))
    return feats, counts, dense


def _rows(
    tok: ChatTokenizer, items: list[suite.Item], counts: list[list[int]], eos: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and labels: the engine's prompt for the item's question with its
    images, then the answer and eos (the only labelled tokens)."""
    rows, labels = [], []
    for it, row in zip(items, counts, strict=True):
        prompt = tok.encode_chat([ChatTurn("user", it.question, len(it.images))], row)
        answer = [*tok.tok.encode(" " + it.answer, add_special_tokens=False).ids, eos]
        rows.append(prompt + answer)
        labels.append([IGNORE] * len(prompt) + answer)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    lab = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)], lab[i, : len(lb)] = torch.tensor(r), torch.tensor(lb)
    return ids, lab


def detail_loss(
    model: Llava,
    head: targets.DenseHead,
    tok: ChatTokenizer,
    items: list[suite.Item],
    rng: np.random.Generator,
    dense_weight: float,
    pad: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's loss and, per item, whether every answer token was the argmax."""
    from bench.quality.train import decoder_logits

    feats, counts, dense = _encode(model, items, rng)
    aux = feats.new_zeros(())
    if dense:
        chosen = torch.cat([feats[at : at + len(t)] for at, t in dense])
        goal = torch.from_numpy(np.concatenate([t for _, t in dense]))
        aux = dense_weight * head.loss(chosen, goal)
    eos = model.cfg.text.eos_token_id[0]
    ids, labels = _rows(tok, items, counts, eos, pad)
    is_image = ids == model.cfg.image_token_id
    embeds = model.language_model.embed_tokens(ids.masked_fill(is_image, 0))
    visual = feats.reshape(-1, feats.shape[-1]).to(embeds.dtype)
    embeds = embeds.masked_scatter(is_image[..., None], visual)
    logits, _, _ = decoder_logits(model, embeds)
    logits, target = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE
    )
    hit = (logits.argmax(-1) == target) | (target == IGNORE)
    return loss + aux, hit.all(dim=1)

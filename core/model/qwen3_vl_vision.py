"""Qwen3-VL's native-resolution vision transformer: uint8 frames in, merged visual tokens and
the deepstack features out.

Against Qwen2.5-VL's (whose patchify, 2-D rope and attention this reuses): 16-px patches with a
bias, a learned square position table resized bilinearly (corners aligned) to each frame's patch
grid, LayerNorm blocks with a plain two-layer MLP, every block attending over its whole frame
(no windows), and `deepstack_visual_indexes`: the states after those blocks, each merged by its
own merger, are the features the decoder adds to its hidden states after its first layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.model.layers import activation
from core.model.qwen2_5_vl_vision import (
    Grid,
    PatchEmbed,
    VisionBlock,
    axial_inv_freq,
    axial_rope,
    patch_positions,
)


@dataclass(frozen=True, slots=True)
class Qwen3VisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int  # blocks
    num_heads: int
    patch_size: int  # pixels per patch side (16)
    temporal_patch_size: int  # frames per patch (2: an image is its frame twice)
    spatial_merge_size: int  # patches per merged token side (2)
    out_hidden_size: int  # the decoder's hidden size
    hidden_act: str
    rope_theta: float
    num_position_embeddings: int  # rows of the learned position table (a square grid)
    deepstack_visual_indexes: tuple[int, ...]  # blocks whose output feeds the decoder's layers

    @property
    def merge_pixels(self) -> int:
        """Side in pixels of one merged visual token (32): images are resized to multiples."""
        return self.patch_size * self.spatial_merge_size

    @property
    def position_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)


class VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """2x2 patches -> one decoder token. The main merger normalises each patch before the
    merge; the deepstack mergers (`after_merge`) normalise the merged row."""

    def __init__(self, cfg: Qwen3VisionConfig, after_merge: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.after_merge = after_merge
        self.norm = nn.LayerNorm(self.width if after_merge else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.after_merge else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


class Qwen3VisionTransformer(nn.Module):
    """`visual` of a Qwen3-VL checkpoint."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, cfg.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(
            VisionBlock(
                cfg.hidden_size,
                cfg.num_heads,
                lambda: nn.LayerNorm(cfg.hidden_size, eps=1e-6),
                VisionMLP(cfg),
            )
            for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(cfg, after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, after_merge=True) for _ in cfg.deepstack_visual_indexes
        )
        self.reset_buffers()

    def reset_buffers(self) -> None:
        inv_freq = axial_inv_freq(self.cfg.hidden_size // self.cfg.num_heads, self.cfg.rope_theta)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def positions(self, grid: Grid) -> torch.Tensor:
        """The learned position table resized to the frame's patch grid (bilinear, corners
        aligned: the table's corners land on the frame's corner patches), in `patchify`'s order,
        once per temporal patch: (patches, hidden)."""
        t, h, w = grid
        m, side, hidden = self.cfg.spatial_merge_size, self.cfg.position_side, self.cfg.hidden_size
        table = self.pos_embed.weight.t().reshape(1, hidden, side, side)
        frame = F.interpolate(table, size=(h * m, w * m), mode="bilinear", align_corners=True)
        frame = frame[0].view(hidden, h, m, w, m).permute(1, 3, 2, 4, 0).reshape(-1, hidden)
        return frame.repeat(t, 1)

    def forward(self, patches: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patches of one image or video (`patchify`) -> (merged tokens, out_hidden_size) and
        one (merged tokens, out_hidden_size) tensor per deepstack block."""
        cfg = self.cfg
        t, h, w = grid
        x = self.patch_embed(patches)
        x = x + self.positions(grid).to(x.dtype)
        pos = patch_positions(grid, cfg.spatial_merge_size).to(patches.device)
        rope = axial_rope(pos, self.inv_freq)
        frames = [h * w * cfg.spatial_merge_size**2] * t  # each frame attends over itself
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames)
            if i in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack

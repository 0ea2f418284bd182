"""Qwen2.5-VL's native-resolution vision transformer: uint8 frames in, merged visual tokens out.

The core patchifies (the gateway sends plain resized uint8 images, never patches) in the exact
flatten order of transformers' Qwen2-VL processors: per 2x2 merge block, per patch in it,
channels x temporal pair x 14 x 14. Blocks attend inside windows of `window_size` pixels except
the `fullatt_block_indexes` ones, which attend over the whole frame; rotary positions are 2-D
(row, column of each patch). Each merged token's importance (for compression) is the attention its
patches receive in the last full-attention block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from core.model.layers import activation
from core.model.text import RMSNorm, _rotate


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int  # blocks
    num_heads: int
    patch_size: int  # pixels per patch side (14)
    temporal_patch_size: int  # frames per patch (2: an image is its frame twice)
    spatial_merge_size: int  # patches per merged token side (2)
    window_size: int  # window side in pixels for the windowed blocks
    fullatt_block_indexes: tuple[int, ...]  # blocks that attend over the whole frame
    out_hidden_size: int  # the decoder's hidden size
    hidden_act: str
    rope_theta: float
    tokens_per_second: float  # temporal rope positions per second of video

    @property
    def merge_pixels(self) -> int:
        """Side in pixels of one merged visual token (28): images are resized to multiples."""
        return self.patch_size * self.spatial_merge_size


Grid = tuple[int, int, int]  # (t, h, w) in merged-token units


class PatchGeometry(Protocol):
    """What `patchify` needs of a vision config (Qwen2.5-VL's and Qwen3-VL's both have it)."""

    @property
    def patch_size(self) -> int: ...
    @property
    def temporal_patch_size(self) -> int: ...
    @property
    def spatial_merge_size(self) -> int: ...


def patchify(frames: torch.Tensor, cfg: PatchGeometry) -> tuple[torch.Tensor, Grid]:
    """(T, 3, H, W) normalised frames -> (patches, 3 * temporal * patch * patch) rows in the
    processor's order, and the grid in merged units. An image (T = 1) is its frame repeated, an
    odd video its last frame repeated, to fill the temporal pairs (as the processors do)."""
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.spatial_merge_size
    num, c, height, width = frames.shape
    if num % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - num % tp, -1, -1, -1)])
    gt, gh, gw = frames.shape[0] // tp, height // (p * m), width // (p * m)
    x = frames.reshape(gt, tp, c, gh, m, p, gw, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, bh, bw, mh, mw, c, tp, ph, pw)
    return x.reshape(gt * gh * gw * m * m, c * tp * p * p), (gt, gh, gw)


def patch_positions(grid: Grid, merge: int) -> torch.Tensor:
    """(patches, 2) row and column of each patch, in `patchify`'s order."""
    t, h, w = grid
    rows = torch.arange(h * merge).view(h, merge, 1, 1).expand(h, merge, w, merge)
    cols = torch.arange(w * merge).view(1, 1, w, merge).expand(h, merge, w, merge)
    # patchify's order is (bh, bw, mh, mw): swap the merge axis of rows and block axis of cols.
    pos = torch.stack([rows.transpose(1, 2), cols.transpose(1, 2)], dim=-1).reshape(-1, 2)
    return pos.repeat(t, 1)


def window_order(grid: Grid, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens reordered window by window (row-major windows of `window` x `window`
    merged tokens per frame, cut short at the right and bottom edges), and each window's size."""
    t, h, w = grid
    index = torch.arange(t * h * w).view(t, h, w)
    order, sizes = [], []
    for top in range(0, h, window):
        for left in range(0, w, window):
            block = index[:, top : top + window, left : left + window].reshape(t, -1)
            order.append(block)
            sizes.append(block.shape[1])
    # Frame-major: a frame's windows are contiguous, so windows never span frames.
    return torch.cat(order, dim=1).flatten(), sizes * t


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sizes: list[int]
) -> torch.Tensor:
    """Attention of (heads, tokens, dim) q/k/v inside consecutive segments of `sizes` tokens,
    one SDPA call per distinct segment size (windows come in at most four sizes)."""
    starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    lengths = torch.tensor(sizes)
    qkv = torch.stack([q, k, v])  # (3, heads, tokens, dim)
    heads, dim = q.shape[0], q.shape[2]
    out = torch.empty_like(q)
    for size in sorted(set(sizes)):
        index = (starts[lengths == size][:, None] + torch.arange(size)).flatten().to(q.device)
        segs = qkv.index_select(2, index).view(3, heads, -1, size, dim).transpose(1, 2)
        res = F.scaled_dot_product_attention(segs[0], segs[1], segs[2])  # (segments, heads, ..)
        out.index_copy_(1, index, res.transpose(0, 1).reshape(heads, -1, dim))
    return out


def received_attention(
    q: torch.Tensor, k: torch.Tensor, sizes: list[int], max_scores: int = 1 << 24
) -> torch.Tensor:
    """(tokens,) float32: the attention each token receives from the queries of its segment,
    averaged over heads and queries, for (heads, tokens, dim) q and k; queries go in chunks so
    that at most `max_scores` scores exist at once (a large frame's full matrix would not fit)."""
    heads, tokens, dim = q.shape
    out = torch.empty(tokens, dtype=torch.float32, device=q.device)
    start = 0
    for size in sizes:
        keys = k[:, start : start + size].float().transpose(1, 2) * dim**-0.5
        total = torch.zeros(size, dtype=torch.float32, device=q.device)
        step = max(1, max_scores // (heads * size))
        for first in range(start, start + size, step):
            last = min(first + step, start + size)
            total += torch.softmax(q[:, first:last].float() @ keys, dim=-1).sum(dim=(0, 1))
        out[start : start + size] = total / (heads * size)
        start += size
    return out


def axial_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Rows and columns rotate half of the head each (axial 2-D rope)."""
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))


def axial_rope(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches, 2) rows and columns -> cos, sin (patches, head_dim): row frequencies, then
    column frequencies, twice (the rotation pairs dimension i with i + head_dim / 2)."""
    freqs = (positions[..., None].float() * inv_freq).flatten(1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], sizes: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self._qkv(x, rope)
        return self.proj(segment_attention(q, k, v, sizes).transpose(0, 1).reshape(n, -1))

    def received(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], sizes: list[int]
    ) -> torch.Tensor:
        """(tokens,) the attention each token of (normed) `x` receives (`received_attention`)."""
        q, k, _ = self._qkv(x, rope)
        return received_attention(q, k, sizes)

    def _qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(heads, tokens, dim) q, k (rotated) and v."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).permute(1, 2, 0, 3).unbind(0)
        cos, sin = rope
        q, k = _rotate(q.float(), cos, sin).to(x.dtype), _rotate(k.float(), cos, sin).to(x.dtype)
        return q, k, v


class VisionMLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, i), nn.Linear(h, i)
        self.down_proj = nn.Linear(i, h)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """A pre-norm ViT block: Qwen2.5-VL's norms are RMSNorm and its MLP gated; Qwen3-VL's are
    LayerNorm and a plain two-layer MLP."""

    def __init__(
        self, hidden_size: int, num_heads: int, norm: Callable[[], nn.Module], mlp: nn.Module
    ) -> None:
        super().__init__()
        self.norm1 = norm()
        self.attn = VisionAttention(hidden_size, num_heads)
        self.norm2 = norm()
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], sizes: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, sizes)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: PatchGeometry, hidden_size: int, bias: bool) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(3, hidden_size, kernel, kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # A stride-equals-kernel convolution over one patch per row is one GEMM.
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.flatten(1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.out_hidden_size)
        )
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTransformer(nn.Module):
    """`visual` of a Qwen2.5-VL checkpoint."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, cfg.hidden_size, bias=False)
        self.blocks = nn.ModuleList(
            VisionBlock(
                cfg.hidden_size,
                cfg.num_heads,
                lambda: RMSNorm(cfg.hidden_size, 1e-6),
                VisionMLP(cfg),
            )
            for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(cfg)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        inv_freq = axial_inv_freq(self.cfg.hidden_size // self.cfg.num_heads, self.cfg.rope_theta)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return axial_rope(positions, self.inv_freq)

    def forward(self, patches: torch.Tensor, grid: Grid) -> torch.Tensor:
        """Patches of one image or video (`patchify`) -> (merged tokens, out_hidden_size)."""
        return self.forward_with_importance(patches, grid, importance=False)[0]

    def forward_with_importance(
        self, patches: torch.Tensor, grid: Grid, importance: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and each merged token's importance: the mean attention its patches
        receive in the last full-attention block (the last block if none is), where every
        patch of a frame sees every other, as SigLIP's last layer ranks Gemma's tokens."""
        cfg, unit = self.cfg, self.cfg.spatial_merge_size**2
        t, h, w = grid
        order, windows = window_order(grid, cfg.window_size // cfg.merge_pixels)
        order = order.to(patches.device)
        # Whole merge blocks move together: reorder (tokens, unit, ...) rows by window.
        x = self.patch_embed(patches).view(-1, unit, cfg.hidden_size)[order].flatten(0, 1)
        pos = patch_positions(grid, cfg.spatial_merge_size).to(patches.device)
        cos, sin = self.rope(pos.view(-1, unit, 2)[order].flatten(0, 1))
        window_sizes = [s * unit for s in windows]
        frame_sizes = [h * w * unit] * t
        depth = len(self.blocks)
        ranked = max((i for i in cfg.fullatt_block_indexes if i < depth), default=depth - 1)
        scores = None
        for i, block in enumerate(self.blocks):
            sizes = frame_sizes if i in cfg.fullatt_block_indexes else window_sizes
            if importance and i == ranked:
                assert isinstance(block, VisionBlock)
                scores = block.attn.received(block.norm1(x), (cos, sin), sizes)
            x = block(x, (cos, sin), sizes)
        back = torch.argsort(order)
        merged = self.merger(x)[back]
        return merged, None if scores is None else scores.view(-1, unit).mean(dim=1)[back]

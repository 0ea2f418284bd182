"""One forward step over many sequences with a paged KV cache.

The linear layers (projections, MLP, lm_head) run over every new token of every sequence in the
step; attention runs per sequence over the keys and values gathered from its blocks.

Batch invariance: a BLAS GEMM may round a row differently depending on how many rows it is given
(measured with MKL here: M = 1..3, and with two threads also 5..7 and 9..11, differ from larger M
at ~1e-7), which is enough to flip a greedy argmax now and then. So a linear layer never runs on
fewer than `TILE` rows (zero-padded up to it), and above that in one call only where
`exact_rows` has checked, for that weight's shape on this machine, that every row comes out the
same at any row count; elsewhere it runs on fixed `TILE`-row tiles. Attention runs per query tile
aligned to absolute positions. So a token's numbers depend on its own sequence only: not on its
batch-mates, not on how its prefill was chunked, and not on whether its prefix came from the
cache. The scheduler keeps prefill chunks on `TILE` boundaries for this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.model.llava import Llava
from core.model.text import Attention, DecoderLayer, _rotate

TILE = 16  # rows per GEMM call and queries per attention call


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step."""

    start: int  # tokens already in the cache (position of the first new token)
    num_tokens: int  # new tokens run this step
    blocks: torch.Tensor  # long: the blocks holding positions 0..start + num_tokens - 1, in order
    need_logits: bool  # the last new token is the sequence's newest: sample after it


class PagedKV:
    """Key and value storage, in the model's dtype on its device: per layer a (kv_heads,
    num_blocks, block_size, head_dim) tensor, heads first so that gathering a sequence's blocks
    yields the (kv_heads, ctx, head_dim) layout attention reads in one copy. The KV-cache manager
    decides who owns which block."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        shape = (kv_heads, num_blocks, block_size, head_dim)
        self.block_size = block_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """Keys and values of one block over every layer, in the model's dtype."""
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, chunks: list[SeqChunk], k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores the new tokens' (kv_heads, tokens, head_dim) keys and values at their slots."""
        size = self.block_size
        slots = []
        for c in chunks:
            pos = torch.arange(c.start, c.start + c.num_tokens)
            slots.append(c.blocks[pos // size] * size + pos % size)
        new = torch.cat(slots)
        for store, x in ((self.keys[layer], k), (self.values[layer], v)):
            store.view(store.shape[0], -1, store.shape[3]).index_copy_(1, new, x)

    def read(self, layer: int, c: SeqChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_heads, ctx, head_dim) keys and values of positions 0..ctx-1 of `c`'s sequence."""
        ctx = c.start + c.num_tokens
        blocks = c.blocks[: -(-ctx // self.block_size)]
        out = []
        for store in (self.keys[layer], self.values[layer]):
            gathered = torch.index_select(store, 1, blocks)  # several times faster than [:, ]
            out.append(gathered.view(store.shape[0], -1, store.shape[3])[:, :ctx])
        return out[0], out[1]


def _positions(chunks: list[SeqChunk]) -> torch.Tensor:
    return torch.cat([torch.arange(c.start, c.start + c.num_tokens) for c in chunks])


_EXACT: dict[tuple[int, int, int], bool] = {}  # (out, in, threads) -> rows independent of M


def exact_rows(weight: torch.Tensor) -> bool:
    """Whether `F.linear` with this weight's shape gives every row bit for bit the same result
    at any row count from `TILE` up, here (BLAS library, CPU, thread count): checked once per
    shape on random rows at a few counts that cover the GEMM's blocking, against `TILE`-row
    tiles."""
    key = (*weight.shape, torch.get_num_threads())
    if key not in _EXACT:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(65 * TILE, weight.shape[1], generator=gen)
        w = torch.randn(weight.shape, generator=gen)
        ref = torch.cat([F.linear(t, w) for t in torch.split(x, TILE)])
        _EXACT[key] = all(
            torch.equal(F.linear(x[:m], w), ref[:m]) for m in (TILE + 1, 100, 333, x.shape[0])
        )
    return _EXACT[key]


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` such that each row's result is the same whatever else is in `x`: at least
    `TILE` rows (zero-padded), in one call where `exact_rows` allows, else on `TILE`-row tiles."""
    rows = x.shape[0]
    if rows < TILE:
        x = torch.cat([x, x.new_zeros(TILE - rows, x.shape[1])])
        return F.linear(x, layer.weight, layer.bias)[:rows]
    if exact_rows(layer.weight):
        return F.linear(x, layer.weight, layer.bias)
    pad = (-rows) % TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([F.linear(t, layer.weight, layer.bias) for t in torch.split(x, TILE)])
    return out[:rows]


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, enable_gqa: bool
) -> torch.Tensor:
    """Causal attention of queries at positions start.. (heads, n, dim) over keys (kv, ctx, dim),
    one SDPA call per query tile [k*TILE, (k+1)*TILE) of absolute positions."""
    n = q.shape[1]
    outs = []
    pos = start
    while pos < start + n:
        end = min(start + n, (pos // TILE + 1) * TILE)
        mask = None
        if end - pos > 1:
            # Query i sits at position pos+i and sees keys 0..pos+i.
            mask = torch.ones(end - pos, end, dtype=torch.bool).tril(diagonal=pos)
        out = F.scaled_dot_product_attention(
            q[None, :, pos - start : end - start],
            keys[None, :, :end],
            values[None, :, :end],
            attn_mask=mask,
            enable_gqa=enable_gqa,
        )
        outs.append(out[0])
        pos = end
    return torch.cat(outs, dim=1)


def _attention(
    attn: Attention,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    chunks: list[SeqChunk],
    kv: PagedKV,
    layer: int,
) -> torch.Tensor:
    total = x.shape[0]
    cos, sin = rope
    q = linear(attn.q_proj, x).view(total, attn.num_heads, attn.head_dim).transpose(0, 1)
    k = linear(attn.k_proj, x).view(total, attn.num_kv, attn.head_dim).transpose(0, 1)
    v = linear(attn.v_proj, x).view(total, attn.num_kv, attn.head_dim).transpose(0, 1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    kv.write(layer, chunks, k, v)
    outs, offset = [], 0
    for c in chunks:
        n = c.num_tokens
        keys, values = kv.read(layer, c)
        gqa = attn.num_kv != attn.num_heads
        out = _attend(q[:, offset : offset + n], keys, values, c.start, gqa)
        outs.append(out.transpose(0, 1).reshape(n, -1))
        offset += n
    return linear(attn.o_proj, torch.cat(outs))


def _layer(
    block: DecoderLayer,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    chunks: list[SeqChunk],
    kv: PagedKV,
    layer: int,
) -> torch.Tensor:
    x = x + _attention(block.self_attn, block.input_layernorm(x), rope, chunks, kv, layer)
    h = block.post_attention_layernorm(x)
    mlp = block.mlp
    return x + linear(mlp.down_proj, F.silu(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))


@torch.inference_mode()
def forward(
    model: Llava, embeds: torch.Tensor, chunks: list[SeqChunk], kv: PagedKV
) -> torch.Tensor:
    """Runs the new tokens of every chunk (embeds concatenated in chunk order); returns the
    float32 logits of the last token of each chunk with `need_logits`, in chunk order."""
    decoder = model.language_model
    rope = decoder.rotary(_positions(chunks))
    x = embeds
    for i, block in enumerate(decoder.layers):
        x = _layer(block, x, rope, chunks, kv, i)  # type: ignore[arg-type]
    ends, offset = [], 0
    for c in chunks:
        offset += c.num_tokens
        if c.need_logits:
            ends.append(offset - 1)
    if not ends:
        return torch.empty(0, model.cfg.text.vocab_size)
    return linear(model.lm_head, decoder.norm(x[torch.tensor(ends)])).float()

"""One forward step over many sequences with a paged KV cache, for any model family.

The new tokens of every sequence in the step (decodes and prefill chunks alike) run together
through every linear layer. What the step indexes with (rope positions, the slots the new keys go
to, the keys each query sees, the rows to sample from) is built once per step by `step_metadata`
and copied to the model's device in one transfer. The model's layers do their own norms,
projections and rotary (`forward_paged`); this module caches their keys and masks attention.

A token has a sequence index (start + i: its KV slot, and what masks compare) and a rope position
(the index for 1-D rope; a chunk may bring its own, e.g. (t, h, w) rows for multimodal rope). A
query at index i sees keys j <= i and, for a model that sees images both ways, every key of the
image it sits in; a sliding layer then keeps those within its window (j > i - window), image keys
included, as Gemma 3 masks: AND(window, OR(causal, image)). No chunk may end inside such an image
(the scheduler keeps to that), so all of its keys exist when its queries run.

Two modes. Fast (`batch_invariant=False`): linear layers run unpadded in one call, and attention
is packed: the rows of queries (each a decode, a prefill chunk, or a `TILE`-query tile of one,
whichever costs less) are padded to a common shape and run as one SDPA call over keys gathered
from the blocks by slot, masked; one-query rows (decodes) get their own call so that they never
pay for a prefill's padding. So at most two attention calls per layer, whatever the batch.

Batch-invariant (`batch_invariant=True`): a sequence's logits are bit for bit the same alone and
batched, with its prefill whole or chunked, and with its prefix from the cache or not
(tests/core/test_paged.py). A BLAS GEMM may round a row differently depending on how many rows it
is given (measured with MKL here: M = 1..3, and with two threads also 5..7 and 9..11, differ from
larger M at ~1e-7), which is enough to flip a greedy argmax now and then. So a linear layer never
runs on fewer than `TILE` rows (zero-padded up to it), and above that in one call only where
`exact_rows` has checked, for that weight's shape on this machine, that every row comes out the
same at any row count; elsewhere it runs on fixed `TILE`-row tiles. The packed attention call is
not invariant (CPU flash attention rounds a row differently with more padded keys, and a
one-query row differently with more rows at two threads: measured), so this mode runs attention
per sequence per query tile aligned to absolute positions, over exactly the tile's keys. The
scheduler keeps prefill chunks on `TILE` boundaries for this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from core.model.family import Attend, VisionLanguageModel, paged_layers, sliding_windows

TILE = 16  # rows per GEMM call and queries per attention row
# Rows up to which a compiled CPU step writes its GEMMs as reductions (see `linear`).
REDUCTION_ROWS = 4
REDUCTION_STREAMS = 2  # pieces such a GEMM's weight rows are cut into (see `linear`)
Spans = tuple[tuple[int, int], ...]  # sequence-index [start, end) of each image


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step. Its tokens sit at sequence indices start..start+n-1: the
    KV slots and the masks use those; only rotary embeddings use `positions`."""

    start: int  # tokens already in the cache (sequence index of the first new token)
    num_tokens: int  # new tokens run this step
    blocks: torch.Tensor  # long: the blocks holding indices 0..start + num_tokens - 1, in order
    need_logits: bool  # the last new token is the sequence's newest: sample after it
    positions: torch.Tensor | None = None  # (n,) or (3, n) rope positions; None = the indices
    spans: Spans = ()  # the request's images, seen both ways (only for a bidirectional model)


@dataclass(frozen=True, slots=True)
class AttentionRows:
    """One batched SDPA call: each row is a run of one sequence's queries (padded to
    `row_queries`) over the keys of its indices 0..`row_keys`-1 (padded, masked)."""

    query_index: torch.Tensor  # (rows * row_queries,) new token feeding each query slot
    key_blocks: torch.Tensor  # (rows * row_keys / block_size,) block of each key (0 = padding)
    masks: dict[int | None, torch.Tensor]  # per sliding window (None = global) of the step's
    # layers, (rows, 1, row_queries, row_keys) bool: the keys each query sees
    num_rows: int  # rows in the call
    row_queries: int  # queries per row, padded
    row_keys: int  # keys per row: the call's longest row's blocks (block-granular gathers are
    # ~2x faster than slot-granular ones here)


@dataclass(frozen=True, slots=True)
class SequenceKeys:
    """Batch-invariant mode: one chunk's queries and the blocks of its keys."""

    start: int  # sequence index of its first new token
    num_tokens: int  # new tokens
    blocks: torch.Tensor  # the blocks of indices 0..end-1 (end: its last key, images included)
    spans: Spans  # images seen both ways; () when the model is causal


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Everything a step's forward pass indexes with, on the model's device."""

    positions: torch.Tensor  # (tokens,) or (3, tokens) rope position of each new token
    slot_mapping: torch.Tensor  # (tokens,) flat KV slot (block * block_size + offset) it fills
    logits_indices: torch.Tensor  # (sampled,) new tokens whose logits are returned, in order
    # Fast mode: the packed attention calls (one-query rows, then the longer rows), and where
    # each token's output sits in their outputs, concatenated. Empty when batch-invariant.
    attention: tuple[AttentionRows, ...]
    output_index: torch.Tensor  # (tokens,)
    # Batch-invariant mode: per chunk, its queries and keys.
    sequences: tuple[SequenceKeys, ...]


class PagedKV:
    """Key and value storage, in the model's dtype on its device: per layer a (kv_heads,
    num_blocks, block_size, head_dim) tensor, heads first so that gathering a sequence's blocks
    yields the (kv_heads, keys, head_dim) layout attention reads in one copy. The KV-cache manager
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

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as (kv_heads, slots, head_dim) views."""
        k, v = self.keys[layer], self.values[layer]
        return k.view(k.shape[0], -1, k.shape[3]), v.view(v.shape[0], -1, v.shape[3])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores the new tokens' (kv_heads, tokens, head_dim) keys and values at `slots`."""
        for store, x in zip(self.flat(layer), (k, v), strict=True):
            store.index_copy_(1, slots, x)


def _rows(chunks: list[SeqChunk], size: int) -> torch.Tensor:
    """(chunk, first position, tokens, offset of its first token in the step) per attention row:
    each chunk cut at multiples of `size` of absolute position (0: not cut)."""
    rows, offset = [], 0
    for i, c in enumerate(chunks):
        pos, end = c.start, c.start + c.num_tokens
        while pos < end:
            stop = min(end, (pos // size + 1) * size) if size else end
            rows.append((i, pos, stop - pos, offset + pos - c.start))
            pos = stop
        offset += c.num_tokens
    return torch.tensor(rows).view(-1, 4)


def _cost(rows: torch.Tensor) -> int:
    """Rough cost of one SDPA call over `rows`: scores computed, plus the key gather (a gathered
    key costs about four scores here)."""
    if not rows.shape[0]:
        return 0
    ends = rows[:, 1] + rows[:, 2]
    return rows.shape[0] * int(ends.max()) * (int(rows[:, 2].max()) + 4)


def _split_rows(chunks: list[SeqChunk]) -> list[torch.Tensor]:
    """The packed attention rows: `TILE`-query tiles or whole chunks, whichever costs less, with
    one-query rows (decodes) apart so that a decode never pays for a prefill's padding."""
    rows, whole = _rows(chunks, TILE), _rows(chunks, 0)
    if _cost(whole[whole[:, 2] > 1]) <= _cost(rows[rows[:, 2] > 1]):
        rows = whole
    single = rows[:, 2] == 1
    return [r for r in (rows[single], rows[~single]) if r.shape[0]]


def _packed(
    chunks: list[SeqChunk],
    tables: torch.Tensor,
    block_size: int,
    tokens: int,
    spans: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
    """Host tensors of the packed attention calls: per call its query index, key blocks and
    query indices (and with `spans`, each query's image bounds), then the output index; and per
    call (rows, row_queries, row_keys). `spans`: (tokens,) lo and hi of the image holding each
    new token ((0, 0) outside one), whose keys a row then gathers too."""
    parts, shapes, base = [], [], 0
    output_index = torch.empty(tokens, dtype=torch.long)
    for rows in _split_rows(chunks):
        row_chunk, row_start, row_len, row_offset = rows.unbind(1)
        row_queries, row_end = int(row_len.max()), int((row_start + row_len).max())
        i = torch.arange(row_queries)
        valid = i < row_len[:, None]
        token = torch.where(valid, row_offset[:, None] + i, 0)  # padding reads token 0
        bounds = []
        if spans is not None:
            bounds = [torch.where(valid, b[token], 0).flatten() for b in spans]
            row_end = max(row_end, int(bounds[1].max()))
        row_blocks = -(-row_end // block_size)
        query_slot = torch.arange(rows.shape[0])[:, None] * row_queries + i
        output_index[token[valid]] = base + query_slot[valid]
        parts += [
            token.flatten(),
            tables[row_chunk, :row_blocks].flatten(),
            # Padded queries see a few more keys than their row's; their outputs are dropped.
            (row_start[:, None] + i).flatten(),
            *bounds,
        ]
        shapes.append((rows.shape[0], row_queries, row_blocks * block_size))
        base += rows.shape[0] * row_queries
    return [*parts, output_index], shapes


def rope_positions(chunks: list[SeqChunk], index: torch.Tensor) -> torch.Tensor:
    """The step's rope positions: each chunk's own, else its sequence indices; (3, tokens) as
    soon as one chunk has multimodal positions (a text token's t, h and w are its index)."""
    given = [c.positions for c in chunks]
    if all(p is None for p in given):
        return index
    width = max((p.shape[0] for p in given if p is not None and p.dim() == 2), default=0)
    parts = []
    for c, p in zip(chunks, given, strict=True):
        got = torch.arange(c.start, c.start + c.num_tokens) if p is None else p.long()
        parts.append(got.expand(width, -1) if width and got.dim() == 1 else got)
    return torch.cat(parts, dim=-1)


def _token_spans(chunks: list[SeqChunk], ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens,) lo and hi of the image holding each new token ((0, 0) outside one). A chunk may
    start inside an image (its first part cached), never end inside one: its later keys would
    not exist yet."""
    lo, hi = [], []
    for c, end in zip(chunks, ends, strict=True):
        index = torch.arange(c.start, end)
        c_lo, c_hi = torch.zeros_like(index), torch.zeros_like(index)
        for s, e in c.spans:
            if s < end < e:
                raise ValueError("a chunk ends inside an image its model sees both ways")
            inside = (index >= s) & (index < e)
            c_lo[inside], c_hi[inside] = s, e
        lo.append(c_lo)
        hi.append(c_hi)
    return torch.cat(lo), torch.cat(hi)


def _masks(
    query_pos: torch.Tensor,
    row_keys: int,
    windows: Iterable[int | None],
    bounds: list[torch.Tensor],
) -> dict[int | None, torch.Tensor]:
    """Per sliding window, the keys each (rows, 1, queries, 1) query index sees: causal or (with
    `bounds`) anywhere in its own image, and within the window."""
    k = torch.arange(row_keys, device=query_pos.device)
    causal = k <= query_pos
    both = None
    if bounds:
        lo, hi = (b.view(query_pos.shape) for b in bounds)
        both = (k >= lo) & (k < hi)
    seen = causal if both is None else causal | both
    # A sliding layer's window bounds image keys too (Gemma 3: AND(window, OR(causal, image))).
    return {w: seen if w is None else seen & (k > query_pos - w) for w in windows}


@dataclass(frozen=True, slots=True)
class Layout:
    """How a step's flat buffer of indices splits into its `StepMetadata`: what is not in the
    numbers themselves. The CUDA-graph path (core/cuda_graphs.py) keeps one per captured shape."""

    sizes: tuple[int, ...]  # length of each part of the buffer, in order
    positions_shape: tuple[int, ...]  # (tokens,) or (3, tokens)
    calls: tuple[tuple[int, int, int], ...]  # fast mode: (rows, row_queries, row_keys) per call
    with_spans: bool  # fast mode: each call also carries its queries' image bounds (lo, hi)
    sequences: tuple[tuple[int, int, Spans], ...]  # batch-invariant mode: (start, num_tokens,
    # spans) per chunk; () in fast mode


def host_metadata(
    chunks: list[SeqChunk], block_size: int, batch_invariant: bool
) -> tuple[torch.Tensor, Layout]:
    """The step's indexing tensors on the host, as one flat long tensor and its layout."""
    lengths = torch.tensor([c.num_tokens for c in chunks])
    ends = [c.start + c.num_tokens for c in chunks]
    # Per chunk, the slot of each index 0..max(ends)-1 (padding blocks point at slot 0).
    num_blocks = -(-max(ends) // block_size)
    tables = torch.zeros(len(chunks), num_blocks, dtype=torch.long)
    for i, c in enumerate(chunks):
        used = c.blocks[:num_blocks]
        tables[i, : used.shape[0]] = used
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).view(len(chunks), -1)
    index = torch.cat([torch.arange(c.start, c.start + c.num_tokens) for c in chunks])
    positions = rope_positions(chunks, index)
    spans = _token_spans(chunks, ends) if any(c.spans for c in chunks) else None
    token_chunk = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
    need = torch.tensor([c.need_logits for c in chunks], dtype=torch.bool)
    parts = [positions.flatten(), slots[token_chunk, index], (torch.cumsum(lengths, 0) - 1)[need]]
    shapes: list[tuple[int, int, int]] = []
    sequences: tuple[tuple[int, int, Spans], ...] = ()
    if batch_invariant:
        parts += [tables[i, : -(-end // block_size)] for i, end in enumerate(ends)]
        sequences = tuple((c.start, c.num_tokens, c.spans) for c in chunks)
    else:
        extra, shapes = _packed(chunks, tables, block_size, index.shape[0], spans)
        parts += extra
    sizes = tuple(p.shape[0] for p in parts)
    layout = Layout(sizes, tuple(positions.shape), tuple(shapes), spans is not None, sequences)
    return torch.cat(parts), layout


def device_metadata(
    flat: torch.Tensor, layout: Layout, windows: Iterable[int | None] = (None,)
) -> StepMetadata:
    """The step's metadata from its flat buffer, already on the model's device: views of it, and
    the masks derived there (no host work, no sync: this runs inside a captured CUDA graph)."""
    flat_positions, slot_mapping, logits_indices, *rest = torch.split(flat, list(layout.sizes))
    positions = flat_positions.view(layout.positions_shape)
    if layout.sequences:
        sequences = tuple(
            SequenceKeys(start, num_tokens, keys, spans)
            for (start, num_tokens, spans), keys in zip(layout.sequences, rest, strict=True)
        )
        return StepMetadata(positions, slot_mapping, logits_indices, (), rest[0][:0], sequences)
    calls, per_call, windows = [], 5 if layout.with_spans else 3, tuple(windows)
    for g, (num_rows, row_queries, row_keys) in enumerate(layout.calls):
        query_index, key_blocks, query_pos, *bounds = rest[per_call * g : per_call * (g + 1)]
        masks = _masks(query_pos.view(-1, 1, row_queries, 1), row_keys, windows, bounds)
        calls.append(AttentionRows(query_index, key_blocks, masks, num_rows, row_queries, row_keys))
    return StepMetadata(positions, slot_mapping, logits_indices, tuple(calls), rest[-1], ())


def step_metadata(
    chunks: list[SeqChunk],
    block_size: int,
    batch_invariant: bool,
    device: torch.device,
    windows: Iterable[int | None] = (None,),
) -> StepMetadata:
    """The step's indexing tensors, built on the host and copied to `device` in one transfer.
    `windows`: the sliding windows of the model's layers (None = a global layer)."""
    flat, layout = host_metadata(chunks, block_size, batch_invariant)
    return device_metadata(flat.to(device), layout, windows)


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


# Read once: dynamo breaks the graph at the call.
_ONEDNN = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]


def _onednn_takes(weight: torch.Tensor) -> bool:
    """Whether oneDNN's linear runs on this weight: float32 or bfloat16, on the CPU."""
    return (
        _ONEDNN and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
    )


@torch.library.custom_op("visor::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on the CPU through oneDNN, on the weight as it is (no layout of its own): faster
    than MKL's GEMM at every row count we run, on one thread and two (HISTORY.md). An op of its
    own because inductor lowers oneDNN's linear only for weights it laid out itself (freezing);
    so a compiled step calls it as it is."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


PACKED = "visor_packed_weight"  # attribute of a linear layer whose weight `pack_linears` laid out


def pack_linears(model: VisionLanguageModel) -> int:
    """Fast mode on the CPU: each linear layer a step runs (the decoder layers' and the LM head)
    keeps its weight in oneDNN's layout for its GEMM, as torch.compile's CPU weight freezing
    does, and `linear` calls oneDNN on it. MKL runs a one-row float32 GEMM (a decode) on one
    thread whatever torch's thread count; oneDNN uses them all, is no slower on one thread for
    one row and faster for several (bench/results/HISTORY.md). The plain weight is dropped for
    an empty one, so memory stays the same (a weight shared with the embeddings stays there).
    Returns the layers packed: none when oneDNN is missing or the weights are not float32 /
    bfloat16 on the CPU."""
    modules = [*cast(nn.Module, model.language_model).modules(), model.lm_head]
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    packed = 0
    for module in linears:
        weight = module.weight.detach()
        if not _onednn_takes(weight):
            continue
        setattr(module, PACKED, torch.ops.mkldnn._reorder_linear_weight(weight, None))
        module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        packed += 1
    return packed


def linear(layer: nn.Linear, x: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
    """`layer(x)`; batch-invariant, such that each row's result is the same whatever else is in
    `x`: at least `TILE` rows (zero-padded), in one call where `exact_rows` allows, else on
    `TILE`-row tiles. Fast mode on the CPU: a step torch.compile traces writes up to
    `REDUCTION_ROWS` rows as a reduction; otherwise a layer `pack_linears` laid out runs on
    oneDNN, and so does any other float32 / bfloat16 weight, as it is (`onednn_linear`)."""
    rows = x.shape[0]
    if not batch_invariant:
        if rows <= REDUCTION_ROWS and x.device.type == "cpu" and torch.compiler.is_compiling():
            # A decode's GEMM is a GEMV: the weight streams from memory once. MKL runs a
            # one-row GEMM on one thread, and oneDNN's is slower than the kernel inductor emits
            # for this reduction, which splits the weight's rows over every thread; with each
            # weight row outermost, it is read once for all the step's rows (HISTORY.md).
            # The weight's row halves are reduced in one loop (inductor fuses reductions over the
            # same input): two streams from memory at once read faster than one on a core.
            halves = layer.weight.chunk(REDUCTION_STREAMS)
            y = torch.cat([(w[:, None, :] * x[None]).sum(-1) for w in halves]).t()
            return y if layer.bias is None else y + layer.bias
        packed = getattr(layer, PACKED, None)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
        if _onednn_takes(layer.weight) and x.dtype == layer.weight.dtype:
            return onednn_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)
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


def attend(
    q: torch.Tensor,
    kv: PagedKV,
    layer: int,
    meta: StepMetadata,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The step's attention: (heads, tokens, dim) queries -> (tokens, heads * dim), each query
    over the keys its layer's `window` and the step's images let it see."""
    if meta.sequences:
        return _attend_per_sequence(q, kv, layer, meta, window, scale)
    heads, _, dim = q.shape
    kv_heads = kv.keys[layer].shape[0]
    group = heads // kv_heads
    outs = []
    for call in meta.attention:
        rows, row_queries, row_keys = call.num_rows, call.row_queries, call.row_keys
        # The query heads sharing a KV head go in as one head with `group` times the queries:
        # keys and values are read once, never repeated per query head (measured ~1.5x faster
        # than SDPA's enable_gqa on CPU).
        queries = q.index_select(1, call.query_index).view(kv_heads, group, rows, row_queries, dim)
        queries = queries.permute(2, 0, 1, 3, 4).reshape(rows, kv_heads, -1, dim)
        mask = call.masks[window]
        if group > 1:
            mask = mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(rows, 1, -1, row_keys)
        keys, values = (
            store.index_select(1, call.key_blocks).view(-1, rows, row_keys, dim).transpose(0, 1)
            for store in (kv.keys[layer], kv.values[layer])
        )
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        out = out.view(rows, heads, row_queries, dim).transpose(1, 2)
        outs.append(out.reshape(rows * row_queries, heads * dim))
    return torch.cat(outs).index_select(0, meta.output_index)


def _tile_mask(
    pos: int, end: int, window: int | None, spans: Spans, device: torch.device
) -> torch.Tensor:
    """The keys queries pos..end-1 see, over keys 0..(the tile's end, or the end of an image
    one of them sits in)-1: a function of positions only, the same whatever the batch."""
    key_end = max([end] + [e for s, e in spans if s < end and e > pos])
    mask = torch.ones(end - pos, key_end, dtype=torch.bool, device=device).tril(pos)
    for s, e in spans:
        a, b = max(s, pos), min(e, end)
        if a < b:
            mask[a - pos : b - pos, s:e] = True
    # The window bounds image keys too (Gemma 3: AND(window, OR(causal, image))).
    return mask if window is None else mask.triu(pos - window + 1)


def _attend_per_sequence(
    q: torch.Tensor,
    kv: PagedKV,
    layer: int,
    meta: StepMetadata,
    window: int | None,
    scale: float | None,
) -> torch.Tensor:
    """Batch-invariant attention: per sequence, one SDPA call per query tile [k*TILE, (k+1)*TILE)
    of sequence indices over exactly the keys `_tile_mask` names."""
    outs, offset = [], 0
    for seq in meta.sequences:
        start, num_tokens = seq.start, seq.num_tokens
        keys, values = (
            store.index_select(1, seq.blocks).flatten(1, 2)
            for store in (kv.keys[layer], kv.values[layer])
        )
        pos = start
        while pos < start + num_tokens:
            end = min(start + num_tokens, (pos // TILE + 1) * TILE)
            mask = _tile_mask(pos, end, window, seq.spans, q.device)
            key_end = mask.shape[1]
            out = F.scaled_dot_product_attention(
                q[None, :, offset + pos - start : offset + end - start],
                keys[None, :, :key_end],
                values[None, :, :key_end],
                attn_mask=mask,
                enable_gqa=keys.shape[0] != q.shape[0],
                scale=scale,
            )
            outs.append(out[0].transpose(0, 1).flatten(1))
            pos = end
        offset += num_tokens
    return torch.cat(outs)


def _layer_attention(kv: PagedKV, layer: int, meta: StepMetadata, window: int | None) -> Attend:
    """`attend` as layer `layer` calls it: caches the step's keys and values, then attends."""

    def attend_layer(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        kv.write(layer, meta.slot_mapping, k, v)
        return attend(q, kv, layer, meta, window, scale)

    return attend_layer


@torch.inference_mode()
def forward_step(
    model: VisionLanguageModel,
    embeds: torch.Tensor,
    meta: StepMetadata,
    kv: PagedKV,
    batch_invariant: bool,
    extras: Sequence[torch.Tensor | None] = (),
) -> torch.Tensor:
    """Runs the step's new tokens ((tokens, hidden) embeddings, in chunk order) through every
    layer's `forward_paged`; returns the float32 logits of the tokens `meta.logits_indices`
    names. `extras`: per layer from the first, None or the (tokens, hidden) rows it adds to its
    output (Qwen3-VL's deepstack inputs); layers past its end get None."""
    return step_logits(model, embeds, meta, kv, batch_invariant, extras)


def step_logits(
    model: VisionLanguageModel,
    embeds: torch.Tensor,
    meta: StepMetadata,
    kv: PagedKV,
    batch_invariant: bool,
    extras: Sequence[torch.Tensor | None] = (),
) -> torch.Tensor:
    """`forward_step` outside inference mode, for torch.compile: dynamo fails on the views
    inference mode makes of normal tensors (torch 2.13: "Cannot set version_counter")."""
    rope = model.rope(meta.positions)

    def gemm(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(module, x, batch_invariant)

    x = embeds
    for i, layer in enumerate(paged_layers(model)):
        attend_layer = _layer_attention(kv, i, meta, layer.sliding_window)
        extra = extras[i] if i < len(extras) else None
        x = layer.forward_paged(x, rope, attend_layer, gemm, extra)
    last = model.language_model.norm(x.index_select(0, meta.logits_indices))
    return linear(model.lm_head, last, batch_invariant).float()


def forward(
    model: VisionLanguageModel,
    embeds: torch.Tensor,
    chunks: list[SeqChunk],
    kv: PagedKV,
    batch_invariant: bool = True,
    extras: Sequence[torch.Tensor | None] = (),
) -> torch.Tensor:
    """`forward_step` with the metadata of `chunks`: the float32 logits of the last token of
    each chunk with `need_logits`, in chunk order."""
    meta = step_metadata(chunks, kv.block_size, batch_invariant, kv.device, sliding_windows(model))
    return forward_step(model, embeds, meta, kv, batch_invariant, extras)

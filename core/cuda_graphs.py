"""Decode-only steps at padded static shapes, replayed as CUDA graphs.

A step whose every chunk is one new token that samples (a decode) runs here in fast mode: its
batch is padded up to a batch bucket and every row's keys up to a key bucket, so that the step's
tensors have the shapes of its (rows, keys, rope rows) bucket whatever the batch. The step's
indices then fill the bucket's static flat buffer on the device in one host-to-device copy (the
layout `core.model.paged.device_metadata` splits), its embeddings a static (rows, hidden) buffer,
and on CUDA a graph captured for the bucket replays the whole forward pass (the metadata's views
and masks, every layer, the LM head) into a static logits buffer, from which the runner takes
the real rows; sampling stays outside. Elsewhere (the CPU) the same padded static-buffer path
runs eagerly, which is how the tests here check it.

Padding rows embed token 0 at position 0; their keys and values go to a scratch block that no
sequence owns (the runner allocates one block past the KV-cache manager's) and each attends only
to its own key there, so nothing a live sequence reads changes and no row is all -inf.

Graphs are captured lazily, a bucket on its first step (one log line with its time): at the
defaults the buckets number ~200 (11 batch x 10 key sizes x two rope shapes) while a deployment
uses a handful, and capturing them all at start would cost minutes and memory for nothing. All
graphs share one memory pool; they never run at once, and each output is read before the next
replay.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.model import paged
from core.model.family import VisionLanguageModel, sliding_windows
from shared import logs

log = logs.get("core.cuda_graphs")

WARMUP_RUNS = 2  # eager runs on a side stream before a capture (lazy inits, cuBLAS handles)


@dataclass(frozen=True, slots=True)
class Buckets:
    """The padded shapes decode-only steps run at."""

    batches: tuple[int, ...]  # rows per step, ascending; the last is the most sequences a step has
    keys: tuple[int, ...]  # keys per row, ascending multiples of the block size

    @classmethod
    def for_limits(cls, max_num_seqs: int, block_size: int, max_tokens: int) -> Buckets:
        """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... rows up to `max_num_seqs` (padding wastes at
        most a third of a step from 8 rows on); block_size x 1, 2, 4, ... keys up to the block
        holding a request's last token (`max_tokens`)."""
        batches, p = {1, 2, 4, 8, max_num_seqs}, 16
        while p < max_num_seqs:
            batches |= {p, p * 3 // 2}
            p *= 2
        top = -(-max_tokens // block_size) * block_size
        keys, k = {top}, block_size
        while k < top:
            keys.add(k)
            k *= 2
        return cls(tuple(sorted(b for b in batches if b <= max_num_seqs)), tuple(sorted(keys)))


@dataclass(frozen=True, slots=True)
class PaddedDecode:
    """How a runner runs its decode-only steps at padded shapes (fast mode only)."""

    buckets: Buckets  # the shapes
    cuda_graphs: bool  # capture each bucket and replay it (on CUDA; ignored elsewhere)
    compile: bool  # torch.compile each bucket's step


def _pick(sizes: tuple[int, ...], need: int) -> int | None:
    """The smallest of `sizes` holding `need`; None past the largest."""
    at = bisect.bisect_left(sizes, need)
    return sizes[at] if at < len(sizes) else None


@dataclass(frozen=True, slots=True)
class Shape:
    """One bucket: a captured graph per distinct value."""

    rows: int  # sequences per step, padded
    keys: int  # keys per row, padded (a multiple of the block size)
    rope_rows: int  # 0: (rows,) rope positions; else (rope_rows, rows), e.g. 3 for (t, h, w)


@dataclass(slots=True)
class _Static:
    """A bucket's static buffers (views of the runner-wide ones) and, on CUDA, its graph."""

    layout: paged.Layout  # how `flat` splits into the step's metadata
    flat: torch.Tensor  # (sum(layout.sizes),) long: the step's indices, on the device (the
    # start of the runner-wide buffer, which the step reads)
    embeds: torch.Tensor  # (rows, hidden): the step's embeddings, padding rows token 0's
    graph: torch.cuda.CUDAGraph | None = None  # None: run eagerly
    logits: torch.Tensor | None = None  # (rows, vocab) float32: the graph's output


def layout(shape: Shape, block_size: int) -> paged.Layout:
    """The flat buffer of a bucket, in `host_metadata`'s order for one call of one-query rows:
    positions, slots, logits rows, query index, key blocks, query positions, output index."""
    rows = shape.rows
    positions = (shape.rope_rows, rows) if shape.rope_rows else (rows,)
    sizes = (rows * max(1, shape.rope_rows), rows, rows, rows, rows * shape.keys // block_size)
    return paged.Layout(
        (*sizes, rows, rows), positions, ((rows, 1, shape.keys),), with_spans=False, sequences=()
    )


def decode_shape(chunks: list[paged.SeqChunk], buckets: Buckets) -> Shape | None:
    """The bucket of a decode-only step; None for any other step (a prefill chunk, a chunk that
    samples nothing, a decode inside an image seen both ways) or one past the largest bucket."""
    for c in chunks:
        inside = any(s <= c.start < e for s, e in c.spans)
        if c.num_tokens != 1 or not c.need_logits or inside:
            return None
    rows = _pick(buckets.batches, len(chunks))
    keys = _pick(buckets.keys, max(c.start for c in chunks) + 1)
    if rows is None or keys is None:
        return None
    given = [c.positions for c in chunks if c.positions is not None and c.positions.dim() == 2]
    return Shape(rows, keys, max((p.shape[0] for p in given), default=0))


def host_buffer(
    chunks: list[paged.SeqChunk], shape: Shape, block_size: int, scratch_block: int
) -> torch.Tensor:
    """The step's indices in the bucket's `layout`, on the host: the live rows first, then
    padding rows (position 0, the scratch block's first slot, keys in the scratch block)."""
    n, rows = len(chunks), shape.rows
    starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
    positions = torch.zeros((shape.rope_rows, rows) if shape.rope_rows else rows, dtype=torch.long)
    if chunks:
        positions[..., :n] = paged.rope_positions(chunks, starts)
    key_blocks = torch.full((rows, shape.keys // block_size), scratch_block, dtype=torch.long)
    key_blocks[:n] = 0  # a live row's blocks past its own are masked: any block will do
    for i, c in enumerate(chunks):
        used = c.blocks[: key_blocks.shape[1]]
        key_blocks[i, : used.shape[0]] = used
    slots = torch.full((rows,), scratch_block * block_size, dtype=torch.long)
    slots[:n] = key_blocks[torch.arange(n), starts // block_size] * block_size + starts % block_size
    query_pos = torch.zeros(rows, dtype=torch.long)
    query_pos[:n] = starts
    every = torch.arange(rows)  # each row samples, and owns query and output row i
    parts = [positions.flatten(), slots, every, every, key_blocks.flatten(), query_pos, every]
    return torch.cat(parts)


class DecodeGraphs:
    """The padded static-buffer path of decode-only steps: `run` per step, graphs on CUDA."""

    @torch.no_grad()
    def __init__(
        self,
        model: VisionLanguageModel,
        kv: paged.PagedKV,
        buckets: Buckets,
        capture: bool,
        compile: bool = False,
    ) -> None:
        """`capture`: replay CUDA graphs (CUDA only), else run the padded path eagerly;
        `compile`: torch.compile each bucket's step (inductor; eager again if it fails)."""
        self.model, self.kv, self.buckets, self.capture = model, kv, buckets, capture
        self.windows = tuple(sliding_windows(model))
        self.scratch_block = kv.keys[0].shape[1] - 1  # past the KV-cache manager's blocks
        text, device = model.cfg.text, kv.device
        rows = buckets.batches[-1]
        biggest = layout(Shape(rows, buckets.keys[-1], 3), kv.block_size)
        # Normal tensors (made outside inference mode): torch.compile takes them as inputs.
        self._flat = torch.zeros(sum(biggest.sizes), dtype=torch.long, device=device)
        embed = model.language_model.embed_tokens
        self._pad = embed(torch.zeros(1, dtype=torch.long, device=device))  # token 0's row
        self._embeds = self._pad.new_zeros(rows, text.hidden_size)
        self._steps: dict[Shape, _Static] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._compiled: Callable[..., torch.Tensor] | None = None
        # One compiled step per bucket (static shapes): dynamo must keep them all.
        self._recompile_limit = len(buckets.batches) * len(buckets.keys) * 2
        if compile:
            self._compiled = torch.compile(self._padded_step, dynamic=False)
        self.num_steps = 0  # steps served here (padded), for tests and benchmarks

    @property
    def shapes(self) -> tuple[Shape, ...]:
        """The buckets used so far (captured, on CUDA), in first-use order."""
        return tuple(self._steps)

    @property
    def compiled(self) -> bool:
        """Whether steps run torch.compile'd (false once a compile failed)."""
        return self._compiled is not None

    @torch.inference_mode()
    def run(self, embeds: torch.Tensor, chunks: list[paged.SeqChunk]) -> torch.Tensor | None:
        """The float32 logits of a decode-only step, (len(chunks), vocab) in chunk order, from
        `embeds` (len(chunks), hidden); None when the step is not one this path serves. On CUDA
        they are a view of the graph's output: read them before the next step."""
        shape = decode_shape(chunks, self.buckets)
        if shape is None:
            return None
        step = self._steps.get(shape) or self._prepare(shape)
        n = len(chunks)
        self._fill(step, host_buffer(chunks, shape, self.kv.block_size, self.scratch_block))
        step.embeds.narrow(0, 0, n).copy_(embeds)
        step.embeds.narrow(0, n, shape.rows - n).copy_(self._pad.expand(shape.rows - n, -1))
        if step.graph is None:
            logits = self._forward(step)
        else:
            step.graph.replay()
            assert step.logits is not None
            logits = step.logits
        self.num_steps += 1
        return logits.narrow(0, 0, n)

    def _fill(self, step: _Static, host: torch.Tensor) -> None:
        """The step's one host-to-device copy, into the bucket's static buffer (from pinned
        memory on CUDA: queued on the stream, ahead of the replay that reads it)."""
        if self.kv.device.type == "cuda":
            host = host.pin_memory()
        step.flat.copy_(host, non_blocking=True)

    def _padded_step(
        self, flat: torch.Tensor, embeds: torch.Tensor, lay: paged.Layout
    ) -> torch.Tensor:
        """What a graph holds (and torch.compile compiles): the metadata from the start of the
        static buffers, then the forward pass."""
        rows = lay.calls[0][0]
        meta = paged.device_metadata(flat.narrow(0, 0, sum(lay.sizes)), lay, self.windows)
        return paged.step_logits(self.model, embeds.narrow(0, 0, rows), meta, self.kv, False)

    def _forward(self, step: _Static) -> torch.Tensor:
        if self._compiled is None:
            return self._padded_step(self._flat, self._embeds, step.layout)
        with torch.inference_mode(False), torch.no_grad():
            return self._compiled(self._flat, self._embeds, step.layout)

    def _prepare(self, shape: Shape) -> _Static:
        """A bucket's static views; compiled and, on CUDA, captured over a batch of padding
        rows only (the warm-up runs for real and must write no live sequence's keys)."""
        lay = layout(shape, self.kv.block_size)
        step = _Static(
            lay, self._flat.narrow(0, 0, sum(lay.sizes)), self._embeds.narrow(0, 0, shape.rows)
        )
        self._steps[shape] = step
        if not self.capture and self._compiled is None:
            return step
        t0 = time.perf_counter()
        # Dynamo's settings are per thread: set on the thread that compiles (the model thread),
        # or past 8 buckets dynamo would run every new one eagerly.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, self._recompile_limit)
        self._fill(step, host_buffer([], shape, self.kv.block_size, self.scratch_block))
        step.embeds.copy_(self._pad.expand(shape.rows, -1))
        if self.capture:
            step.graph, step.logits = self._capture(step)
        else:
            self._warm_up(step)
        ms = round((time.perf_counter() - t0) * 1000, 1)
        dims = [shape.rows, shape.keys, shape.rope_rows]
        log.info("decode_step_prepared", shape=dims, duration_ms=ms, backend=self._backend())
        return step

    def _backend(self) -> str:
        return "+".join(["compile"] * self.compiled + ["cuda_graph"] * self.capture) or "eager"

    def _warm_up(self, step: _Static) -> None:
        """Runs the step (compiling it); a compile that fails leaves every step eager."""
        for _ in range(WARMUP_RUNS):
            try:
                self._forward(step)
            except Exception as exc:
                if self._compiled is None:
                    raise
                where = logs.error_site(exc)
                log.error("decode_compile_failed", error_type=type(exc).__name__, where=where)
                self._compiled = None

    def _capture(self, step: _Static) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.kv.device
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._warm_up(step)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(step)
        return graph, logits

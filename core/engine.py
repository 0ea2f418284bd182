"""The engine: owns the model, the scheduler and the paged KV cache, and runs every torch call on
one model thread.

```
 event loop (servicer)                          model thread
 generate() ── submit(add) ──▶ inbox ──▶ run tasks (adds, aborts, encoder jobs)
            ◀── Delta / Finished ─────── step loop: schedule ▶ forward ▶ sample ▶ stream
 close iterator ── submit(abort) ──▶       (blocks freed before the next step)
```

The event loop only enqueues work and receives events; between two steps the model thread runs
whatever tasks arrived (new requests, aborts, encoder batches), so a cancelled request frees its
blocks before the next step and encoding interleaves with generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from core import compression, encoders, metrics
from core.config import SchedulerConfig
from core.generate import TextStream, token_logprobs
from core.kv_cache import ImageSpan, KVCacheManager
from core.model import llava
from core.model.paged import PagedKV
from core.model.tokenizer import ChatTokenizer
from core.runner import ModelRunner, finished
from core.scheduler import Scheduler, SchedulerOutput
from core.sequence import EngineFailure, Event, Finished, RequestStatus, Sequence, Token
from core.structured import Grammar, GrammarCompiler
from core.types import CoreInfo, Delta, InferRequest, ItemSpec, Result, SamplingParams
from shared import logs
from shared.errors import Reason, VisorError
from shared.sampling import check_logprobs, check_response_format, check_sampling, check_stop

PREPROCESS_VERSION = "pp1"
T = TypeVar("T")
log = logs.get("core.engine")
_FAILURES = {
    Reason.INTERNAL: "internal error in the core",
    Reason.CORE_UNAVAILABLE: "the core is shutting down",
    Reason.INVALID_REQUEST: "response_format exceeded the grammar limits while generating",
}


def num_tiles(rows: int, cols: int) -> int:
    """Tiles of a grid: every cell, plus a global thumbnail when there is more than one cell."""
    cells = rows * cols
    return cells + 1 if cells > 1 else cells


class _Inbox:
    """Tasks for the model thread, and the wake-up when work arrives."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._tasks: list[Callable[[], None]] = []
        self.closed = False

    def put(self, task: Callable[[], None]) -> None:
        with self._cv:
            if self.closed:
                raise VisorError(Reason.CORE_UNAVAILABLE, "the engine is shutting down")
            self._tasks.append(task)
            self._cv.notify()

    def take(self, wait: bool) -> list[Callable[[], None]]:
        with self._cv:
            while wait and not self._tasks and not self.closed:
                self._cv.wait()
            tasks, self._tasks = self._tasks, []
            return tasks

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify()


class Engine:
    def __init__(
        self,
        model_dir: Path,
        core_id: str,
        num_threads: int = 0,
        encoder: str = "torch",
        artifacts: Path | None = None,
        scheduler: SchedulerConfig | None = None,
        batch_invariant: bool = False,
    ) -> None:
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(
                f"no model at {model_dir}: build the demo one with "
                f"`visor model init-demo --out {model_dir}`"
            )
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.model = llava.load(model_dir)
        cfg = self.model.cfg
        self.tokenizer = ChatTokenizer(model_dir, cfg.image_token_id)
        eos = self.tokenizer.tok.token_to_id(self.tokenizer.eos_token)
        self.eos_ids = set(cfg.text.eos_token_id) | ({eos} if eos is not None else set())
        self.info = CoreInfo(
            core_id=core_id,
            model_id=model_dir.resolve().name,
            encoder_digest=self.model.encoder_digest(),
            image_size=cfg.vision.image_size,
            tokens_per_tile=cfg.tokens_per_tile,
            preprocess_version=PREPROCESS_VERSION,
            accepted_dtypes=("uint8",),
            image_mean=cfg.image_mean,
            image_std=cfg.image_std,
        )
        self.batch_invariant = batch_invariant
        self._build_scheduler(scheduler or SchedulerConfig())
        self._inbox = _Inbox()
        self._seqs: dict[int, Sequence] = {}  # model thread only
        self._next_id = 0
        self._queued = 0  # submitted, not yet in the scheduler (guarded by _lock)
        self._prefix_seen = (0, 0)  # prefix counters already exported
        self._num_waiting = 0  # the scheduler's queue after the last step (model thread writes)
        self._lock = threading.Lock()
        # (time, tokens, sequences) per step, for benchmarks; None = not recorded
        self.step_log: list[tuple[float, int, int]] | None = None
        self._thread = threading.Thread(target=self._loop, name="visor-model", daemon=True)
        self._thread.start()
        folder = artifacts or model_dir / ".visor"
        self.encoder = encoders.build(encoder, self.model, folder.expanduser(), num_threads)

    def _build_scheduler(self, sc: SchedulerConfig) -> None:
        text = self.model.cfg.text
        per_block = PagedKV.bytes_per_block(
            text.num_layers, sc.block_size, text.num_kv_heads, text.head_dim
        )
        num_blocks = max(1, (sc.kv_cache_mb << 20) // per_block)
        self.max_request_tokens = min(
            sc.max_request_tokens, text.max_position_embeddings, num_blocks * sc.block_size
        )
        self.max_waiting = sc.max_waiting
        self.max_items, self.max_item_tiles = sc.max_items, sc.max_item_tiles
        self.max_stop_strings, self.max_stop_bytes = sc.max_stop_strings, sc.max_stop_bytes
        self.max_format_bytes = sc.max_format_bytes
        self.grammars = GrammarCompiler(
            self.tokenizer.tok.to_str(), text.vocab_size, self.eos_ids, sc.grammar_cache_size
        )
        self.kv_manager = KVCacheManager(num_blocks, sc.block_size, sc.prefix_caching)
        self.scheduler = Scheduler(
            self.kv_manager,
            sc.policy,
            sc.max_batch_tokens,
            sc.max_num_seqs,
            sc.batch_size,
            sc.chunked_prefill,
            sc.max_prefill_chunk,
            sc.decode_step_tokens,
        )
        self.runner = ModelRunner(
            self.model, self.kv_manager, self.scheduler, self.eos_ids, self.batch_invariant
        )
        metrics.KV_BLOCKS_TOTAL.set(num_blocks)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Runs `fn` on the model thread between two steps (torch never runs on the event loop)."""
        done: Future[T] = Future()

        def task() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args))
                except BaseException as exc:
                    done.set_exception(exc)

        self._inbox.put(task)
        return await asyncio.wrap_future(done)

    def check_request(self, req: InferRequest) -> None:
        """Refuses, before any compute and in time that does not depend on what the header
        declares: bad sampling values, more items or tiles than this core takes, items whose
        declared geometry is not what this encoder takes, requests that could never fit
        (TOKEN_BUDGET; visual tokens are counted from the declared grids, text tokens with one
        token per image slot) and arrivals past a full queue."""
        p = req.params
        check_sampling(p.temperature, p.top_p, p.top_k, p.min_new_tokens, p.max_new_tokens)
        check_stop(p.stop, self.max_stop_strings, self.max_stop_bytes)
        check_logprobs(p.logprobs, p.top_logprobs)
        check_response_format(p.response_format, self.max_format_bytes, "max_format_bytes")
        if p.max_new_tokens < 1:
            raise VisorError(Reason.INVALID_REQUEST, "max_new_tokens must be >= 1")
        if len(req.items) > self.max_items:
            raise VisorError(
                Reason.IMAGE_COUNT_LIMIT, f"more than the core's max_items ({self.max_items})"
            )
        for item in req.items:
            self._check_item(item)
        if sum(t.num_images for t in req.turns) != len(req.items):
            raise VisorError(Reason.INVALID_REQUEST, "turns show a different number of items")
        chosen = compression.profile(req.profile)
        ids = self.tokenizer.encode_prompt(list(req.turns))
        if ids.count(self.model.cfg.image_token_id) != len(req.items):
            raise VisorError(Reason.INVALID_REQUEST, "the chat template has other image places")
        per_tile = self.info.tokens_per_tile
        visual = sum(
            compression.visual_tokens(per_tile, num_tiles(i.tile_rows, i.tile_cols), chosen)
            for i in req.items
        )
        self._check_budget(len(ids) - len(req.items) + visual + p.max_new_tokens)
        self._check_queue()

    def _check_item(self, item: ItemSpec) -> None:
        tiles = num_tiles(item.tile_rows, item.tile_cols)
        if tiles < 1 or tiles > self.max_item_tiles:
            raise VisorError(
                Reason.INVALID_REQUEST,
                f"an item's tile grid is empty or over the core's max_item_tiles "
                f"({self.max_item_tiles})",
            )
        size = self.info.image_size
        if (
            item.preprocess_version != self.info.preprocess_version
            or item.resolution != size
            or item.dtype not in self.info.accepted_dtypes
            or item.shape != (tiles, 3, size, size)
        ):
            raise VisorError(
                Reason.INVALID_REQUEST, "item geometry does not match this core's encoder"
            )

    def _check_budget(self, total: int) -> None:
        if total > self.max_request_tokens:
            raise VisorError(
                Reason.TOKEN_BUDGET,
                f"request needs more than the {self.max_request_tokens} tokens "
                "(visual + text + max_new_tokens) one request may hold",
            )

    def _check_queue(self) -> None:
        if self._queued + self._num_waiting >= self.max_waiting:
            raise VisorError(
                Reason.OVERLOADED, f"the scheduler queue is full ({self.max_waiting} waiting)"
            )

    async def generate(
        self,
        req: InferRequest,
        features: list[np.ndarray],
        timings: dict[str, float],
        visual_before: int | None = None,
        content_keys: list[bytes] | None = None,
    ) -> AsyncIterator[Delta | Result]:
        """Streams deltas, then one Result. Closing the iterator early cancels the generation.

        `content_keys` name each item's features (for prefix reuse); by default they are hashes
        of the features themselves. Prefix reuse is salted by `req.tenant`."""
        visual = [int(f.shape[0]) for f in features]
        ids = self.tokenizer.encode_chat(list(req.turns), visual)
        inner = self._generate(req, ids, features, timings, visual_before, content_keys)
        try:
            async for out in inner:
                yield out
        finally:
            await inner.aclose()  # closing us must cancel at once, not when the GC gets to it

    def generate_ids(
        self, ids: list[int], params: SamplingParams, tenant: str = "bench"
    ) -> AsyncIterator[Delta | Result]:
        """`generate` for a text-only prompt given as token ids (benchmarks, evaluation)."""
        req = InferRequest(tenant, f"ids-{len(ids)}", (), params, (), "none")
        return self._generate(req, ids, [], {}, None, None)

    async def _generate(
        self,
        req: InferRequest,
        ids: list[int],
        features: list[np.ndarray],
        timings: dict[str, float],
        visual_before: int | None,
        content_keys: list[bytes] | None,
    ) -> AsyncGenerator[Delta | Result, None]:
        """Submits the request, then is its output processor (event-loop side, as in vLLM v1):
        turns the model thread's token ids into text deltas, and ends the request at a stop
        string, telling the model thread to drop it."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        grammar = await self.grammars.admit(req.params.response_format)  # hit after admission
        seq = self._submit(req, ids, features, content_keys, _sink(events), grammar)
        visual = sum(int(f.shape[0]) for f in features)
        stream = TextStream(self.tokenizer.detokenizer(), req.params.stop)
        num_tokens, end = 0, None
        try:
            while end is None:
                event = await events.get()
                if isinstance(event, EngineFailure):
                    raise VisorError(event.reason, _FAILURES[event.reason])
                if isinstance(event, Token):
                    num_tokens += 1
                    text = stream.push(event.token_id)
                    if stream.stopped:  # the model thread does not know: it drops it next
                        end = finished(seq, num_tokens, "stop")
                        self._cancel(seq.seq_id, cancelled=False)
                    lp = token_logprobs(stream.piece, event.logprobs, self.tokenizer.token_text)
                    yield Delta(text, 1, lp)
                    continue
                end = event
                tail = stream.flush()
                if tail:
                    yield Delta(tail, 0)
            timings.update(end.timings_ms)
            yield _result(stream.text, end, len(ids) - visual, visual_before, visual, timings)
        finally:
            if end is None:
                self._cancel(seq.seq_id)
            elif not stream.stopped:
                metrics.ACTIVE_GENERATIONS.dec()

    def _submit(
        self,
        req: InferRequest,
        ids: list[int],
        features: list[np.ndarray],
        content_keys: list[bytes] | None,
        sink: Callable[[Event], None],
        grammar: Grammar | None,
    ) -> Sequence:
        """Hands a new sequence to the model thread; refuses it over budget or a full queue."""
        self._check_budget(len(ids) + req.params.max_new_tokens)
        visual = [int(f.shape[0]) for f in features]
        keys = content_keys or [hashlib.sha256(f.tobytes()).digest() for f in features]
        seq = self._new_sequence(req, ids, visual, keys, sink)
        seq.grammar = grammar
        image = torch.from_numpy(np.concatenate(features)).float() if features else None
        with self._lock:
            self._check_queue()
            self._queued += 1
        try:
            self._inbox.put(lambda: self._add(seq, image))
        except VisorError:
            self._unqueue()
            raise
        metrics.ACTIVE_GENERATIONS.inc()
        return seq

    def _new_sequence(
        self,
        req: InferRequest,
        ids: list[int],
        visual: list[int],
        keys: list[bytes],
        sink: Callable[[Event], None],
    ) -> Sequence:
        params = req.params
        seed = params.seed or int.from_bytes(hashlib.sha256(req.request_id.encode()).digest()[:8])
        with self._lock:
            seq_id, self._next_id = self._next_id, self._next_id + 1
        return Sequence(
            seq_id=seq_id,
            tenant=req.tenant,
            salt=hashlib.sha256(b"tenant:" + req.tenant.encode()).digest(),
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            prompt_embeds=torch.empty(0),
            spans=_image_spans(ids, self.model.cfg.image_token_id, visual, keys),
            params=params,
            gen=torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF),
            sink=sink,
            arrival=time.perf_counter(),
        )

    def _unqueue(self) -> None:
        with self._lock:
            self._queued -= 1

    def _add(self, seq: Sequence, image: torch.Tensor | None) -> None:
        self._unqueue()
        try:
            seq.prompt_embeds = self.runner.embed_prompt(seq.token_ids, image)
        except Exception as exc:
            log.error("embed_failed", error_type=type(exc).__name__, where=logs.error_site(exc))
            seq.sink(EngineFailure())
            return
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        self._num_waiting = self.scheduler.num_waiting

    def _cancel(self, seq_id: int, cancelled: bool = True) -> None:
        """Frees a request nobody reads any more (or that a stop string ended: not `cancelled`).
        It stops counting as active once the model thread has dropped it, so no token is
        generated for it after the metric says so."""

        def counted() -> None:
            metrics.ACTIVE_GENERATIONS.dec()
            if cancelled:
                metrics.CANCELLED_GENERATIONS.inc()

        def abort() -> None:
            self._abort(seq_id)
            counted()

        try:
            self._inbox.put(abort)
        except VisorError:  # shutting down: the model thread drops every sequence itself
            counted()

    def _abort(self, seq_id: int) -> None:
        self.runner.release(seq_id)
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and not seq.status.finished:
            self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)

    def _loop(self) -> None:
        while True:
            for task in self._inbox.take(wait=not self.scheduler.has_work()):
                task()  # run() tasks report their own errors; adds and aborts do not raise
            if self._inbox.closed:
                for seq in self._seqs.values():  # shutdown: nobody waits forever
                    seq.sink(EngineFailure(Reason.CORE_UNAVAILABLE))
                return
            if self.scheduler.has_work():
                self._step()

    def _step(self) -> None:
        out = self.scheduler.schedule()
        if not out.chunks:
            time.sleep(0.001)  # nothing fits this instant (cannot last: nothing is running)
            return
        t0 = time.perf_counter()
        try:
            self.runner.step(out)
        except Exception as exc:  # a model failure ends the requests it touched, not the thread
            log.error("step_failed", error_type=type(exc).__name__, where=logs.error_site(exc))
            for chunk in out.chunks:
                if not chunk.seq.status.finished:
                    self.scheduler.finish(chunk.seq, RequestStatus.FINISHED_ABORTED)
                    chunk.seq.sink(EngineFailure())
        for seq in [s for s in self._seqs.values() if s.status.finished]:
            del self._seqs[seq.seq_id]
            self.runner.release(seq.seq_id)
        self._num_waiting = self.scheduler.num_waiting
        self._record(out, time.perf_counter() - t0)

    def _record(self, out: SchedulerOutput, seconds: float) -> None:
        kv = self.kv_manager
        metrics.STEP_SECONDS.observe(seconds)
        metrics.TOKENS_PER_STEP.observe(out.num_batched_tokens)
        metrics.QUEUE_DEPTH.set(self._num_waiting)
        metrics.RUNNING_SEQS.set(len(self.scheduler.running))
        metrics.KV_BLOCKS_USED.set(kv.num_blocks - kv.num_free_blocks)
        metrics.PREEMPTIONS.inc(len(out.preempted))
        queried, hit = self._prefix_seen
        metrics.PREFIX_QUERIED_TOKENS.inc(kv.num_queried_tokens - queried)
        metrics.PREFIX_HIT_TOKENS.inc(kv.num_hit_tokens - hit)
        self._prefix_seen = (kv.num_queried_tokens, kv.num_hit_tokens)
        if kv.num_queried_tokens:
            metrics.PREFIX_HIT_RATE.set(kv.num_hit_tokens / kv.num_queried_tokens)
        if self.step_log is not None:
            self.step_log.append((time.perf_counter(), out.num_batched_tokens, len(out.chunks)))

    def close(self) -> None:
        self._inbox.close()
        self._thread.join(timeout=30)


def _sink(events: asyncio.Queue[Event]) -> Callable[[Event], None]:
    loop = asyncio.get_running_loop()

    def deliver(event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone; its abort follows
            loop.call_soon_threadsafe(events.put_nowait, event)

    return deliver


def _image_spans(
    ids: list[int], image_id: int, visual: list[int], keys: list[bytes]
) -> tuple[ImageSpan, ...]:
    spans, pos = [], 0
    for count, key in zip(visual, keys, strict=True):
        while pos < len(ids) and ids[pos] != image_id:
            pos += 1
        if pos + count > len(ids):
            raise VisorError(Reason.INVALID_REQUEST, "more items than image places in the turns")
        spans.append(ImageSpan(pos, pos + count, key))
        pos += count
    return tuple(spans)


def _result(
    text: str,
    event: Finished,
    text_tokens: int,
    before: int | None,
    after: int,
    timings: dict[str, float],
) -> Result:
    return Result(
        text=text,
        text_tokens=text_tokens,
        visual_tokens_before=after if before is None else before,
        visual_tokens_after=after,
        output_tokens=event.num_output_tokens,
        finish_reason=event.finish_reason,
        timings_ms=timings,  # the caller's stages, with queue, prefill and generate added
    )

"""The engine: owns the model, the scheduler and the paged KV cache, and runs every torch call on
one model thread.

```
 event loop                                     model thread
 inputs.admit() (input processor: checks once)
 generate() ── submit(add) ──▶ inbox ──▶ run tasks (adds, aborts, `run` jobs)
 (output processor: text, stop strings)         step loop, on vLLM v1's lines:
            ◀── Token / Finished ──────   out = scheduler.schedule(); r = runner.execute(out)
 close iterator ── submit(abort) ──▶      deliver(scheduler.update(out, r))
```

The event loop only enqueues work and receives events; between two steps the model thread runs
whatever tasks arrived (new requests, aborts), so a cancelled request frees its blocks before the
next step. Encoder batches run on their own thread (`core.vision_queue.EncoderThread`), not here.
The scheduler is the only place a request finishes; each request's stream (its sink) lives in
the engine's table.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import numpy as np
import torch

from core import encoders, metrics
from core.compression import Kept
from core.config import SchedulerConfig
from core.cuda_graphs import Buckets, PaddedDecode
from core.device import kv_cache_bytes, resolve
from core.generate import TextStream, token_logprobs
from core.input_processor import Admitted, InputProcessor
from core.model import paged
from core.model.config import ModelConfigError
from core.model.family import VisionLanguageModel, load_model, model_type, sliding_windows
from core.model.llava import Llava
from core.model.preprocessing import rule_for
from core.model.tokenizer import ChatTokenizer
from core.outputs import EngineOutput, NewRequestData, RunnerOutput, SchedulerOutput
from core.runner import ModelRunner
from core.scheduler import Scheduler
from core.sequence import EngineFailure, Event, Finished, RequestStatus, Sequence, Token
from core.structured import GrammarCompiler
from core.types import CoreInfo, Delta, InferRequest, Result, SamplingParams
from shared import logs
from shared.config import ConfigError
from shared.errors import Reason, VisorError

T = TypeVar("T")
log = logs.get("core.engine")
_FAILURES = {
    Reason.INTERNAL: "internal error in the core",
    Reason.CORE_UNAVAILABLE: "the core is shutting down",
    Reason.INVALID_REQUEST: "response_format exceeded the grammar limits while generating",
}


WARM_UP_TOKENS = 512  # about one image and a question on the demo and 7B-class models
WARM_UP_TENANT = "visor:warm-up"  # salts its cached blocks; they hold only its own text


@dataclass(frozen=True, slots=True)
class VisualItem:
    """What the model's rope positions need of an item besides its features."""

    grid: tuple[int, int, int] = (1, 1, 1)  # (t, h, w) in merged-token units
    kept: Kept | None = None  # the tokens compression kept; None = every one
    seconds: float = 0.0  # a video's seconds per temporal patch (t of its grid); 0 = an image


def item_encoder(model: VisionLanguageModel) -> Llava | encoders.ItemModel:
    """The model as an encoder backend takes it: LLaVA's tiled graph, or a family's own
    `encode_item`; ModelConfigError for a model that has neither."""
    if isinstance(model, Llava) or callable(getattr(model, "encode_item", None)):
        return cast(Llava | encoders.ItemModel, model)
    raise ModelConfigError(f"{type(model).__name__}: no vision encoder backend serves it")


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
        device: str = "auto",
        dtype: str = "auto",
        batch_invariant: bool = True,
        gpu_memory_fraction: float = 0.9,
        cuda_graphs: bool = True,
        compile: bool = False,
    ) -> None:
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(
                f"no model at {model_dir}: build the demo one with "
                f"`visor model init-demo --out {model_dir}`"
            )
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.device, self.dtype = resolve(device, dtype)
        self.model: VisionLanguageModel = load_model(model_dir, self.device, self.dtype)
        cfg = self.model.cfg
        layout = getattr(self.model, "image_layout", None)  # Gemma 3's views in the prompt
        video = getattr(self.model, "video_token_id", None)  # families that serve video
        self.tokenizer = ChatTokenizer(model_dir, cfg.image_token_id, layout, video)
        eos = self.tokenizer.tok.token_to_id(self.tokenizer.eos_token)
        self.eos_ids = set(cfg.text.eos_token_id) | ({eos} if eos is not None else set())
        self.info = CoreInfo(
            core_id=core_id,
            model_id=model_dir.resolve().name,
            encoder_digest=self.model.encoder_digest(),
            rule=rule_for(model_dir, model_type(model_dir)),
            accepted_dtypes=("uint8",),
        )
        self.batch_invariant = batch_invariant
        # Both serve the fast path's decode steps; the CPU has no graphs to replay.
        self.cuda_graphs = cuda_graphs and not batch_invariant and self.device.type == "cuda"
        self.compile = compile and not batch_invariant
        self._build(scheduler or SchedulerConfig(), gpu_memory_fraction)
        self._inbox = _Inbox()
        # Each live request's state and stream, by seq_id (model thread only).
        self._live: dict[int, tuple[Sequence, Callable[[Event], None]]] = {}
        self._ids = itertools.count()
        self._prefix_seen = (0, 0)  # prefix counters already exported
        self._warming = False  # `warm_up` is running: its steps are not recorded
        # (time, tokens, sequences) per step, for benchmarks; None = not recorded
        self.step_log: list[tuple[float, int, int]] | None = None
        self._thread = threading.Thread(target=self._loop, name="visor-model", daemon=True)
        self._thread.start()
        folder = artifacts or model_dir / ".visor"
        self.encoder = encoders.build(
            encoder,
            item_encoder(self.model),
            folder.expanduser(),
            num_threads,
            self.device,
            self.dtype,
            per_view=self.info.rule.kind != "native",
        )

    def _build(self, sc: SchedulerConfig, gpu_memory_fraction: float) -> None:
        """The input processor, scheduler and runner, from the `[scheduler]` section and the
        model's shape; on CUDA the KV cache takes what the loaded weights leave of
        `gpu_memory_fraction` of the device."""
        text = self.model.cfg.text
        per_block = paged.PagedKV.bytes_per_block(
            text.num_layers, sc.block_size, text.num_kv_heads, text.head_dim, self.dtype
        )
        budget = kv_cache_bytes(self.device, sc.kv_cache_mb, gpu_memory_fraction)
        if budget < per_block:
            raise ConfigError(
                f"[core] gpu_memory_fraction = {gpu_memory_fraction} leaves no room for the KV "
                f"cache on {self.device} once the weights are loaded"
            )
        num_blocks = budget // per_block
        max_request_tokens = min(
            sc.max_request_tokens, text.max_position_embeddings, num_blocks * sc.block_size
        )
        self.grammars = GrammarCompiler(
            self.tokenizer.tok.to_str(), text.vocab_size, self.eos_ids, sc.grammar_cache_size
        )
        self.inputs = InputProcessor(
            self.tokenizer, self.info, sc, max_request_tokens, self.grammars
        )
        windows = sliding_windows(self.model)
        self.scheduler = Scheduler(
            sc,
            num_blocks,
            self.eos_ids,
            paged.TILE,
            whole_images=self.model.bidirectional_images,
            # Blocks leave a sequence's table behind the window only when no layer is global.
            sliding_window=None if None in windows else max(w for w in windows if w is not None),
        )
        self.kv_manager = self.scheduler.kv
        if not self.batch_invariant and not self.compile and self.device.type == "cpu":
            paged.pack_linears(self.model)  # oneDNN GEMMs; dynamo does not take its weights
        padded = None
        if self.cuda_graphs or self.compile:
            max_seqs = self.scheduler.max_num_seqs
            buckets = Buckets.for_limits(max_seqs, sc.block_size, max_request_tokens)
            padded = PaddedDecode(buckets, self.cuda_graphs, self.compile)
        self.runner = ModelRunner(
            self.model, num_blocks, sc.block_size, self.eos_ids, self.batch_invariant, padded
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

    def generate(
        self,
        request: Admitted | InferRequest,
        features: list[np.ndarray],
        timings: dict[str, float],
        visual_before: int | None = None,
        content_keys: list[bytes] | None = None,
        visual: list[VisualItem] | None = None,
    ) -> AsyncGenerator[Delta | Result, None]:
        """Streams deltas, then one Result. Closing the iterator early cancels the generation.

        `request` comes from `inputs.admit`; an `InferRequest` is admitted here, its visual
        tokens counted from `features` (in-process callers). `content_keys` name each item's
        features (for prefix reuse); by default they are hashes of the features themselves.
        Prefix reuse is salted by the tenant. `visual`: per item its grid, the tokens
        compression kept and a video's seconds per temporal patch, for the model's rope
        positions (default: an image of a (1, 1, 1) grid, none dropped)."""
        items = visual or [VisualItem() for _ in features]
        return self._generate(request, features, timings, visual_before, content_keys, None, items)

    def generate_ids(
        self, ids: list[int], params: SamplingParams, tenant: str = "bench"
    ) -> AsyncGenerator[Delta | Result, None]:
        """`generate` for a text-only prompt given as token ids (benchmarks, evaluation)."""
        req = InferRequest(tenant, f"ids-{len(ids)}", (), params, (), "none")
        return self._generate(req, [], {}, None, None, ids, [])

    async def warm_up(self, num_tokens: int = WARM_UP_TOKENS) -> None:
        """One throwaway text request, a prefill of `num_tokens` (within a step's budget) and a
        few decode steps, for the core to run before it reports SERVING: a process's first
        steps pay for allocations and kernel set-up, which a restarted core's first callers
        would otherwise wait for."""
        new = 4
        n = min(num_tokens, self.scheduler.max_batch_tokens, self.inputs.max_request_tokens - new)
        if n < 1:
            return
        ids = (self.tokenizer.tok.encode("warm up ").ids * n)[:n]
        params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
        self._warming = True  # its steps and tokens stay out of the metrics
        try:
            async for _ in self.generate_ids(ids, params, tenant=WARM_UP_TENANT):
                pass
        except VisorError as err:  # a start never fails for it: the first caller pays instead
            log.warning("warm_up_skipped", reason=err.reason.value)
        finally:
            await self.run(self._warmed)  # on the model thread, after the last warm-up step

    def _warmed(self) -> None:
        kv = self.kv_manager
        self._prefix_seen = (kv.num_queried_tokens, kv.num_hit_tokens)
        self._warming = False

    async def _generate(
        self,
        request: Admitted | InferRequest,
        features: list[np.ndarray],
        timings: dict[str, float],
        visual_before: int | None,
        content_keys: list[bytes] | None,
        prompt_ids: list[int] | None,
        items: list[VisualItem],
    ) -> AsyncGenerator[Delta | Result, None]:
        """Submits the request, then is its output processor (event-loop side, as in vLLM v1):
        turns the model thread's token ids into text deltas, and ends the request at a stop
        string, telling the model thread to drop it."""
        visual = [int(f.shape[0]) for f in features]
        if isinstance(request, InferRequest):
            request = await self.inputs.admit(request, visual, prompt_ids)
        with request:
            events: asyncio.Queue[Event] = asyncio.Queue()
            seq = self._submit(request, features, content_keys, items, _sink(events))
            params = request.req.params
            stream = TextStream(self.tokenizer.detokenizer(), params.stop)
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
                text_tokens = seq.num_prompt_tokens - sum(visual)
                yield _result(stream.text, end, text_tokens, visual_before, sum(visual), timings)
            finally:
                if end is None:
                    self._cancel(seq.seq_id)
                elif not stream.stopped:
                    metrics.ACTIVE_GENERATIONS.dec()

    def _submit(
        self,
        admitted: Admitted,
        features: list[np.ndarray],
        content_keys: list[bytes] | None,
        items: list[VisualItem],
        sink: Callable[[Event], None],
    ) -> Sequence:
        """Hands a new request to the model thread."""
        req = admitted.req
        keys = content_keys or [hashlib.sha256(f.tobytes()).digest() for f in features]
        ids, spans = self.inputs.prompt(admitted, [int(f.shape[0]) for f in features], keys)
        seq = Sequence(
            seq_id=next(self._ids),
            tenant=req.tenant,
            salt=hashlib.sha256(b"tenant:" + req.tenant.encode()).digest(),
            token_ids=ids,
            num_prompt_tokens=len(ids),
            spans=spans,
            params=req.params,
            arrival=time.perf_counter(),
        )
        inputs = NewRequestData(
            seq.seq_id,
            tuple(ids),
            tuple(features),
            req.params,
            admitted.seed,
            admitted.grammar,
            tuple(item.grid for item in items),
            tuple((span.start, span.end) for span in spans),
            # Per run of image tokens, as the spans are: a view's kept tokens on their own.
            tuple(
                k
                for item, n in zip(items, admitted.slots, strict=True)
                for k in ((None,) * n if item.kept is None else item.kept.split(n))
            ),
            tuple(item.seconds for item in items),
        )
        self._inbox.put(lambda: self._add(seq, inputs, sink, admitted))
        metrics.ACTIVE_GENERATIONS.inc()
        return seq

    def _add(
        self,
        seq: Sequence,
        inputs: NewRequestData,
        sink: Callable[[Event], None],
        admitted: Admitted,
    ) -> None:
        self._live[seq.seq_id] = (seq, sink)
        self.scheduler.add(seq, inputs)
        self.inputs.num_waiting = self.scheduler.num_waiting
        admitted.slot.release()  # it now counts among the scheduler's waiting

    def _cancel(self, seq_id: int, cancelled: bool = True) -> None:
        """Frees a request nobody reads any more (or that a stop string ended: not `cancelled`).
        It stops counting as active once the model thread has dropped it, so no token is
        generated for it after the metric says so."""

        def abort() -> None:
            self._live.pop(seq_id, None)
            status = RequestStatus.FINISHED_ABORTED if cancelled else RequestStatus.FINISHED_STOPPED
            self.scheduler.finish_requests([seq_id], status)
            counted()

        def counted() -> None:
            metrics.ACTIVE_GENERATIONS.dec()
            if cancelled:
                metrics.CANCELLED_GENERATIONS.inc()

        try:
            self._inbox.put(abort)
        except VisorError:  # shutting down: the model thread drops every request itself
            counted()

    def _loop(self) -> None:
        while True:
            for task in self._inbox.take(wait=not self.scheduler.has_work()):
                task()  # run() tasks report their own errors; adds and aborts do not raise
            if self._inbox.closed:
                for _, sink in self._live.values():  # shutdown: nobody waits forever
                    sink(EngineFailure(Reason.CORE_UNAVAILABLE))
                return
            if self.scheduler.has_work():
                self._step()

    def _step(self) -> None:
        out = self.scheduler.schedule()
        if not out.chunks and not out.finished_ids:
            time.sleep(0.001)  # nothing fits this instant (cannot last: nothing is running)
            return
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # a batched forward failure ends the step's requests only
            log.error("step_failed", error_type=type(exc).__name__, where=logs.error_site(exc))
            result = RunnerOutput.failed(c.seq_id for c in out.chunks)
        self._deliver(self.scheduler.update(out, result))
        self.inputs.num_waiting = self.scheduler.num_waiting
        if out.chunks and not self._warming:
            self._record(out, time.perf_counter() - t0)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        """Sends each request's news to its stream; a finished request leaves the table."""
        for out in outputs:
            seq, sink = self._live[out.seq_id]
            if out.failure is None and not self._warming:
                metrics.GENERATED_TOKENS.inc()
                if out.num_output_tokens == 1:
                    metrics.TTFT.observe(seq.first_token - seq.arrival)
            if out.token_id is not None:
                sink(Token(out.token_id, out.logprobs))
            if not out.status.finished:
                continue
            del self._live[out.seq_id]
            if out.failure is not None:
                sink(EngineFailure(out.failure))
            else:
                reason = "length" if out.status == RequestStatus.FINISHED_LENGTH else "stop"
                sink(finished(seq, out.num_output_tokens, reason))

    def _record(self, out: SchedulerOutput, seconds: float) -> None:
        kv = self.kv_manager
        metrics.STEP_SECONDS.observe(seconds)
        metrics.TOKENS_PER_STEP.observe(out.num_batched_tokens)
        metrics.QUEUE_DEPTH.set(self.inputs.num_waiting)
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


def finished(seq: Sequence, num_output_tokens: int, reason: str) -> Finished:
    """The final event of `seq` after `num_output_tokens` tokens, timed now (the model thread's
    ends, and the caller's when a stop string matched)."""
    end = time.perf_counter()
    if num_output_tokens > 1:
        metrics.TPOT.observe((end - seq.first_token) / (num_output_tokens - 1))
    timings = {
        "queue": (seq.first_scheduled - seq.arrival) * 1000,
        "prefill": (seq.first_token - seq.first_scheduled) * 1000,
        "generate": (end - seq.first_token) * 1000,
    }
    return Finished(num_output_tokens, reason, timings)


def _sink(events: asyncio.Queue[Event]) -> Callable[[Event], None]:
    loop = asyncio.get_running_loop()

    def deliver(event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone; its abort follows
            loop.call_soon_threadsafe(events.put_nowait, event)

    return deliver


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

"""The core's gRPC servicer: proto in -> engine call -> proto out. No logic of its own beyond the
order of the Infer handshake."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc
import numpy as np

from core import compression, metrics
from core.cache import Entry
from core.engine import Engine, VisualItem
from core.features import FeatureService
from core.input_processor import Admitted
from core.model.tokenizer import ChatTurn
from core.types import CachePolicy, Delta, InferRequest, ItemSpec, Result, SamplingParams
from shared import logs, tracing
from shared.errors import Reason, VisorError
from shared.metrics import observe
from shared.preprocess import PreprocessRule
from shared.proto import core_pb2, core_pb2_grpc, response_format, rule_to_proto
from shared.status import to_status
from shared.wire import TensorAssembler, TensorSpec

log = logs.get("core.servicer")


def request_from_proto(h: core_pb2.InferHeader) -> InferRequest:
    p = h.params
    return InferRequest(
        tenant=h.tenant,
        request_id=h.request_id,
        turns=tuple(ChatTurn(t.role or "user", t.text, t.num_images) for t in h.turns),
        params=SamplingParams(
            max_new_tokens=p.max_new_tokens,
            min_new_tokens=p.min_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p or 1.0,
            top_k=p.top_k,
            seed=p.seed,
            stop=tuple(p.stop),
            logprobs=p.logprobs,
            top_logprobs=p.top_logprobs,
            response_format=response_format(p.response_format),
        ),
        items=tuple(
            ItemSpec(
                i.content_hash,
                i.preprocess_version,
                i.resolution,
                i.tile_rows,
                i.tile_cols,
                i.dtype,
                tuple(i.shape),
                i.frame,
                i.frame_interval_s,
                i.source_width,
                i.source_height,
            )
            for i in h.items
        ),
        profile=h.profile,
        cache=CachePolicy(max(0.0, h.cache_ttl_s), h.no_cache),
    )


class CoreServicer(core_pb2_grpc.CoreServicer):
    def __init__(self, engine: Engine, features: FeatureService) -> None:
        self.engine, self.features = engine, features

    async def Describe(
        self, request: core_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> core_pb2.CoreInfo:
        i = self.engine.info
        return core_pb2.CoreInfo(
            core_id=i.core_id,
            model_id=i.model_id,
            encoder_digest=i.encoder_digest,
            image_size=i.image_size,
            tokens_per_tile=i.tokens_per_tile,
            preprocess_version=i.preprocess_version,
            accepted_dtypes=list(i.accepted_dtypes),
            image_mean=list(i.image_mean),
            image_std=list(i.image_std),
            rule=rule_to_proto(i.rule),
        )

    async def Infer(
        self,
        request_iterator: AsyncIterator[core_pb2.CoreMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[core_pb2.CoreEvent]:
        outcome = "error"
        timings = tracing.Stages()
        try:
            async for event in self._infer(request_iterator, timings):
                yield event
            outcome = "ok"
        except VisorError as err:
            outcome = err.reason.value
            log.info("infer_refused", reason=err.reason.value)
            tracing.refused(err.reason.value)
            await context.abort_with_status(to_status(err))
        except Exception as exc:  # never leak a traceback or message to the caller
            log.error("infer_failed", error_type=type(exc).__name__, where=logs.error_site(exc))
            tracing.refused(Reason.INTERNAL.value)
            await context.abort_with_status(
                to_status(VisorError(Reason.INTERNAL, "internal error in the core"))
            )
        finally:
            metrics.REQUESTS.labels(outcome=outcome).inc()
            tracing.record_stages(timings)

    async def _infer(
        self, messages: AsyncIterator[core_pb2.CoreMessage], timings: tracing.Stages
    ) -> AsyncIterator[core_pb2.CoreEvent]:
        messages = aiter(messages)
        first = await anext(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise VisorError(Reason.INVALID_REQUEST, "the first Infer message must be a header")
        req = request_from_proto(first.header)
        t0 = time.perf_counter()
        with await self.engine.inputs.admit(req) as admitted:  # every check, before any compute
            timings["admit"] = (time.perf_counter() - t0) * 1000
            async with contextlib.aclosing(self._serve(messages, admitted, timings)) as events:
                async for event in events:
                    yield event

    async def _serve(
        self,
        messages: AsyncIterator[core_pb2.CoreMessage],
        admitted: Admitted,
        timings: tracing.Stages,
    ) -> AsyncGenerator[core_pb2.CoreEvent, None]:
        req = admitted.req
        chosen = compression.profile(req.profile)
        _note_request(req, chosen.name)  # a known profile's name, never the caller's string
        t0 = time.perf_counter()
        keys = self.features.keys(req)
        entries = await self.features.lookup(keys, req.cache)
        if keys:
            timings["cache_lookup"] = (time.perf_counter() - t0) * 1000
        held = [e is not None for e in entries]
        tracing.note(cache_hits=sum(held), cache_misses=len(held) - sum(held))
        yield core_pb2.CoreEvent(cache=core_pb2.CacheReply(held=held))
        pixels = await _receive_tensors(messages, req, held)
        if pixels:
            t0 = time.perf_counter()
            missing = [i for i, e in enumerate(entries) if e is None]
            encoded = await asyncio.gather(*(self.features.encode(pixels[i]) for i in missing))
            timings["encode"] = (time.perf_counter() - t0) * 1000
            for i, entry in zip(missing, encoded, strict=True):
                entries[i] = entry
                self.features.store(keys[i], entry, req.cache)
        full = [e for e in entries if e is not None]
        features = [e.features for e in full]
        arrange = getattr(self.engine.model, "arrange_item", None)  # LLaVA-OneVision's anyres
        if arrange is not None and full:
            t0 = time.perf_counter()
            features = await asyncio.to_thread(_arrange_all, arrange, req.items, features)
            timings["arrange"] = (time.perf_counter() - t0) * 1000
        kept: list[compression.Kept | None] = [None] * len(full)  # every token, uncompressed
        if chosen.steps and full:
            t0 = time.perf_counter()
            rule = self.engine.info.rule
            compressed = await self.engine.run(_compress_all, req, full, chosen, rule)
            features = [f for f, _ in compressed]
            kept = [k for _, k in compressed]
            timings["compress"] = (time.perf_counter() - t0) * 1000
        # Each item's grid follows from its checked shape (a cache hit's too), and a video's
        # time per temporal patch from its frame interval, for the rope.
        rule = self.engine.info.rule
        visual = [
            VisualItem(rule.grid(item.shape), k, item.frame_interval_s * rule.temporal_patch_size)
            for item, k in zip(req.items, kept, strict=True)
        ]
        before = sum(e.features.shape[0] for e in full)
        # Prefix reuse names each item's tokens by its feature-cache key and the profile that
        # shaped them; the engine salts block hashes with the tenant as well.
        content = [k.encode() + b"\x1f" + chosen.name.encode() for k in keys]
        stream = self.engine.generate(admitted, features, timings, before, content, visual)
        async for out in stream:
            if isinstance(out, Delta):
                yield core_pb2.CoreEvent(delta=_delta(out))
            else:
                yield core_pb2.CoreEvent(final=_final(out, self.engine.info.core_id))
                observe(metrics.STAGES, out.timings_ms)
                _note_result(out)
                log.info(
                    "infer_done",
                    request_id=req.request_id,
                    tenant=req.tenant,
                    timings_ms=out.timings_ms,
                    output_tokens=out.output_tokens,
                    visual_tokens_before=out.visual_tokens_before,
                    finish_reason=out.finish_reason,
                )


def _note_request(req: InferRequest, profile: str) -> None:
    tracing.note(
        request_id=req.request_id,
        num_items=len(req.items),
        num_tiles=sum(i.shape[0] for i in req.items),  # views (or native frames), checked
        profile=profile,
    )


def _note_result(r: Result) -> None:
    tracing.note(
        text_tokens=r.text_tokens,
        visual_tokens_before=r.visual_tokens_before,
        visual_tokens_after=r.visual_tokens_after,
        output_tokens=r.output_tokens,
        finish_reason=r.finish_reason,
    )


def _arrange_all(
    arrange: Callable[..., np.ndarray], items: tuple[ItemSpec, ...], features: list[np.ndarray]
) -> list[np.ndarray]:
    """Each item's cached per-tile rows laid out as its model reads them, by its geometry."""
    return [
        arrange(f, i.shape[0], i.tile_rows, i.tile_cols, i.source_width, i.source_height)
        for f, i in zip(features, items, strict=True)
    ]


def _compress_all(
    req: InferRequest, entries: list[Entry], chosen: compression.Profile, rule: PreprocessRule
) -> list[tuple[np.ndarray, compression.Kept | None]]:
    seed = int.from_bytes(req.request_id.encode()[:8].ljust(8, b"\0"))
    return [
        compression.compress_by_rule(rule, item.shape, e.features, e.importance, chosen, seed)
        for e, item in zip(entries, req.items, strict=True)
    ]


async def _receive_tensors(
    messages: AsyncIterator[core_pb2.CoreMessage], req: InferRequest, held: list[bool]
) -> dict[int, np.ndarray]:
    """Collects the tensors of every item not held, checking each against its declared spec."""
    pending = {
        i: TensorAssembler(TensorSpec(item.dtype, item.shape))
        for i, item in enumerate(req.items)
        if not held[i]
    }
    done: dict[int, np.ndarray] = {}
    while pending:
        msg = await anext(messages, None)
        if msg is None:
            raise VisorError(Reason.INVALID_REQUEST, "stream ended before every tensor arrived")
        chunk = msg.tensor
        if msg.WhichOneof("kind") != "tensor" or chunk.item_index not in pending:
            raise VisorError(Reason.INVALID_REQUEST, "unexpected message: tensor chunk expected")
        assembler = pending[chunk.item_index]
        assembler.add(chunk.data)
        metrics.TENSOR_BYTES.inc(len(chunk.data))
        if assembler.complete:
            done[chunk.item_index] = assembler.array()
            del pending[chunk.item_index]
    return done


def _delta(d: Delta) -> core_pb2.CoreDelta:
    return core_pb2.CoreDelta(
        text=d.text,
        num_tokens=d.num_tokens,
        logprobs=[
            core_pb2.CoreTokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                top=[core_pb2.CoreTopLogprob(token=t, logprob=v) for t, v in lp.top],
            )
            for lp in d.logprobs
        ],
    )


def _final(r: Result, core_id: str) -> core_pb2.CoreFinal:
    return core_pb2.CoreFinal(
        text=r.text,
        text_tokens=r.text_tokens,
        visual_tokens_before=r.visual_tokens_before,
        visual_tokens_after=r.visual_tokens_after,
        output_tokens=r.output_tokens,
        timings_ms=r.timings_ms,
        core_id=core_id,
        finish_reason=r.finish_reason,
    )

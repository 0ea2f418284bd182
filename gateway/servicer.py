"""The gateway's gRPC servicer: proto in -> pipeline -> proto out, typed errors -> status."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterable

import grpc

from gateway import limits, metrics
from gateway.auth import Authenticator
from gateway.config import LimitsConfig
from gateway.pipeline import Pipeline
from gateway.types import Ask, Delta, Final, Params, Turn
from shared import logs
from shared.errors import Reason, VisorError
from shared.metrics import observe
from shared.proto import gateway_pb2, gateway_pb2_grpc
from shared.sampling import TokenLogprob
from shared.status import to_status

log = logs.get("gateway.servicer")
ROLES = {0: "user", 1: "user", 2: "assistant", 3: "system"}
DETAILS = {0: "auto", 1: "low", 2: "high"}


def ask_from_proto(req: gateway_pb2.GenerateRequest, media: list[bytes] | None = None) -> Ask:
    """`media`, when given, replaces the items' bytes (the upload variant assembles them)."""
    blobs = iter(media) if media is not None else None

    def take(items: Iterable[gateway_pb2.Media]) -> tuple[bytes, ...]:
        return tuple(next(blobs) if blobs is not None else m.data for m in items)

    turns = [Turn(ROLES.get(t.role, "user"), t.text, take(t.media)) for t in req.turns]
    if req.prompt or req.media:
        turns.append(Turn("user", req.prompt, take(req.media)))
    p = req.params
    params = Params(
        p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.seed, tuple(p.stop),
        p.logprobs, p.top_logprobs,
    )  # fmt: skip
    return Ask(tuple(turns), params, req.profile, DETAILS.get(req.detail, "auto"))


def _event(out: Delta | Final) -> gateway_pb2.GenerateEvent:
    if isinstance(out, Delta):
        logprobs = map(_logprob, out.logprobs)
        return gateway_pb2.GenerateEvent(
            delta=gateway_pb2.TokenDelta(
                text=out.text, num_tokens=out.num_tokens, logprobs=logprobs
            )
        )
    return gateway_pb2.GenerateEvent(
        final=gateway_pb2.Final(
            text=out.text,
            usage=gateway_pb2.Usage(
                text_tokens=out.text_tokens,
                visual_tokens_before=out.visual_tokens_before,
                visual_tokens_after=out.visual_tokens_after,
                output_tokens=out.output_tokens,
            ),
            cache=[gateway_pb2.ItemCache(content_hash=h, hit=hit) for h, hit in out.cache],
            timings_ms=out.timings_ms,
            served_by=out.served_by,
            finish_reason=out.finish_reason,
        )
    )


def _logprob(lp: TokenLogprob) -> gateway_pb2.TokenLogprob:
    top = [gateway_pb2.TopLogprob(token=t, logprob=v) for t, v in lp.top]
    return gateway_pb2.TokenLogprob(token=lp.token, logprob=lp.logprob, top=top)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        auth: Authenticator,
        pipeline: Pipeline,
        limits_cfg: LimitsConfig,
        default_deadline_s: float = 120.0,
    ) -> None:
        self.auth, self.pipeline, self.limits = auth, pipeline, limits_cfg
        self.default_deadline_s = default_deadline_s

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        started = time.perf_counter()
        async for event in self._serve(context, started, lambda: _unary(request)):
            yield event

    async def GenerateUpload(
        self,
        request_iterator: AsyncIterator[gateway_pb2.UploadMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        started = time.perf_counter()
        async for event in self._serve(
            context, started, lambda: _upload(request_iterator, self.limits)
        ):
            yield event

    async def _serve(
        self, context: grpc.aio.ServicerContext, started: float, receive: object
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        request_id = uuid.uuid4().hex
        outcome = "error"
        # A client that sends no deadline gets the default one, so nothing waits forever.
        remaining = context.time_remaining()
        timeout = self.default_deadline_s if remaining is None else remaining
        try:
            async for event in self._answer(context, started, receive, request_id, timeout):
                yield event
            outcome = "ok"
        except VisorError as err:
            outcome = err.reason.value
            log.info("request_refused", request_id=request_id, reason=err.reason.value)
            await context.abort_with_status(to_status(err))
        except Exception as exc:  # never leak a traceback or message to the caller
            log.error(
                "request_failed",
                request_id=request_id,
                error_type=type(exc).__name__,
                where=logs.error_site(exc),
            )
            await context.abort_with_status(
                to_status(VisorError(Reason.INTERNAL, "internal error in the gateway"))
            )
        finally:
            metrics.REQUESTS.labels(outcome=outcome).inc()

    async def _answer(
        self,
        context: grpc.aio.ServicerContext,
        started: float,
        receive: object,
        request_id: str,
        timeout: float,
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        tenant = self.auth.tenant(context.invocation_metadata() or ())
        ask = await receive()  # type: ignore[operator]
        timings = {"receive": (time.perf_counter() - started) * 1000}
        async for out in self.pipeline.generate(tenant, request_id, ask, started, timings, timeout):
            if isinstance(out, Final):
                observe(metrics.STAGES, out.timings_ms)
                log.info(
                    "request_done",
                    request_id=request_id,
                    tenant=tenant,
                    num_items=len(out.cache),
                    timings_ms=out.timings_ms,
                    output_tokens=out.output_tokens,
                    core=out.served_by,
                )
            yield _event(out)


async def _unary(request: gateway_pb2.GenerateRequest) -> Ask:
    return ask_from_proto(request)


async def _upload(messages: AsyncIterator[gateway_pb2.UploadMessage], lim: LimitsConfig) -> Ask:
    """Assembles an upload, enforcing byte limits as each chunk arrives."""
    it = aiter(messages)
    first = await anext(it, None)
    if first is None or first.WhichOneof("kind") != "request":
        raise VisorError(Reason.INVALID_REQUEST, "the first upload message must be the request")
    req = first.request
    blobs = [bytearray(m.data) for t in req.turns for m in t.media]
    blobs += [bytearray(m.data) for m in req.media]
    limits.check_count(lim, len(blobs))
    total = sum(len(b) for b in blobs)
    async for msg in it:
        chunk = msg.chunk
        if msg.WhichOneof("kind") != "chunk" or chunk.media_index >= len(blobs):
            raise VisorError(Reason.INVALID_REQUEST, "upload chunk names no media item")
        blob = blobs[chunk.media_index]
        blob += chunk.data
        total += len(chunk.data)
        limits.check_bytes(lim, len(blob), total)
    return ask_from_proto(req, [bytes(b) for b in blobs])

"""The gateway's gRPC servicer: proto in -> pipeline -> proto out, typed errors -> status."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gateway import limits, metrics
from gateway.auth import authenticate
from gateway.config import LimitsConfig
from gateway.pipeline import ON_LOOP_BYTES, Pipeline
from gateway.quota import Quotas, UploadBytes
from gateway.tenants import LiveTenants
from gateway.types import Ask, Delta, Final, Params, Turn
from shared import logs, tracing
from shared.errors import Reason, VisorError
from shared.metrics import observe
from shared.proto import gateway_pb2, gateway_pb2_grpc, response_format
from shared.sampling import TokenLogprob
from shared.status import to_status

log = logs.get("gateway.servicer")
ROLES = {0: "user", 1: "user", 2: "assistant", 3: "system"}
DETAILS = {0: "auto", 1: "low", 2: "high"}
SERVICE = "visor.v1.Gateway"


class Malformed:
    """Stands in for a message whose bytes do not parse: gRPC would refuse it before the handler
    runs (UNKNOWN, no ErrorInfo, before authentication); this way the handler authenticates
    first and then refuses it as INVALID_REQUEST."""

    __slots__ = ()


MALFORMED = Malformed()


def _not_proto() -> VisorError:
    return VisorError(Reason.INVALID_REQUEST, "a message does not parse as the declared proto")


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError:
            return MALFORMED

    return deserialize


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
        p.logprobs, p.top_logprobs, response_format(p.response_format),
    )  # fmt: skip
    detail = DETAILS.get(req.detail, "auto")
    return Ask(tuple(turns), params, req.profile, detail, req.max_visual_tokens)


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


def _note_final(out: Final) -> None:
    hits = sum(hit for _, hit in out.cache)
    tracing.note(
        num_items=len(out.cache),
        cache_hits=hits,
        cache_misses=len(out.cache) - hits,
        text_tokens=out.text_tokens,
        visual_tokens_before=out.visual_tokens_before,
        visual_tokens_after=out.visual_tokens_after,
        output_tokens=out.output_tokens,
        finish_reason=out.finish_reason,
        served_by=out.served_by,
    )


def _logprob(lp: TokenLogprob) -> gateway_pb2.TokenLogprob:
    top = [gateway_pb2.TopLogprob(token=t, logprob=v) for t, v in lp.top]
    return gateway_pb2.TokenLogprob(token=lp.token, logprob=lp.logprob, top=top)


@dataclass(frozen=True, slots=True)
class Receiving:
    """How long the servicer waits for a request's body."""

    default_deadline_s: float  # applied when the client sends no deadline
    upload_idle_timeout_s: float  # longest wait for an upload's next message


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        tenants: LiveTenants,
        pipeline: Pipeline,
        quotas: Quotas,
        uploads: UploadBytes,
        receiving: Receiving,
    ) -> None:
        self.tenants, self.pipeline = tenants, pipeline
        self.quotas, self.uploads, self.receiving = quotas, uploads, receiving

    async def Generate(
        self, request: gateway_pb2.GenerateRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        started = time.perf_counter()
        async for event in self._serve(context, started, lambda _deadline, _lim: _unary(request)):
            yield event

    async def GenerateUpload(
        self,
        request_iterator: AsyncIterator[gateway_pb2.UploadMessage | Malformed],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        started = time.perf_counter()

        def receive(deadline: float, lim: LimitsConfig) -> Awaitable[Ask]:
            return self._upload(request_iterator, deadline, lim)

        async for event in self._serve(context, started, receive):
            yield event

    async def _serve(
        self,
        context: grpc.aio.ServicerContext,
        started: float,
        receive: Callable[[float, LimitsConfig], Awaitable[Ask]],
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        """Answers one call and counts its outcome once: "ok" when the final event was handed to
        gRPC (a client may close right after it), the reason of a refusal, or "cancelled" when
        the client went away first (DEADLINE_EXCEEDED when its deadline had passed)."""
        request_id = uuid.uuid4().hex
        outcome = "cancelled"
        timings = tracing.Stages()
        tracing.note(request_id=request_id)
        # A client that sends no deadline gets the default one, so nothing waits forever.
        remaining = context.time_remaining()
        timeout = self.receiving.default_deadline_s if remaining is None else remaining
        try:
            answer = self._answer(context, started, receive, request_id, timeout, timings)
            async for event in answer:
                if event.HasField("final"):
                    outcome = "ok"
                yield event
        except VisorError as err:
            outcome = err.reason.value
            log.info("request_refused", request_id=request_id, reason=err.reason.value)
            # gRPC keeps the abort's exception chain after the call; without its traceback it no
            # longer holds the frames, and with them the request's media.
            err.__traceback__ = None
            await context.abort_with_status(to_status(err))
        except Exception as exc:  # never leak a traceback or message to the caller
            outcome = Reason.INTERNAL.value
            log.error(
                "request_failed",
                request_id=request_id,
                error_type=type(exc).__name__,
                where=logs.error_site(exc),
            )
            exc.__traceback__ = None
            await context.abort_with_status(
                to_status(VisorError(Reason.INTERNAL, "internal error in the gateway"))
            )
        finally:
            if outcome == "cancelled" and time.perf_counter() >= started + timeout:
                outcome = Reason.DEADLINE_EXCEEDED.value
            metrics.REQUESTS.labels(outcome=outcome).inc()
            if outcome not in ("ok", "cancelled"):
                tracing.refused(outcome)
            tracing.record_stages(timings)

    async def _answer(
        self,
        context: grpc.aio.ServicerContext,
        started: float,
        receive: Callable[[float, LimitsConfig], Awaitable[Ask]],
        request_id: str,
        timeout: float,
        timings: tracing.Stages,
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        # Authenticate and admit before the body: an open upload holds its slots while it waits.
        # The table is read once: a reload meanwhile does not change this request's tenant.
        tenant = authenticate(self.tenants.table, context.invocation_metadata() or ())
        policy = tenant.policy
        admit = self.quotas.admit
        with admit(tenant.id, policy.max_concurrent, policy.rate_per_s, policy.burst):
            ask = await receive(started + timeout, tenant.limits)
            timings["receive"] = (time.perf_counter() - started) * 1000
            events = self.pipeline.generate(tenant, request_id, ask, started, timings, timeout)
            async for out in events:
                if isinstance(out, Final):
                    observe(metrics.STAGES, out.timings_ms)
                    _note_final(out)
                    log.info(
                        "request_done",
                        request_id=request_id,
                        tenant=tenant.id,
                        num_items=len(out.cache),
                        timings_ms=out.timings_ms,
                        output_tokens=out.output_tokens,
                        core=out.served_by,
                    )
                yield _event(out)

    async def _upload(
        self,
        messages: AsyncIterator[gateway_pb2.UploadMessage | Malformed],
        deadline: float,
        lim: LimitsConfig,
    ) -> Ask:
        """Assembles an upload, enforcing the tenant's byte limits as each chunk arrives; the
        bytes count against the gateway's cap on unfinished uploads until the upload is
        assembled or dies."""
        it = aiter(messages)
        with self.uploads.hold() as take:
            first = await self._next(it, deadline)
            if isinstance(first, Malformed):
                raise _not_proto()
            if first is None or first.WhichOneof("kind") != "request":
                raise VisorError(
                    Reason.INVALID_REQUEST, "the first upload message must be the request"
                )
            req = first.request
            # Each item's pieces, joined once at the end: reading a bytes field copies it, and
            # appending to one growing buffer copies every byte again into fresh pages.
            parts = [[m.data] for t in req.turns for m in t.media]
            parts += [[m.data] for m in req.media]
            limits.check_count(lim, len(parts))
            sizes = [len(p[0]) for p in parts]
            total = sum(sizes)
            take(total)
            try:
                while (msg := await self._next(it, deadline)) is not None:
                    if isinstance(msg, Malformed):
                        raise _not_proto()
                    chunk = msg.chunk
                    index = chunk.media_index
                    if msg.WhichOneof("kind") != "chunk" or index >= len(parts):
                        raise VisorError(Reason.INVALID_REQUEST, "upload chunk names no media item")
                    data = chunk.data
                    sizes[index] += len(data)
                    total += len(data)
                    limits.check_bytes(lim, sizes[index], total)
                    take(len(data))
                    parts[index].append(data)
            except VisorError as err:
                parts.clear()
                if err.reason is not Reason.DEADLINE_EXCEEDED:  # the client is still sending
                    await _drain(it, min(DRAIN_S, max(0.0, deadline - time.perf_counter())))
                raise

            def join() -> list[bytes]:
                return [b"".join(p) for p in parts]

            media = join() if total < ON_LOOP_BYTES else await asyncio.to_thread(join)
        return ask_from_proto(req, media)

    async def _next(
        self, it: AsyncIterator[gateway_pb2.UploadMessage | Malformed], deadline: float
    ) -> gateway_pb2.UploadMessage | Malformed | None:
        """The upload's next message, or None at its end; bounded by the idle timeout and by
        the request's deadline, whichever comes first."""
        idle = self.receiving.upload_idle_timeout_s
        wait = min(idle, deadline - time.perf_counter())
        try:
            async with asyncio.timeout(max(0.0, wait)):
                return await anext(it, None)
        except TimeoutError:
            if wait < idle:
                raise VisorError(
                    Reason.DEADLINE_EXCEEDED, "the deadline passed while receiving the upload"
                ) from None
            raise VisorError(
                Reason.DEADLINE_EXCEEDED,
                f"no upload message arrived within upload_idle_timeout_s ({idle:g} s)",
            ) from None


# How long a refused upload's remaining messages are read and dropped before the refusal is sent.
DRAIN_S = 1.0


async def _drain(it: AsyncIterator[object], seconds: float) -> None:
    """Reads and drops what the client is still sending, for a moment. Closing a stream under a
    client's writes makes gRPC report a reset (INTERNAL, "Internal error from Core") to the
    client instead of the refusal's status; a client that stops or finishes sending within
    `seconds` reads the refusal with its reason."""
    with contextlib.suppress(Exception):  # a timeout, or the client went away
        async with asyncio.timeout(seconds):
            async for _ in it:
                pass


def add_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> None:
    """Registers the Gateway service like the generated helper does, but with deserializers that
    hand malformed bytes to the handler as MALFORMED instead of failing the call before it."""
    serialize = gateway_pb2.GenerateEvent.SerializeToString
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(gateway_pb2.GenerateRequest.FromString),
            response_serializer=serialize,
        ),
        "GenerateUpload": grpc.stream_stream_rpc_method_handler(
            servicer.GenerateUpload,
            request_deserializer=_lenient(gateway_pb2.UploadMessage.FromString),
            response_serializer=serialize,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


async def _unary(request: gateway_pb2.GenerateRequest | Malformed) -> Ask:
    if isinstance(request, Malformed):
        raise _not_proto()
    return ask_from_proto(request)

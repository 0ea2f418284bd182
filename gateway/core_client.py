"""The gateway's side of the Core API: one channel per core (mTLS when configured), its encoder
description cached, its health check, and the Infer handshake. Translates core_pb2 <-> plain
values; failures become VisorErrors (`CoreUnreachable` when the core itself could not be reached,
which the router may fail over)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.types import Delta, Params, Turn
from shared.errors import Reason, VisorError
from shared.preprocess import PreprocessRule, tiles
from shared.proto import core_pb2, core_pb2_grpc, rule_from_proto
from shared.sampling import TokenLogprob
from shared.secret import CORE_TOKEN_METADATA
from shared.status import from_rpc_error
from shared.tracing import client_interceptors
from shared.wire import chunks

CHANNEL_OPTIONS = [
    # Reconnect quickly after a core restarts instead of gRPC's default back-off of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
]


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the core's encoder takes (from Describe)."""

    core_id: str  # the core's id
    rule: PreprocessRule  # the core's rule, within this gateway's limits (see `Pipeline._plan`)
    preprocess_version: str  # version to apply (the core's, echoed: it names the rule)
    fill: tuple[int, int, int]  # letterbox colour (tiles): the encoder's mean in 0..255


def geometry_from_proto(info: core_pb2.CoreInfo) -> Geometry:
    """The core's rule; a core that predates `rule` declares the tiles rule of its old fields.
    An unusable rule makes the core unreachable for this gateway (another may do)."""
    try:
        if info.HasField("rule"):
            rule = rule_from_proto(info.rule)
        else:
            mean, std = tuple(info.image_mean), tuple(info.image_std)
            rule = tiles(info.image_size, info.tokens_per_tile, mean, std)
            rule.validate()
    except ValueError as exc:
        raise CoreUnreachable(f"the core declared an unusable preprocessing rule: {exc}") from None
    r, g, b = (round(m * 255) for m in rule.mean)
    return Geometry(info.core_id, rule, info.preprocess_version, (r, g, b))


@dataclass(frozen=True, slots=True)
class ItemHeader:
    content_hash: str  # hex SHA-256 of the bytes
    preprocess_version: str  # preprocessing version
    resolution: int  # tile side
    tile_rows: int  # grid rows
    tile_cols: int  # grid cols
    shape: tuple[int, ...]  # tensor shape
    frame: int = 0  # frame index within an animation or video
    frame_interval_s: float = 0.0  # native: seconds between its frames (a video); 0 = a still
    source_width: int = 0  # the upright source image's size (anyres tiles count tokens by it)
    source_height: int = 0


@dataclass(frozen=True, slots=True)
class CoreRequest:
    """What the core is told about a request before any pixel."""

    tenant: str  # authenticated tenant
    request_id: str  # request id
    turns: tuple[Turn, ...]  # the conversation (media bytes stay here, only counts are sent)
    params: Params  # generation controls, max_new_tokens resolved
    items: tuple[ItemHeader, ...]  # one per media item, in order
    profile: str  # compression profile
    # Core items each turn shows (an animation counts once per sampled frame); empty = one per
    # media item, as before frames were sampled.
    num_images: tuple[int, ...] = ()
    cache_ttl_s: float = 0.0  # the tenant's feature-cache TTL; 0 = the core's own
    no_cache: bool = False  # the tenant's features are neither looked up nor stored


def _header(req: CoreRequest) -> core_pb2.InferHeader:
    p = req.params
    header = core_pb2.InferHeader(
        tenant=req.tenant,
        request_id=req.request_id,
        profile=req.profile,
        cache_ttl_s=req.cache_ttl_s,
        no_cache=req.no_cache,
        params=core_pb2.CoreGenerationParams(
            max_new_tokens=p.max_new_tokens,
            min_new_tokens=p.min_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            stop=list(p.stop),
            logprobs=p.logprobs,
            top_logprobs=p.top_logprobs,
        ),
    )
    fmt = p.response_format
    if fmt is not None:  # the oneof field named by the kind (FORMAT_KINDS)
        setattr(header.params.response_format, fmt.kind, fmt.text)
    counts = req.num_images or tuple(len(t.media) for t in req.turns)
    for t, count in zip(req.turns, counts, strict=True):
        header.turns.add(role=t.role, text=t.text, num_images=count)
    for item in req.items:
        header.items.add(
            content_hash=item.content_hash,
            preprocess_version=item.preprocess_version,
            resolution=item.resolution,
            tile_rows=item.tile_rows,
            tile_cols=item.tile_cols,
            dtype="uint8",
            shape=list(item.shape),
            frame=item.frame,
            frame_interval_s=item.frame_interval_s,
            source_width=item.source_width,
            source_height=item.source_height,
        )
    return header


@dataclass(frozen=True, slots=True)
class CoreFinal:
    text: str  # the whole answer
    text_tokens: int  # prompt tokens
    visual_tokens_before: int  # encoder tokens
    visual_tokens_after: int  # after compression
    output_tokens: int  # generated tokens
    timings_ms: dict[str, float]  # core-side stages
    core_id: str  # served_by
    finish_reason: str  # "stop" or "length"


def _logprob(lp: core_pb2.CoreTokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token, lp.logprob, tuple((t.token, t.logprob) for t in lp.top))


CORE_SERVICE = "visor.v1.Core"


class CoreUnreachable(VisorError):
    """The core could not be reached or dropped the connection (transport UNAVAILABLE)."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(Reason.CORE_UNAVAILABLE, "no core is reachable", detail)

    def __reduce__(self) -> tuple[type[VisorError], tuple[Reason, str, str]]:
        return (VisorError, (self.reason, self.message, self.detail))


def _rpc_error(exc: grpc.RpcError) -> VisorError:
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        # The core refused this gateway's token (another deployment's secret): the client's own
        # key is fine, and another core may accept us.
        return CoreUnreachable("the core refused this gateway's token")
    err = from_rpc_error(exc)
    if err.reason == Reason.OVERLOADED:
        return err  # the core answered: its scheduler queue is full (not unreachable)
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        err = from_rpc_error(exc)
        # A refusal the core chose (e.g. OVERLOADED) keeps its reason; only transport failures
        # mean "this core is gone".
        return err if err.reason != Reason.CORE_UNAVAILABLE else CoreUnreachable("unavailable")
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return VisorError(Reason.DEADLINE_EXCEEDED, "the deadline passed")
    return from_rpc_error(exc)


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), (CORE_TOKEN_METADATA, token))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


# The core refuses Core RPCs without the deployment's token, so every call on a core channel
# carries it. grpc.aio files each interceptor under the first call kind it implements, hence one
# class per kind: unary-unary (Describe, health checks) and stream-stream (Infer).
class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _StreamToken(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_token(details, self._token), requests)


class CoreClient:
    def __init__(
        self,
        address: str,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str = "",
        core_token: str = "",
    ) -> None:
        """`server_name` replaces the dialled host when checking the core's certificate (set
        when `address` is an IP resolved from a DNS name the certificate carries); `core_token`
        (from the deployment secret) authenticates this gateway to the core."""
        self.address = address
        # Tracing's interceptors (when on) come first, so a call's client span covers the rest.
        interceptors = [*client_interceptors(), _UnaryToken(core_token), _StreamToken(core_token)]
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS, interceptors=interceptors
            )
        else:
            options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            self._channel = grpc.aio.secure_channel(
                address, credentials, options=options, interceptors=interceptors
            )
        self._stub = core_pb2_grpc.CoreStub(self._channel)  # type: ignore[no-untyped-call]
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._geometry: Geometry | None = None

    @property
    def core_id(self) -> str:
        """The core's own id once described (stable across restarts); "" before."""
        return self._geometry.core_id if self._geometry is not None else ""

    async def serving(self, timeout: float) -> bool:
        """grpc.health.v1 Check of the Core service: True only when it answers SERVING."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=CORE_SERVICE), timeout=timeout
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    @property
    def described(self) -> Geometry | None:
        """The geometry from the last Describe, if any (no call)."""
        return self._geometry

    async def geometry(self, timeout: float | None) -> Geometry:
        if self._geometry is None:
            try:
                info = await self._stub.Describe(core_pb2.DescribeRequest(), timeout=timeout)
            except grpc.RpcError as exc:
                raise _rpc_error(exc) from None
            self._geometry = geometry_from_proto(info)
        return self._geometry

    def forget(self) -> None:
        """Drops the cached description (the core may have restarted with another model)."""
        self._geometry = None

    async def infer(
        self,
        req: CoreRequest,
        timeout: float | None,
        pixels_for: Callable[[list[int]], Awaitable[list[np.ndarray]]],
        on_transfer: Callable[[float], None],
        handshake_timeout: float | None = None,
    ) -> AsyncIterator[Delta | CoreFinal]:
        """Runs the handshake; `pixels_for(missing)` decodes only the items the core lacks. The
        cache reply must come within `handshake_timeout` (a hung core is unreachable); the
        tokens after it have the whole `timeout`."""
        call = self._stub.Infer(timeout=timeout)
        try:
            try:
                async with asyncio.timeout(handshake_timeout):
                    await call.write(core_pb2.CoreMessage(header=_header(req)))
                    reply = await call.read()
            except TimeoutError:
                raise CoreUnreachable("no cache reply within the attempt timeout") from None
            if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "cache":
                raise CoreUnreachable("the core ended the handshake")
            missing = [i for i, held in enumerate(reply.cache.held) if not held]
            arrays = await pixels_for(missing)
            t0 = time.perf_counter()
            await _send_tensors(call, missing, arrays)
            if missing:
                on_transfer((time.perf_counter() - t0) * 1000)
            while (event := await call.read()) is not grpc.aio.EOF:
                kind = event.WhichOneof("kind")
                if kind == "delta":
                    d = event.delta
                    yield Delta(d.text, d.num_tokens, tuple(map(_logprob, d.logprobs)))
                elif kind == "final":
                    f = event.final
                    yield CoreFinal(
                        f.text,
                        f.text_tokens,
                        f.visual_tokens_before,
                        f.visual_tokens_after,
                        f.output_tokens,
                        dict(f.timings_ms),
                        f.core_id,
                        f.finish_reason,
                    )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.forget()
            raise _rpc_error(exc) from None
        finally:
            call.cancel()  # no-op when finished; stops the core's work when we are cancelled

    async def close(self) -> None:
        await self._channel.close()


async def _send_tensors(call: Any, missing: list[int], arrays: list[np.ndarray]) -> None:
    try:
        for index, array in zip(missing, arrays, strict=True):
            for piece in chunks(array):
                chunk = core_pb2.TensorChunk(item_index=index, data=piece)
                await call.write(core_pb2.CoreMessage(tensor=chunk))
        await call.done_writing()
    except asyncio.InvalidStateError:
        # The core ended the call while we were writing (it refused the request): reading the
        # call raises its status, with the core's reason.
        await call.read()
        raise CoreUnreachable("the core ended the call during the transfer") from None

"""The Python client behind `visor ask`: streams an answer from a gateway. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from shared.errors import Reason, VisorError
from shared.proto import gateway_pb2, gateway_pb2_grpc
from shared.status import from_rpc_error
from shared.wire import CHUNK_BYTES

INLINE_LIMIT = 3 * 1024 * 1024  # above this total the upload variant is used
DETAILS = {"auto": 0, "low": 1, "high": 2}


@dataclass(frozen=True, slots=True)
class Answer:
    text: str  # the whole answer
    usage: dict[str, int]  # token counts
    timings_ms: dict[str, float]  # stage timings
    cache: list[dict[str, Any]]  # per item: content_hash, hit
    served_by: str  # core id
    finish_reason: str = ""  # "stop" or "length"
    # per generated token: token, logprob, top [{token, logprob}]; None when not asked for
    logprobs: list[dict[str, Any]] | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "usage": self.usage,
            "timings_ms": self.timings_ms,
            "cache": self.cache,
            "served_by": self.served_by,
            "finish_reason": self.finish_reason,
        } | ({} if self.logprobs is None else {"logprobs": self.logprobs})


def build_request(
    prompt: str,
    media: Sequence[bytes],
    *,
    detail: str = "auto",
    profile: str = "",
    max_new_tokens: int = 0,
    **params: Any,
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        media=[gateway_pb2.Media(data=m) for m in media],
        params=gateway_pb2.GenerationParams(max_new_tokens=max_new_tokens, **params),
        profile=profile,
        detail=DETAILS[detail],  # type: ignore[arg-type]
    )


def _upload(req: gateway_pb2.GenerateRequest) -> Iterator[gateway_pb2.UploadMessage]:
    blobs = [m.data for m in req.media]
    head = gateway_pb2.GenerateRequest()
    head.CopyFrom(req)
    for m in head.media:
        m.data = b""
    yield gateway_pb2.UploadMessage(request=head)
    for index, blob in enumerate(blobs):
        for start in range(0, len(blob), CHUNK_BYTES):
            piece = blob[start : start + CHUNK_BYTES]
            yield gateway_pb2.UploadMessage(
                chunk=gateway_pb2.MediaChunk(media_index=index, data=piece)
            )


def ask(
    target: str,
    key: str,
    req: gateway_pb2.GenerateRequest,
    *,
    timeout: float | None = None,
    on_delta: Callable[[str], None] | None = None,
) -> Answer:
    """Sends one request; raises VisorError on a refusal."""
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)  # type: ignore[no-untyped-call]
        metadata = [("authorization", f"Bearer {key}")]
        big = sum(len(m.data) for m in req.media) > INLINE_LIMIT
        call = (
            stub.GenerateUpload(_upload(req), metadata=metadata, timeout=timeout)
            if big
            else stub.Generate(req, metadata=metadata, timeout=timeout)
        )
        logprobs: list[dict[str, Any]] | None = [] if req.params.logprobs else None
        try:
            for event in call:
                if event.WhichOneof("kind") == "delta":
                    if on_delta is not None:
                        on_delta(event.delta.text)
                    if logprobs is not None:
                        logprobs += map(_logprob, event.delta.logprobs)
                else:
                    return replace(_answer(event.final), logprobs=logprobs)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
    raise VisorError(Reason.INTERNAL, "the stream ended without a final event")


def _logprob(lp: gateway_pb2.TokenLogprob) -> dict[str, Any]:
    top = [{"token": t.token, "logprob": t.logprob} for t in lp.top]
    return {"token": lp.token, "logprob": lp.logprob, "top": top}


def _answer(f: gateway_pb2.Final) -> Answer:
    usage = {
        "text_tokens": f.usage.text_tokens,
        "visual_tokens_before": f.usage.visual_tokens_before,
        "visual_tokens_after": f.usage.visual_tokens_after,
        "output_tokens": f.usage.output_tokens,
    }
    cache = [{"content_hash": c.content_hash, "hit": c.hit} for c in f.cache]
    return Answer(f.text, usage, dict(f.timings_ms), cache, f.served_by, f.finish_reason)

"""What the client sends and what it hands back: request building, the upload messages for media
too large for one message, and the events of an answer (`Delta`s, then one `Answer`).

Shared by the sync (`visor.client`) and asyncio (`visor.aio`) clients; imports no numpy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.proto import gateway_pb2

# Above this many media bytes in total the request goes through GenerateUpload: one Generate
# message must stay under gRPC's 4 MiB receive limit, prompt and turns included.
INLINE_LIMIT = 3 * 1024 * 1024
UPLOAD_CHUNK_BYTES = 1 << 20  # bytes per upload chunk message
DETAILS = {
    "auto": gateway_pb2.DETAIL_AUTO,
    "low": gateway_pb2.DETAIL_LOW,
    "high": gateway_pb2.DETAIL_HIGH,
}
ROLES = {
    "user": gateway_pb2.ROLE_USER,
    "assistant": gateway_pb2.ROLE_ASSISTANT,
    "system": gateway_pb2.ROLE_SYSTEM,
}


@dataclass(frozen=True, slots=True)
class Turn:
    """One earlier turn of a conversation."""

    role: str  # "user", "assistant" or "system"
    text: str  # what was said
    media: tuple[bytes, ...] = ()  # media shown in this turn


@dataclass(frozen=True, slots=True)
class Logprob:
    """One generated token's log probability and its likeliest alternatives."""

    token: str  # the text this token completes in the answer
    logprob: float  # natural log of its probability
    top: tuple[tuple[str, float], ...]  # (token, logprob) alternatives, most likely first

    def as_json(self) -> dict[str, Any]:
        top = [{"token": t, "logprob": v} for t, v in self.top]
        return {"token": self.token, "logprob": self.logprob, "top": top}


@dataclass(frozen=True, slots=True)
class Delta:
    """Text generated since the previous event."""

    text: str  # may be empty while a character or a possible stop string is held back
    num_tokens: int  # tokens this delta covers
    logprobs: tuple[Logprob, ...] = ()  # one per token, when asked for


@dataclass(frozen=True, slots=True)
class Answer:
    """The last event of a successful request."""

    text: str  # the whole answer
    usage: dict[str, int]  # token counts
    timings_ms: dict[str, float]  # stage timings
    cache: list[dict[str, Any]]  # per item: content_hash, hit
    served_by: str  # core id
    finish_reason: str = ""  # "stop" or "length"
    logprobs: tuple[Logprob, ...] | None = None  # every delta's, in order; None when not asked

    def as_json(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "usage": self.usage,
            "timings_ms": self.timings_ms,
            "cache": self.cache,
            "served_by": self.served_by,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            out["logprobs"] = [lp.as_json() for lp in self.logprobs]
        return out


Event = Delta | Answer


def build(
    prompt: str,
    media: Sequence[bytes] = (),
    *,
    turns: Sequence[Turn] = (),
    detail: str = "auto",
    profile: str = "",
    max_visual_tokens: int = 0,
    **params: Any,
) -> gateway_pb2.GenerateRequest:
    """The request; `params` are GenerationParams fields (max_new_tokens, temperature, top_p,
    top_k, seed, stop, min_new_tokens, logprobs, top_logprobs). Unknown names raise ValueError.
    `max_visual_tokens` bounds each image's visual tokens (tiles, native pixels or views; 0 =
    unset)."""
    if detail not in DETAILS:
        raise ValueError(f"detail must be one of {sorted(DETAILS)}")
    if max_visual_tokens < 0:
        raise ValueError("max_visual_tokens must be >= 0")
    if any(t.role not in ROLES for t in turns):
        raise ValueError(f"a turn's role must be one of {sorted(ROLES)}")
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        media=[gateway_pb2.Media(data=m) for m in media],
        params=gateway_pb2.GenerationParams(**params),
        profile=profile,
        detail=DETAILS[detail],
        max_visual_tokens=max_visual_tokens,
        turns=[
            gateway_pb2.Turn(
                role=ROLES[t.role], text=t.text, media=[gateway_pb2.Media(data=m) for m in t.media]
            )
            for t in turns
        ],
    )


def _media(req: gateway_pb2.GenerateRequest) -> list[gateway_pb2.Media]:
    """Every media item in the gateway's index order: turns first, then `media`."""
    return [m for t in req.turns for m in t.media] + list(req.media)


def media_bytes(req: gateway_pb2.GenerateRequest) -> int:
    return sum(len(m.data) for m in _media(req))


def upload(req: gateway_pb2.GenerateRequest) -> Iterator[gateway_pb2.UploadMessage]:
    """The GenerateUpload stream of `req`: the request with empty media, then the bytes."""
    head = gateway_pb2.GenerateRequest()
    head.CopyFrom(req)
    for m in _media(head):
        m.data = b""
    yield gateway_pb2.UploadMessage(request=head)
    for index, item in enumerate(_media(req)):
        blob = item.data
        for start in range(0, len(blob), UPLOAD_CHUNK_BYTES):
            piece = blob[start : start + UPLOAD_CHUNK_BYTES]
            yield gateway_pb2.UploadMessage(
                chunk=gateway_pb2.MediaChunk(media_index=index, data=piece)
            )


@dataclass(slots=True)
class Events:
    """Turns one call's proto events into `Delta`s and the `Answer`, which carries every delta's
    logprobs."""

    want_logprobs: bool  # the request asked for logprobs
    num_events: int = 0  # events received so far: a retry is safe only at 0
    answer: Answer | None = None  # the final event, once received
    _logprobs: list[Logprob] = field(default_factory=list)

    def read(self, event: gateway_pb2.GenerateEvent) -> Event:
        self.num_events += 1
        if event.WhichOneof("kind") == "delta":
            d = event.delta
            lps = tuple(
                Logprob(lp.token, lp.logprob, tuple((t.token, t.logprob) for t in lp.top))
                for lp in d.logprobs
            )
            self._logprobs += lps
            return Delta(d.text, d.num_tokens, lps)
        f = event.final
        usage = {
            "text_tokens": f.usage.text_tokens,
            "visual_tokens_before": f.usage.visual_tokens_before,
            "visual_tokens_after": f.usage.visual_tokens_after,
            "output_tokens": f.usage.output_tokens,
        }
        cache = [{"content_hash": c.content_hash, "hit": c.hit} for c in f.cache]
        logprobs = tuple(self._logprobs) if self.want_logprobs else None
        self.answer = Answer(
            f.text, usage, dict(f.timings_ms), cache, f.served_by, f.finish_reason, logprobs
        )
        return self.answer

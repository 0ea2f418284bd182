"""Typed refusals and the one table that maps each reason to a gRPC status code.

Domain code raises `VisorError`; only servicers turn it into a gRPC status (see `shared.status`).
The public message names the limit and never echoes user content; `detail` is for logs only and
must itself be free of user content.
"""

from __future__ import annotations

import enum

import grpc


class Reason(enum.StrEnum):
    """Every reason a request can be refused for (DESIGN.md "Errors")."""

    UNAUTHENTICATED = "UNAUTHENTICATED"
    INVALID_REQUEST = "INVALID_REQUEST"
    UNSUPPORTED_FORMAT = "UNSUPPORTED_FORMAT"
    CORRUPT_MEDIA = "CORRUPT_MEDIA"
    MEDIA_TOO_LARGE = "MEDIA_TOO_LARGE"
    PIXEL_LIMIT = "PIXEL_LIMIT"
    FRAME_LIMIT = "FRAME_LIMIT"
    IMAGE_COUNT_LIMIT = "IMAGE_COUNT_LIMIT"
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    TOKEN_BUDGET = "TOKEN_BUDGET"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    DECODE_TIMEOUT = "DECODE_TIMEOUT"
    DECODER_CRASHED = "DECODER_CRASHED"
    OVERLOADED = "OVERLOADED"
    CORE_UNAVAILABLE = "CORE_UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"


STATUS_OF: dict[Reason, grpc.StatusCode] = {
    Reason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Reason.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.UNSUPPORTED_FORMAT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.CORRUPT_MEDIA: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.MEDIA_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.PIXEL_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.FRAME_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.IMAGE_COUNT_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.PROMPT_TOO_LONG: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.TOKEN_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.QUOTA_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.DECODE_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.DECODER_CRASHED: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.OVERLOADED: grpc.StatusCode.UNAVAILABLE,
    Reason.CORE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.INTERNAL: grpc.StatusCode.INTERNAL,
}


class VisorError(Exception):
    """A refusal: a reason, a public message (safe to show the client), a log-only detail, and
    how long the caller should wait before trying again when the refusal knows (travels as a
    google.rpc.RetryInfo)."""

    def __init__(
        self, reason: Reason, message: str, detail: str = "", retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.detail = detail
        self.retry_after_s = retry_after_s

    @property
    def code(self) -> grpc.StatusCode:
        return STATUS_OF[self.reason]

    def __reduce__(self) -> tuple[type[VisorError], tuple[object, ...]]:
        # Decode workers raise these in another process; keep them picklable.
        return (VisorError, (self.reason, self.message, self.detail, self.retry_after_s))

    def __repr__(self) -> str:
        return f"VisorError({self.reason.value}, {self.message!r})"

"""Typed refusals for callers: one exception class per ErrorInfo reason.

Every class is a `VisorError` (from `shared.errors`, the one table of reasons and their gRPC
status codes), so `except VisorError` catches them all and each carries `reason`, `code` (the
gRPC status), `message` (names the limit) and `retry_after_s` (the server's google.rpc.RetryInfo
hint, or None). Reading a failed call is `shared.status.from_rpc_error`; this module only picks
the class.
"""

from __future__ import annotations

from typing import ClassVar

import grpc

from shared import status
from shared.errors import Reason, VisorError


class _Refusal(VisorError):
    """A VisorError whose class names its reason."""

    REASON: ClassVar[Reason]

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(self.REASON, message, retry_after_s=retry_after_s)

    def __reduce__(self) -> tuple[type[VisorError], tuple[object, ...]]:
        return (type(self), (self.message, self.retry_after_s))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class Unauthenticated(_Refusal):
    REASON = Reason.UNAUTHENTICATED


class InvalidRequest(_Refusal):
    REASON = Reason.INVALID_REQUEST


class UnsupportedFormat(_Refusal):
    REASON = Reason.UNSUPPORTED_FORMAT


class CorruptMedia(_Refusal):
    REASON = Reason.CORRUPT_MEDIA


class MediaTooLarge(_Refusal):
    REASON = Reason.MEDIA_TOO_LARGE


class PixelLimit(_Refusal):
    REASON = Reason.PIXEL_LIMIT


class FrameLimit(_Refusal):
    REASON = Reason.FRAME_LIMIT


class ImageCountLimit(_Refusal):
    REASON = Reason.IMAGE_COUNT_LIMIT


class PromptTooLong(_Refusal):
    REASON = Reason.PROMPT_TOO_LONG


class TokenBudget(_Refusal):
    REASON = Reason.TOKEN_BUDGET


class QuotaExceeded(_Refusal):
    REASON = Reason.QUOTA_EXCEEDED


class DecodeTimeout(_Refusal):
    REASON = Reason.DECODE_TIMEOUT


class DecoderCrashed(_Refusal):
    REASON = Reason.DECODER_CRASHED


class Overloaded(_Refusal):
    REASON = Reason.OVERLOADED


class CoreUnavailable(_Refusal):
    REASON = Reason.CORE_UNAVAILABLE


class DeadlineExceeded(_Refusal):
    REASON = Reason.DEADLINE_EXCEEDED


class InternalError(_Refusal):
    REASON = Reason.INTERNAL


# Built from the classes, so a reason without a class is caught by tests/unit/test_client_units.py.
ERROR_OF: dict[Reason, type[_Refusal]] = {cls.REASON: cls for cls in _Refusal.__subclasses__()}


def typed(err: VisorError) -> VisorError:
    """`err` as the class of its reason."""
    return ERROR_OF[err.reason](err.message, err.retry_after_s)


def from_rpc_error(exc: grpc.RpcError) -> VisorError:
    """The typed refusal a failed call carried (by status code when it had no ErrorInfo)."""
    return typed(status.from_rpc_error(exc))


__all__ = [
    "ERROR_OF",
    "CoreUnavailable",
    "CorruptMedia",
    "DeadlineExceeded",
    "DecodeTimeout",
    "DecoderCrashed",
    "FrameLimit",
    "ImageCountLimit",
    "InternalError",
    "InvalidRequest",
    "MediaTooLarge",
    "Overloaded",
    "PixelLimit",
    "PromptTooLong",
    "QuotaExceeded",
    "Reason",
    "TokenBudget",
    "Unauthenticated",
    "UnsupportedFormat",
    "VisorError",
    "from_rpc_error",
    "typed",
]

"""visor's Python client and command line.

`visor.Client` (sync) and `visor.AsyncClient` (asyncio) call a gateway; refusals raise the
`visor.errors` class of their reason, all `VisorError`s. The command line is `visor.cli`. Nothing
here imports torch, Pillow or numpy: `pip install visor` without extras is enough to call visor.
"""

from __future__ import annotations

from visor.aio import AsyncClient
from visor.client import Client
from visor.errors import (
    CoreUnavailable,
    CorruptMedia,
    DeadlineExceeded,
    DecoderCrashed,
    DecodeTimeout,
    FrameLimit,
    ImageCountLimit,
    InternalError,
    InvalidRequest,
    MediaTooLarge,
    Overloaded,
    PixelLimit,
    PromptTooLong,
    QuotaExceeded,
    Reason,
    TokenBudget,
    Unauthenticated,
    UnsupportedFormat,
    VisorError,
)
from visor.request import Answer, Delta, Logprob, Turn
from visor.retry import NO_RETRY, Retry

__all__ = [
    "NO_RETRY",
    "Answer",
    "AsyncClient",
    "Client",
    "CoreUnavailable",
    "CorruptMedia",
    "DeadlineExceeded",
    "DecodeTimeout",
    "DecoderCrashed",
    "Delta",
    "FrameLimit",
    "ImageCountLimit",
    "InternalError",
    "InvalidRequest",
    "Logprob",
    "MediaTooLarge",
    "Overloaded",
    "PixelLimit",
    "PromptTooLong",
    "QuotaExceeded",
    "Reason",
    "Retry",
    "TokenBudget",
    "Turn",
    "Unauthenticated",
    "UnsupportedFormat",
    "VisorError",
]

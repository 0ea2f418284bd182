"""The documented ranges of the generation parameters. The gateway checks them, and the core checks
them again (it does not trust the gateway): one bad value must be refused before it reaches a
step it shares with other tenants' sequences. Refusals name the parameter, never its value.
Also the token logprob value and the response format that both services relay."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import Reason, VisorError

MAX_TEMPERATURE = 100.0  # above this the distribution is uniform to float32 precision anyway
GREEDY_BELOW = 1e-5  # smaller temperatures decode greedily (dividing by them overflows float32)
MAX_TOP_K = 1000  # keep at most this many candidates; 0 = no top-k filter
MAX_TOP_LOGPROBS = 20  # alternatives reported per token, as OpenAI's API and vLLM's default
FORMAT_KINDS = ("json_schema", "regex", "grammar")  # ResponseFormat's oneof in gateway.proto


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's logprob under the model's raw distribution (see gateway.proto)."""

    token: str  # the text this token completes in the answer
    logprob: float  # natural log of its probability
    top: tuple[tuple[str, float], ...] = ()  # (token, logprob) alternatives, most likely first


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What the answer is constrained to (see gateway.proto's ResponseFormat)."""

    kind: str  # one of FORMAT_KINDS
    text: str  # the JSON schema (as JSON text), the regex or the Lark grammar


def check_response_format(fmt: ResponseFormat | None, max_bytes: int, limit: str) -> None:
    """A known kind, non-empty, at most `max_bytes` UTF-8 bytes (named `limit` in the refusal):
    compiling costs time in its size. Whether it compiles is the core's question (it holds the
    tokenizer)."""
    if fmt is None:
        return
    if fmt.kind not in FORMAT_KINDS:
        raise VisorError(Reason.INVALID_REQUEST, "unknown response_format kind")
    if not fmt.text:
        raise VisorError(Reason.INVALID_REQUEST, f"response_format.{fmt.kind} is empty")
    if len(fmt.text.encode()) > max_bytes:
        raise VisorError(
            Reason.INVALID_REQUEST, f"response_format.{fmt.kind} exceeds {limit} ({max_bytes})"
        )


def check_sampling(
    temperature: float, top_p: float, top_k: int, min_new_tokens: int, max_new_tokens: int
) -> None:
    """Finite values in range: temperature in [0, 100], top_p in [0, 1] (0 = 1), top_k in
    [0, 1000], 0 <= min_new_tokens <= max_new_tokens."""
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise VisorError(
            Reason.INVALID_REQUEST, f"temperature must be a finite number in [0, {MAX_TEMPERATURE}]"
        )
    if not (math.isfinite(top_p) and 0 <= top_p <= 1):
        raise VisorError(Reason.INVALID_REQUEST, "top_p must be a finite number in [0, 1]")
    if not 0 <= top_k <= MAX_TOP_K:
        raise VisorError(Reason.INVALID_REQUEST, f"top_k must be in [0, {MAX_TOP_K}]")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise VisorError(Reason.INVALID_REQUEST, "min_new_tokens exceeds max_new_tokens")


def check_logprobs(logprobs: bool, top_logprobs: int) -> None:
    """top_logprobs in [0, 20], and above 0 only with logprobs."""
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise VisorError(Reason.INVALID_REQUEST, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    if top_logprobs and not logprobs:
        raise VisorError(Reason.INVALID_REQUEST, "top_logprobs needs logprobs")


def check_stop(stop: tuple[str, ...], max_strings: int, max_bytes: int) -> None:
    """At most `max_strings` stop strings of at most `max_bytes` UTF-8 bytes each: matching them
    costs every generated token this much."""
    if len(stop) > max_strings:
        raise VisorError(
            Reason.INVALID_REQUEST, f"more than max_stop_strings ({max_strings}) stop strings"
        )
    if any(len(s.encode()) > max_bytes for s in stop):
        raise VisorError(
            Reason.INVALID_REQUEST, f"a stop string exceeds max_stop_bytes ({max_bytes})"
        )

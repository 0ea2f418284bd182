"""Request-level limits, checked before any media is parsed. Refusals name the limit only."""

from __future__ import annotations

from gateway.config import LimitsConfig
from gateway.tenants import TenantPolicy
from gateway.types import Ask
from shared.errors import Reason, VisorError
from shared.sampling import check_logprobs, check_response_format, check_sampling, check_stop
from shared.wire import PROFILES


def check_bytes(limits: LimitsConfig, item_bytes: int, request_bytes: int) -> None:
    """Called while receiving, so an upload stops at the first byte over a limit."""
    if item_bytes > limits.max_item_bytes:
        raise VisorError(
            Reason.MEDIA_TOO_LARGE, f"a media item exceeds max_item_bytes ({limits.max_item_bytes})"
        )
    if request_bytes > limits.max_request_bytes:
        raise VisorError(
            Reason.MEDIA_TOO_LARGE,
            f"the request exceeds max_request_bytes ({limits.max_request_bytes})",
        )


def check_count(limits: LimitsConfig, num_items: int) -> None:
    if num_items > limits.max_items:
        raise VisorError(
            Reason.IMAGE_COUNT_LIMIT,
            f"the request has more than max_items ({limits.max_items}) media items",
        )


def check_request(limits: LimitsConfig, ask: Ask) -> int:
    """Checks the whole request; returns the effective max_new_tokens."""
    media = [m for t in ask.turns for m in t.media]
    check_count(limits, len(media))
    total = 0
    for item in media:
        total += len(item)
        check_bytes(limits, len(item), total)
    if not ask.turns or not any(t.text or t.media for t in ask.turns):
        raise VisorError(Reason.INVALID_REQUEST, "the request has no prompt, turn or media")
    text_bytes = sum(len(t.text.encode()) for t in ask.turns)
    text_bytes += sum(len(s.encode()) for s in ask.params.stop)
    fmt = ask.params.response_format
    text_bytes += len(fmt.text.encode()) if fmt else 0
    if text_bytes > limits.max_prompt_bytes:
        raise VisorError(
            Reason.PROMPT_TOO_LONG, f"text exceeds max_prompt_bytes ({limits.max_prompt_bytes})"
        )
    if ask.profile and ask.profile not in PROFILES:
        raise VisorError(
            Reason.INVALID_REQUEST, f"unknown compression profile; available: {', '.join(PROFILES)}"
        )
    p = ask.params
    wanted = p.max_new_tokens or limits.default_new_tokens
    if wanted > limits.max_new_tokens:
        raise VisorError(
            Reason.TOKEN_BUDGET, f"max_new_tokens exceeds the cap ({limits.max_new_tokens})"
        )
    check_sampling(p.temperature, p.top_p, p.top_k, p.min_new_tokens, wanted)
    check_stop(p.stop, limits.max_stop_strings, limits.max_stop_bytes)
    check_logprobs(p.logprobs, p.top_logprobs)
    check_response_format(fmt, limits.max_prompt_bytes, "max_prompt_bytes")
    return wanted


def check_profile(policy: TenantPolicy, requested: str) -> str:
    """The compression profile a request runs with: its own (known to check_request), else the
    tenant's default; one outside the tenant's policy is refused."""
    chosen = requested or policy.default_profile
    if chosen not in policy.profiles:
        raise VisorError(
            Reason.INVALID_REQUEST,
            "the compression profile is not allowed by the tenant's policy; allowed: "
            + ", ".join(policy.profiles),
        )
    return chosen

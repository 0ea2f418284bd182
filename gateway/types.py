"""Values that cross the gateway's boundary (servicer <-> pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling import ResponseFormat, TokenLogprob


@dataclass(frozen=True, slots=True)
class Turn:
    role: str  # "user", "assistant" or "system"
    text: str  # what was said
    media: tuple[bytes, ...] = ()  # encoded files shown in this turn


@dataclass(frozen=True, slots=True)
class Params:
    max_new_tokens: int = 0  # 0 = the deployment default
    min_new_tokens: int = 0  # end-of-sequence suppressed before this many tokens
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 0.0  # 0 = 1
    top_k: int = 0  # 0 = off
    seed: int = 0  # 0 = derived from the request id
    stop: tuple[str, ...] = ()  # stop strings
    logprobs: bool = False  # report each token's logprob
    top_logprobs: int = 0  # alternatives reported per token
    response_format: ResponseFormat | None = None  # what the answer must match; None = free text


@dataclass(frozen=True, slots=True)
class Ask:
    """One request after the servicer unpacked it."""

    turns: tuple[Turn, ...]  # the conversation, the shorthand prompt already appended
    params: Params  # generation controls
    profile: str  # compression profile ("" = default)
    detail: str  # "auto", "low" or "high"
    max_visual_tokens: int = 0  # per image, before compression; 0 = unset


@dataclass(frozen=True, slots=True)
class Delta:
    text: str  # new text
    num_tokens: int  # tokens covered
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token covered, when asked for


@dataclass(frozen=True, slots=True)
class Final:
    text: str  # the whole answer
    text_tokens: int  # prompt tokens
    visual_tokens_before: int  # encoder tokens
    visual_tokens_after: int  # tokens after compression
    output_tokens: int  # generated tokens
    cache: tuple[tuple[str, bool], ...]  # (content hash, hit) per item
    served_by: str  # core id
    finish_reason: str  # "stop" or "length"
    timings_ms: dict[str, float] = field(default_factory=dict)  # every stage that ran

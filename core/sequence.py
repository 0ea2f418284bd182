"""One request's state inside the scheduler (ids, parameters, status, progress, block hashes),
and the events a request's stream receives. No tensors, generator, grammar matcher or event sink:
those live with the model runner and the engine, keyed by `seq_id`. Written only on the model
thread (the caller's side reads its timestamps once a token has arrived)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from core.kv_cache import ImageSpan, hash_block
from core.types import SamplingParams
from shared.errors import Reason


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class EngineFailure(Exception):
    """Sent to a request's stream when the model thread failed while running it, or stopped."""

    def __init__(self, reason: Reason = Reason.INTERNAL) -> None:
        super().__init__(reason.value)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SampleLogprobs:
    """Logprobs of one step under the model's raw distribution, as ids and floats: the caller's
    event loop turns the ids into text."""

    logprob: float  # of the sampled token
    top_ids: tuple[int, ...]  # the likeliest ids, most likely first
    top_logprobs: tuple[float, ...]  # their logprobs, in the same order


@dataclass(frozen=True, slots=True)
class Token:
    """One sampled token. The model thread sends ids only: detokenising and stop strings run on
    the caller's event loop, so their cost never lands on the thread every tenant shares."""

    token_id: int  # the sampled id (never an end-of-sequence id)
    logprobs: SampleLogprobs | None = None  # only when the request asked for them


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a request's stream from the model thread (a stop string, found on the
    caller's side, ends a stream without one)."""

    num_output_tokens: int  # generated tokens (an end-of-sequence token counts)
    finish_reason: str  # "stop" or "length"
    timings_ms: dict[str, float]  # queue, prefill, generate


Event = Token | Finished | EngineFailure


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int  # unique per engine
    tenant: str  # for fair share
    salt: bytes  # tenant salt of the block hashes
    token_ids: list[int]  # prompt then outputs
    num_prompt_tokens: int  # prompt length
    spans: tuple[ImageSpan, ...]  # where images sit in the prompt
    params: SamplingParams  # generation controls
    arrival: float  # perf_counter at submission
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # positions whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix map at admission
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, in order
    first_scheduled: float = 0.0  # perf_counter of the first step that ran it
    first_token: float = 0.0  # perf_counter of its first output token
    num_preemptions: int = 0  # times it lost its blocks
    arrival_clock: int = 0  # the scheduler's token clock when it was added

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def hashes_upto(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Hashes of the first `num_blocks` full blocks, computed once and remembered."""
        while len(self.block_hashes) < num_blocks:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else b""
            tokens = self.token_ids[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(
                hash_block(parent, tokens, self.spans, i * block_size, self.salt)
            )
        return self.block_hashes[:num_blocks]

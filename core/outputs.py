"""What one engine step passes between its three parts (vLLM v1's `SchedulerOutput`,
`ModelRunnerOutput` and `EngineCoreOutput`):

```
scheduler.schedule() -> SchedulerOutput -> runner.execute() -> RunnerOutput
scheduler.update(SchedulerOutput, RunnerOutput) -> list[EngineOutput] -> the engine's streams
```

The scheduler sends a request's inputs once, the first time it runs (`NewRequestData`); after
that only which tokens run. The runner answers with ids, never finishing anything: the scheduler
decides from its answer who is done."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.sequence import RequestStatus, SampleLogprobs
from core.types import SamplingParams
from shared.errors import Reason

if TYPE_CHECKING:  # the scheduler passes these along untouched: it never imports torch
    import numpy as np

    from core.compression import Kept
    from core.structured import Grammar


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """What the runner needs to build a request's state (embeddings, generator, matcher)."""

    seq_id: int  # the request's id in the engine
    prompt_token_ids: tuple[int, ...]  # image slots already expanded to their visual tokens
    features: tuple[np.ndarray, ...]  # (visual tokens, hidden) per item, in order; () = text
    params: SamplingParams  # generation controls
    seed: int  # seeds the request's sampling generator
    grammar: Grammar | None  # compiled response format (shared, read-only); None = free text
    grids: tuple[tuple[int, int, int], ...] = ()  # per item (t, h, w) in merged-token units, for
    # the model's rope positions ((1, 1, 1) per item of a tiled encoder)
    spans: tuple[
        tuple[int, int], ...
    ] = ()  # per run of image tokens (an item, or a Gemma view), its [start, end) in the prompt
    kept: tuple[Kept | None, ...] = ()  # per span, which of its uncompressed tokens the features
    # kept (their rope positions stay theirs); None = every one, in order
    seconds: tuple[float, ...] = ()  # per item, a video's seconds per temporal patch; 0 = image


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq_id: int  # who runs
    start: int  # tokens already in the KV cache: the position of the first new one
    num_tokens: int  # how many of its tokens run this step
    block_ids: tuple[int, ...]  # the blocks holding positions 0..start + num_tokens - 1, in order
    sample: bool  # the chunk ends at the request's newest token: sample the next one after it


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    new_requests: tuple[NewRequestData, ...]  # running for the first time this step
    chunks: tuple[ScheduledChunk, ...]  # in execution order
    num_batched_tokens: int  # sum of the chunks' num_tokens
    preempted: tuple[int, ...]  # lost their blocks this step (their runner state stays)
    finished_ids: tuple[int, ...]  # left since the last step: the runner drops their state


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """The runner's answer to one `SchedulerOutput`. A request with an error has no token: its
    reason is INTERNAL, or INVALID_REQUEST when its response format went past the grammar
    limits while generating."""

    sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> token sampled after it
    logprobs: dict[int, SampleLogprobs] = field(default_factory=dict)  # asked for, not for EOS
    grammar_done: frozenset[int] = frozenset()  # grammar complete: only EOS follows (or it came)
    errors: dict[int, Reason] = field(default_factory=dict)  # seq_id -> why it failed alone

    @classmethod
    def failed(cls, seq_ids: Iterable[int]) -> RunnerOutput:
        """A step whose batched forward pass failed: it cannot be pinned on one request."""
        return cls(errors=dict.fromkeys(seq_ids, Reason.INTERNAL))


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """One request's news after a step, for its stream."""

    seq_id: int  # whose
    token_id: int | None  # a token to stream; None when it sampled EOS or failed
    logprobs: SampleLogprobs | None  # of token_id, when asked for
    num_output_tokens: int  # generated so far, an EOS included
    status: RequestStatus  # RUNNING, or how it finished
    failure: Reason | None = None  # why it ended, when it failed

"""Token-budget decisions on the real `Scheduler` and `KVCacheManager`, without a model: steps
are simulated (every sequence whose prompt is in gets one new token per step), so the order in
which prefills and decodes share steps can be checked exactly."""

from __future__ import annotations

import torch

from core.kv_cache import KVCacheManager
from core.scheduler import Scheduler
from core.sequence import RequestStatus, Sequence
from core.types import SamplingParams


def _scheduler(decode_step_tokens: int) -> Scheduler:
    kv = KVCacheManager(num_blocks=1024, block_size=16, enable_prefix_caching=False)
    return Scheduler(kv, "token-budget", 256, 32, 8, True, 256, decode_step_tokens)


def _seq(seq_id: int, prompt: int, new: int) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        tenant="t",
        salt=b"",
        token_ids=list(range(1, prompt + 1)),
        num_prompt_tokens=prompt,
        prompt_embeds=torch.empty(0),
        spans=(),
        params=SamplingParams(max_new_tokens=new),
        gen=torch.Generator(),
        sink=lambda event: None,
        arrival=0.0,
    )


def _step(sched: Scheduler) -> dict[int, int]:
    """One step: the scheduled tokens per seq_id; a sequence whose prompt is in gains a token
    and finishes at its max_new_tokens, as the runner does."""
    out = sched.schedule()
    sched.update(out)
    for chunk in out.chunks:
        seq = chunk.seq
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(0)
            if seq.num_output_tokens >= seq.params.max_new_tokens:
                sched.finish(seq, RequestStatus.FINISHED_LENGTH)
    return {c.seq.seq_id: c.num_new_tokens for c in out.chunks}


def _run(decode_step_tokens: int) -> list[dict[int, int]]:
    sched = _scheduler(decode_step_tokens)
    sched.add(_seq(0, prompt=32, new=5))  # a short question, nearly done once it decodes
    sched.add(_seq(1, prompt=1024, new=5))  # a long visual prompt
    steps = []
    while sched.has_work():
        steps.append(_step(sched))
    return steps


def test_a_long_prefill_waits_for_a_nearly_done_answer() -> None:
    steps = _run(decode_step_tokens=32)
    assert steps[0] == {0: 32, 1: 224}  # both start; nobody decodes yet
    # The short one's 4 remaining tokens run alone (1024 - 224 tokens of prompt cost more than
    # 4 decode steps), then the long prefill resumes in full chunks.
    assert steps[1:5] == [{0: 1}] * 4
    assert steps[5] == {1: 256}
    assert sum(s.get(1, 0) for s in steps) == 1024 + 4  # nothing lost: prompt + 4 decode steps


def test_without_the_rule_the_answer_rides_along_the_prefill() -> None:
    steps = _run(decode_step_tokens=0)
    assert steps[1] == {0: 1, 1: 255 // 16 * 16}
    assert all(0 in s and 1 in s for s in steps[1:5])  # each of its decode steps pays a chunk


def test_a_yielding_prefill_runs_once_it_has_waited_its_own_size() -> None:
    """A stream of short requests always has a decoder one step from done; the long prefill
    still runs once it is past its deadline (arrival + length on the engine's token clock)."""
    sched = _scheduler(decode_step_tokens=32)
    sched.add(_seq(0, prompt=512, new=1))
    first_run = None
    for i in range(1, 200):
        sched.add(_seq(i, prompt=16, new=3))
        if 0 in _step(sched) and i > 1:
            first_run = i
            break
    assert first_run is not None, "the long prefill starved"
    # Step 1 runs 256 tokens (its first chunk beside the first short one, no decoder yet); it
    # then yields until the clock reaches 512: 256 more tokens at 16 + 2 per step.
    assert 14 <= first_run <= 17

"""Token-budget decisions on the real `Scheduler` and `KVCacheManager`, without a model: steps
are simulated (every sequence whose prompt is in gets one new token per step), so the order in
which prefills and decodes share steps can be checked exactly."""

from __future__ import annotations

from core.config import SchedulerConfig
from core.outputs import NewRequestData, RunnerOutput
from core.scheduler import Scheduler
from core.sequence import Sequence
from core.types import SamplingParams


def _scheduler(decode_step_tokens: int) -> Scheduler:
    cfg = SchedulerConfig(
        max_batch_tokens=256,
        max_prefill_chunk=256,
        decode_step_tokens=decode_step_tokens,
        prefix_caching=False,
    )
    return Scheduler(cfg, num_blocks=1024, eos_ids={2}, tile=16)


def _add(sched: Scheduler, seq_id: int, prompt: int, new: int) -> None:
    params = SamplingParams(max_new_tokens=new)
    ids = list(range(3, prompt + 3))  # never the EOS id
    seq = Sequence(seq_id, "t", b"", ids, prompt, (), params, arrival=0.0)
    sched.add(seq, NewRequestData(seq_id, tuple(ids), (), params, 0, None))


def _step(sched: Scheduler) -> dict[int, int]:
    """One step: the scheduled tokens per seq_id; every chunk that reaches its sequence's newest
    token samples a token (never EOS), and the scheduler finishes it at max_new_tokens."""
    out = sched.schedule()
    sched.update(out, RunnerOutput({c.seq_id: 7 for c in out.chunks if c.sample}))
    return {c.seq_id: c.num_tokens for c in out.chunks}


def _run(decode_step_tokens: int) -> list[dict[int, int]]:
    sched = _scheduler(decode_step_tokens)
    _add(sched, 0, prompt=32, new=5)  # a short question, nearly done once it decodes
    _add(sched, 1, prompt=1024, new=5)  # a long visual prompt
    steps = []
    while sched.has_work():
        step = _step(sched)
        if step:  # not a step that only tells the runner who finished
            steps.append(step)
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
    _add(sched, 0, prompt=512, new=1)
    first_run = None
    for i in range(1, 200):
        _add(sched, i, prompt=16, new=3)
        if 0 in _step(sched) and i > 1:
            first_run = i
            break
    assert first_run is not None, "the long prefill starved"
    # Step 1 runs 256 tokens (its first chunk beside the first short one, no decoder yet); it
    # then yields until the clock reaches 512: 256 more tokens at 16 + 2 per step.
    assert 14 <= first_run <= 17

"""The step protocol on the real `Scheduler`, with no model: `schedule()` sends a request's inputs
once, `update()` with a hand-written `RunnerOutput` appends tokens and is the one place a request
finishes (EOS, complete grammar, length, a failure the runner reports), `finish_requests` ends
requests from outside a step, and every finished id reaches the runner exactly once. Also the
structure the step loop relies on: the runner never imports the scheduler, the scheduler never
imports torch, and request state holds no tensors."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import typing

import pytest

from core.config import Policy, SchedulerConfig
from core.outputs import NewRequestData, RunnerOutput, SchedulerOutput
from core.scheduler import Scheduler
from core.sequence import RequestStatus, SampleLogprobs, Sequence
from core.types import SamplingParams
from shared.errors import Reason
from tests.conftest import ROOT

EOS = 2


def _scheduler(num_blocks: int = 64, **overrides: typing.Any) -> Scheduler:
    cfg = SchedulerConfig(max_batch_tokens=64, max_prefill_chunk=64)
    cfg = dataclasses.replace(cfg, **overrides)
    return Scheduler(cfg, num_blocks=num_blocks, eos_ids={EOS}, tile=16)


def _add(sched: Scheduler, seq_id: int, prompt: int = 20, **params: typing.Any) -> Sequence:
    p = SamplingParams(**{"max_new_tokens": 8, **params})
    ids = [100 + seq_id] * prompt
    seq = Sequence(seq_id, f"t{seq_id}", b"", ids, prompt, (), p, arrival=0.0)
    sched.add(seq, NewRequestData(seq_id, tuple(ids), (), p, seq_id, None))
    return seq


def _sampling(out: SchedulerOutput) -> list[int]:
    return [c.seq_id for c in out.chunks if c.sample]


def test_inputs_go_to_the_runner_once_and_tokens_are_appended() -> None:
    sched = _scheduler()
    seq = _add(sched, 0, prompt=20)
    first = sched.schedule()
    assert [n.seq_id for n in first.new_requests] == [0]
    (chunk,) = first.chunks
    assert (chunk.start, chunk.num_tokens, chunk.sample) == (0, 20, True)
    assert len(chunk.block_ids) == 2 and first.num_batched_tokens == 20
    lp = SampleLogprobs(-0.5, (7,), (-0.5,))
    outs = sched.update(first, RunnerOutput({0: 7}, {0: lp}))
    assert [(o.seq_id, o.token_id, o.logprobs, o.status) for o in outs] == [
        (0, 7, lp, RequestStatus.RUNNING)
    ]
    assert seq.token_ids[-1] == 7 and seq.num_computed_tokens == 20
    second = sched.schedule()
    assert second.new_requests == () and second.chunks[0].start == 20
    assert second.chunks[0].num_tokens == 1 and second.chunks[0].sample


def test_eos_ends_the_request_unstreamed_and_frees_its_blocks_at_once() -> None:
    sched = _scheduler()
    _add(sched, 0)
    _add(sched, 1)
    out = sched.schedule()
    lp = SampleLogprobs(-0.1, (EOS,), (-0.1,))
    got = sched.update(out, RunnerOutput({0: EOS, 1: 9}, {0: lp}))
    assert [(o.seq_id, o.token_id, o.logprobs, o.status) for o in got] == [
        (0, None, None, RequestStatus.FINISHED_STOPPED),  # EOS is not streamed
        (1, 9, None, RequestStatus.RUNNING),
    ]
    assert got[0].num_output_tokens == 1  # the EOS counts
    assert sched.kv.tables.keys() == {1}
    nxt = sched.schedule()
    assert nxt.finished_ids == (0,) and [c.seq_id for c in nxt.chunks] == [1]
    sched.update(nxt, RunnerOutput({1: 9}))
    assert sched.schedule().finished_ids == ()  # told once


def test_length_and_a_complete_grammar_end_a_request() -> None:
    sched = _scheduler()
    _add(sched, 0, max_new_tokens=2)
    _add(sched, 1, max_new_tokens=50)
    statuses: dict[int, RequestStatus] = {}
    for _ in range(3):
        out = sched.schedule()
        tokens = dict.fromkeys(_sampling(out), 5)
        done = frozenset({1}) if len(sched.running) == 1 else frozenset()
        for o in sched.update(out, RunnerOutput(tokens, grammar_done=done)):
            statuses[o.seq_id] = o.status
            assert o.token_id == 5  # the last token of either is streamed
    assert statuses == {0: RequestStatus.FINISHED_LENGTH, 1: RequestStatus.FINISHED_STOPPED}
    assert not sched.running and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_eos_before_min_new_tokens_ends_only_where_the_grammar_allowed_it() -> None:
    """The runner holds EOS back until min_new_tokens unless the grammar allows nothing else
    (then it reports the grammar complete): an early EOS with that is a stop, one without it
    breaks the runner's side of the step and ends the request as INTERNAL."""
    sched = _scheduler()
    _add(sched, 0, min_new_tokens=3)
    _add(sched, 1, min_new_tokens=3)
    out = sched.schedule()
    got = sched.update(out, RunnerOutput({0: EOS, 1: EOS}, grammar_done=frozenset({0})))
    assert [(o.seq_id, o.status, o.failure) for o in got] == [
        (0, RequestStatus.FINISHED_STOPPED, None),
        (1, RequestStatus.FINISHED_ABORTED, Reason.INTERNAL),
    ]
    _add(sched, 2, min_new_tokens=1)
    statuses = []
    for token in (5, EOS):  # from the second token on, EOS is a plain stop
        out = sched.schedule()
        statuses += [o.status for o in sched.update(out, RunnerOutput({2: token}))]
    assert statuses == [RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED]


def test_a_runner_error_ends_its_request_alone() -> None:
    sched = _scheduler()
    _add(sched, 0)
    _add(sched, 1)
    out = sched.schedule()
    got = sched.update(out, RunnerOutput({1: 4}, errors={0: Reason.INVALID_REQUEST}))
    assert [(o.seq_id, o.status, o.failure) for o in got] == [
        (0, RequestStatus.FINISHED_ABORTED, Reason.INVALID_REQUEST),
        (1, RequestStatus.RUNNING, None),
    ]
    assert [s.seq_id for s in sched.running] == [1] and sched.kv.tables.keys() == {1}


@pytest.mark.parametrize("result", [RunnerOutput.failed([0, 1]), RunnerOutput({1: 4})])
def test_a_failed_step_or_a_missing_token_ends_those_requests(result: RunnerOutput) -> None:
    """A batched forward failure ends every request of the step; a sampling chunk the runner
    left without a token or an error is a bug, ended as INTERNAL rather than run again."""
    sched = _scheduler()
    _add(sched, 0)
    _add(sched, 1)
    got = {o.seq_id: o.failure for o in sched.update(sched.schedule(), result)}
    assert got[0] == Reason.INTERNAL
    assert (got[1] is None) == (1 in result.sampled)


def test_finish_requests_ends_waiting_and_running_requests_once() -> None:
    sched = _scheduler(max_num_seqs=1)
    _add(sched, 0)
    _add(sched, 1)  # waits: one running at a time
    sched.update(sched.schedule(), RunnerOutput({0: 5}))
    sched.finish_requests([0, 1, 1, 99], RequestStatus.FINISHED_ABORTED)
    assert not sched.running and sched.num_waiting == 0 and sched.has_work()
    out = sched.schedule()
    assert out.finished_ids == (0, 1) and out.chunks == ()
    assert not sched.has_work() and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_preemption_keeps_runner_state_and_recomputes() -> None:
    """Two requests, three blocks: the newer is preempted, listed once, not sent as new again,
    and recomputes from position 0: its prompt, then the token it had sampled (no new sample
    until it is back where it was)."""
    sched = _scheduler(num_blocks=3, prefix_caching=False)
    _add(sched, 0, prompt=16, max_new_tokens=30)
    _add(sched, 1, prompt=16, max_new_tokens=30)
    out = sched.schedule()
    assert [n.seq_id for n in out.new_requests] == [0, 1]
    sched.update(out, RunnerOutput({0: 5, 1: 6}))
    out = sched.schedule()  # each needs a second block; only one is free
    assert out.preempted == (1,) and [c.seq_id for c in out.chunks] == [0]
    sched.update(out, RunnerOutput({0: 5}))
    sched.finish_requests([0], RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert out.new_requests == () and out.finished_ids == (0,)
    (chunk,) = out.chunks
    assert (chunk.seq_id, chunk.start, chunk.num_tokens, chunk.sample) == (1, 0, 16, False)
    sched.update(out, RunnerOutput())
    (chunk,) = sched.schedule().chunks
    assert (chunk.seq_id, chunk.start, chunk.num_tokens, chunk.sample) == (1, 16, 1, True)


def test_chunked_prefill_samples_only_after_its_last_chunk() -> None:
    sched = _scheduler(max_batch_tokens=32, max_prefill_chunk=32)
    _add(sched, 0, prompt=70)
    shapes = []
    for _ in range(3):
        out = sched.schedule()
        shapes.append([(c.start, c.num_tokens, c.sample) for c in out.chunks])
        sched.update(out, RunnerOutput(dict.fromkeys(_sampling(out), 5)))
    assert shapes == [[(0, 32, False)], [(32, 32, False)], [(64, 6, True)]]


@pytest.mark.parametrize(
    ("policy", "first_step"),
    [(Policy.TOKEN_BUDGET, 3), (Policy.REQUEST_COUNT, 2), (Policy.NONE, 1)],
)
def test_the_policy_enum_sets_how_many_start_together(policy: Policy, first_step: int) -> None:
    sched = _scheduler(policy=policy.value, batch_size=2)
    assert sched.policy is policy
    for i in range(3):
        _add(sched, i, prompt=16)
    out = sched.schedule()
    assert len(out.chunks) == first_step


def test_sequence_holds_no_tensor_generator_or_sink() -> None:
    hints = typing.get_type_hints(Sequence)
    text = " ".join(str(h) for h in hints.values())
    assert not any(word in text for word in ("Tensor", "Generator", "Callable", "Grammar"))
    assert not {"prompt_embeds", "gen", "sink", "grammar"} & set(hints)


def _imports(module: str) -> set[str]:
    tree = ast.parse((ROOT / module).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_runner_does_not_import_the_scheduler() -> None:
    imported = _imports("core/runner.py")
    assert "core.scheduler" not in imported and "core.outputs" in imported


def test_the_scheduler_runs_without_torch() -> None:
    code = "import sys, core.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

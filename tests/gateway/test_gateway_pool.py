"""The decode pool's sharing rules with real worker processes: a free worker goes to the tenant
holding the fewest, a request's jobs share one decode budget (waiting for a worker is free), the
request's deadline bounds every job, and a caller that goes away does not cost a worker.

Ordering is asserted rather than wall-clock waits wherever the rule allows it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from gateway.pool import Budget, DecodePool, PoolSettings, Reply
from shared.errors import Reason, VisorError

MIB = 1024 * 1024


class Pool:
    """A pool with the `test:*` jobs and the one event loop it lives in."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.runner = asyncio.Runner()
        settings = PoolSettings(workers, timeout_s, 1000, 1 << 25, 1024 * MIB, 8 * MIB, 64, True)
        self.pool = DecodePool(settings)
        self.runner.run(self.pool.start())

    def sleep(self, seconds: float, budget: Budget | None = None) -> asyncio.Future[Reply]:
        """A job that holds its worker for `seconds`, started now (call inside the loop)."""
        return asyncio.ensure_future(self.pool.run("test:sleep", {"seconds": seconds}, b"", budget))

    def run_sleep(self, seconds: float, budget: Budget | None = None) -> Reply:
        return self.runner.run(self.pool.run("test:sleep", {"seconds": seconds}, b"", budget))

    def settle(self) -> list[int]:
        self.runner.run(self.pool.drain())
        return self.pool.pids()

    def close(self) -> None:
        self.pool.close()
        self.runner.close()


@pytest.fixture
def two() -> Iterator[Pool]:
    p = Pool(2, 5.0)
    yield p
    p.close()


@pytest.fixture
def one() -> Iterator[Pool]:
    p = Pool(1, 5.0)
    yield p
    p.close()


def test_a_flooding_tenant_does_not_stand_between_another_tenant_and_the_next_worker(
    two: Pool,
) -> None:
    async def scenario() -> list[str]:
        finished: list[str] = []

        async def job(tenant: str) -> None:
            await two.sleep(0.4, Budget(tenant))
            finished.append(tenant)

        flood = [asyncio.ensure_future(job("a")) for _ in range(8)]
        await asyncio.sleep(0.1)  # a holds both workers and six of its jobs wait
        await asyncio.gather(*flood, job("b"))
        return finished

    finished = two.runner.run(scenario())
    # b takes the first worker a frees, so it ends with a's third or fourth job; first come,
    # first served would have made it wait for all eight.
    assert finished.index("b") <= 3, finished
    assert finished.count("a") == 8


def test_tenants_with_backlogs_take_turns(one: Pool) -> None:
    async def scenario() -> list[str]:
        order: list[str] = []

        async def job(tenant: str) -> None:
            await one.sleep(0.05, Budget(tenant))
            order.append(tenant)

        first = asyncio.ensure_future(job("a"))  # takes the only worker
        await asyncio.sleep(0.01)
        rest = [job("a") for _ in range(3)] + [job("b") for _ in range(3)]
        await asyncio.gather(first, *rest)
        return order

    # One worker: whoever holds none goes next, oldest first among equals.
    assert one.runner.run(scenario()) == ["a", "a", "b", "a", "b", "a", "b"]


def test_a_request_s_jobs_share_one_decode_budget() -> None:
    """Four 0.7 s jobs under a 1.0 s budget: the first two end inside it, the last two are cut
    off when the budget runs out (~1.0 s), not each after a budget of its own."""
    pool = Pool(2, 1.0)
    try:
        before = pool.settle()

        async def scenario() -> list[object]:
            budget = Budget("t")
            jobs = [pool.sleep(0.7, budget) for _ in range(4)]
            return await asyncio.gather(*jobs, return_exceptions=True)

        t0 = time.monotonic()
        results = pool.runner.run(scenario())
        elapsed = time.monotonic() - t0
        assert sum(isinstance(r, Reply) for r in results) == 2
        refused = [r for r in results if isinstance(r, VisorError)]
        assert [r.reason for r in refused] == [Reason.DECODE_TIMEOUT] * 2
        assert "decode_timeout_s" in refused[0].message
        assert elapsed < 1.0 + 0.6  # per job budgets would have served all four by 1.4 s
        after = pool.settle()
        assert len(after) == 2 and not set(before) & set(after)  # both cut-off workers replaced
        # A new request has a budget of its own.
        assert isinstance(pool.run_sleep(0.7, Budget("t")), Reply)
    finally:
        pool.close()


def test_waiting_for_a_worker_does_not_spend_the_budget() -> None:
    pool = Pool(1, 1.0)
    try:

        async def scenario() -> list[object]:
            first = pool.sleep(0.7, Budget("a"))
            await asyncio.sleep(0.05)
            second = pool.sleep(0.7, Budget("b"))  # waits 0.65 s, then runs 0.7 s: within 1.0
            return await asyncio.gather(first, second, return_exceptions=True)

        assert all(isinstance(r, Reply) for r in pool.runner.run(scenario()))
    finally:
        pool.close()


def test_the_request_deadline_bounds_a_running_and_a_waiting_job(one: Pool) -> None:
    before = one.settle()
    jobs_before = one.pool.num_jobs["test:sleep"]

    async def scenario() -> list[object]:
        deadline = time.perf_counter() + 0.3
        running = one.sleep(2.0, Budget("a", deadline))
        waiting = one.sleep(0.1, Budget("b", deadline))
        return await asyncio.gather(running, waiting, return_exceptions=True)

    t0 = time.monotonic()
    results = one.runner.run(scenario())
    assert all(isinstance(r, VisorError) for r in results), results
    assert [r.reason for r in results] == [Reason.DEADLINE_EXCEEDED] * 2  # type: ignore[union-attr]
    assert time.monotonic() - t0 < 1.5
    assert one.pool.num_jobs["test:sleep"] == jobs_before + 1  # the waiting one never ran
    assert one.settle() != before  # the running one's worker was killed and replaced


def test_a_cancel_mid_job_keeps_the_worker_and_the_pool_usable(one: Pool) -> None:
    before = one.settle()

    async def scenario() -> dict[str, object]:
        job = one.sleep(0.5)
        await asyncio.sleep(0.2)  # the worker is inside the job now
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        return (await one.pool.run("test:echo", {}, b"x")).body

    echoed = one.runner.run(scenario())
    assert one.settle() == before  # the same worker, never killed
    assert echoed["pid"] in before and not one.pool.exit_codes


def test_a_cancelled_job_past_its_deadline_still_gets_its_worker_killed() -> None:
    pool = Pool(1, 0.5)
    try:
        before = pool.settle()

        async def scenario() -> None:
            job = pool.sleep(3.0)
            await asyncio.sleep(0.1)
            job.cancel()
            with pytest.raises(asyncio.CancelledError):
                await job

        pool.runner.run(scenario())
        after = pool.settle()
        assert len(after) == 1 and after != before
    finally:
        pool.close()


def test_a_cancel_while_waiting_leaves_the_queue(one: Pool) -> None:
    jobs_before = one.pool.num_jobs["test:sleep"]

    async def scenario() -> None:
        busy = one.sleep(0.3)
        await asyncio.sleep(0.05)
        waiting = one.sleep(0.3)
        await asyncio.sleep(0.05)
        waiting.cancel()
        await busy
        await one.sleep(0.01)  # served at once: nothing is left in the queue ahead of it

    one.runner.run(scenario())
    assert one.pool.num_jobs["test:sleep"] == jobs_before + 2


def test_a_worker_that_dies_between_jobs_is_replaced_before_a_job_needs_it(two: Pool) -> None:
    before = two.settle()
    os.kill(before[0], signal.SIGKILL)  # as an operator or the OOM killer would

    async def replaced() -> list[int]:
        while before[0] in two.pool.pids() or len(two.pool.pids()) < 2:
            await asyncio.sleep(0.02)
        await two.pool.drain()
        return two.pool.pids()

    after = two.runner.run(asyncio.wait_for(replaced(), 30))
    assert before[1] in after and before[0] not in after
    assert two.pool.exit_codes[-1] == -signal.SIGKILL
    assert not two.pool.num_jobs  # no job ran, so none could have found it dead

    async def both() -> list[Reply]:  # taken at once, so each from its own worker
        return list(await asyncio.gather(*(two.pool.run("test:echo", {}, b"x") for _ in "ab")))

    assert {r.body["pid"] for r in two.runner.run(both())} == set(after)

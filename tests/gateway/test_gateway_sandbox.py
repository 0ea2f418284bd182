"""The decode sandbox with real worker processes: escape attempts die, limits hold, a killed or
stuck worker costs only its own job, and churn leaves no zombie or orphan behind.

The `test:*` jobs exist only in a pool built with `test_jobs=True`; the gateway never builds one.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.pool import DecodePool, PoolSettings, Reply
from shared.errors import Reason, VisorError

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[2]


class Harness:
    """A pool and the one event loop it lives in."""

    def __init__(
        self, workers: int = 2, timeout_s: float = 2.0, test_jobs: bool = True, queue: int = 64
    ) -> None:
        self.runner = asyncio.Runner()
        settings = PoolSettings(
            workers, timeout_s, 1000, 1 << 25, 1024 * MIB, 8 * MIB, queue, test_jobs
        )
        self.pool = DecodePool(settings)
        self.report = self.runner.run(self.pool.start())

    def run(self, job: str, args: dict[str, object] | None = None, data: bytes = b"") -> dict:
        return self.runner.run(self.pool.run(job, args or {}, data)).body  # type: ignore[no-any-return]

    def refusal(self, job: str, args: dict[str, object] | None = None) -> VisorError:
        with pytest.raises(VisorError) as info:
            self.run(job, args)
        return info.value

    def settle(self) -> list[int]:
        self.runner.run(self.pool.drain())
        return self.pool.pids()

    def close(self) -> None:
        self.pool.close()
        self.runner.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def _protected(h: Harness, name: str) -> None:
    if h.report.get(name) != "active":
        pytest.skip(f"{name} is not available on this host: {h.report.get(name)}")


@pytest.mark.parametrize("job", ["test:socket", "test:exec", "test:open", "test:fork"])
def test_escape_attempts_kill_the_worker(harness: Harness, job: str) -> None:
    _protected(harness, "seccomp")
    before = harness.settle()
    err = harness.refusal(job)
    assert err.reason is Reason.DECODER_CRASHED
    assert harness.pool.exit_codes[-1] == -signal.SIGSYS  # killed by the seccomp filter
    after = harness.settle()
    assert len(after) == len(before) == 2
    assert len(set(before) - set(after)) == 1  # only the worker that tried was replaced
    assert harness.run("test:echo", data=b"abc")["num_bytes"] == 3


def test_open_refused_even_for_a_harmless_path(harness: Harness) -> None:
    _protected(harness, "seccomp")
    assert harness.refusal("test:open", {"path": "/dev/null"}).reason is Reason.DECODER_CRASHED


def test_allocating_past_the_address_space_limit_fails_cleanly(harness: Harness) -> None:
    _protected(harness, "rlimits")
    err = harness.refusal("test:alloc", {"bytes": 4096 * MIB})
    assert err.reason is Reason.DECODER_CRASHED
    assert "memory" in err.message
    assert harness.run("test:alloc", {"bytes": 16 * MIB})["allocated"] == 16 * MIB
    assert len(harness.settle()) == 2


def test_a_stuck_job_times_out_and_only_its_worker_is_replaced(harness: Harness) -> None:
    before = harness.settle()

    async def both() -> list[object]:
        spin = harness.pool.run("test:spin", {})
        quick = harness.pool.run("test:sleep", {"seconds": 0.2})
        return await asyncio.gather(spin, quick, return_exceptions=True)

    t0 = time.monotonic()
    spun, slept = harness.runner.run(both())
    assert isinstance(spun, VisorError) and spun.reason is Reason.DECODE_TIMEOUT
    assert not isinstance(slept, BaseException)
    assert time.monotonic() - t0 < 5
    after = harness.settle()
    assert len(after) == 2 and len(set(before) & set(after)) == 1


def test_a_worker_killed_from_outside_costs_its_job_one_retry_not_the_request(
    harness: Harness,
) -> None:
    harness.settle()

    async def scenario() -> tuple[list[object], int]:
        jobs = [
            asyncio.ensure_future(harness.pool.run("test:sleep", {"seconds": 1.0}))
            for _ in range(2)
        ]
        await asyncio.sleep(0.3)  # both workers are now inside their job
        victim = harness.pool.pids()[0]
        os.kill(victim, signal.SIGKILL)
        return await asyncio.gather(*jobs, return_exceptions=True), victim

    results, victim = harness.runner.run(scenario())
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert -signal.SIGKILL in harness.pool.exit_codes
    after = harness.settle()
    assert len(after) == 2 and victim not in after


def test_a_job_whose_worker_is_killed_twice_is_decoder_crashed() -> None:
    h = Harness(workers=1)

    async def scenario() -> object:
        job = asyncio.ensure_future(h.pool.run("test:sleep", {"seconds": 1.0}))
        killed: list[int] = []
        for _ in range(2):
            while not h.pool.pids() or h.pool.pids()[0] in killed:  # the replacement starts
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the job (the first run, then its retry) is inside it
            killed.append(h.pool.pids()[0])
            os.kill(killed[-1], signal.SIGKILL)
        return (await asyncio.gather(job, return_exceptions=True))[0]

    try:
        failed = h.runner.run(scenario())
        assert isinstance(failed, VisorError) and failed.reason is Reason.DECODER_CRASHED
        assert len(h.settle()) == 1
    finally:
        h.close()


def test_a_full_queue_is_overloaded() -> None:
    h = Harness(workers=1, queue=2)

    async def flood() -> list[object]:
        jobs = [h.pool.run("test:sleep", {"seconds": 0.3}) for _ in range(5)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        results = h.runner.run(flood())
        refused = [r for r in results if isinstance(r, VisorError)]
        # One runs, two wait, two are refused at once.
        assert [r.reason for r in refused] == [Reason.OVERLOADED] * 2
    finally:
        h.close()


def test_test_jobs_are_unreachable_without_the_test_flag() -> None:
    h = Harness(workers=1, test_jobs=False)
    try:
        assert h.refusal("test:socket").reason is Reason.INTERNAL
        assert h.settle() == h.pool.pids() and len(h.pool.pids()) == 1
    finally:
        h.close()


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of the direct children of `pid`, read from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            out.append((int(entry.name), fields[0]))
    return out


def test_churn_leaves_no_zombie_or_orphan_and_a_steady_worker_count() -> None:
    """1,000 jobs, 10% hostile: each hostile job costs a worker, so 100 are killed and respawned."""
    h = Harness(workers=3, queue=1000)
    hostile = ["test:socket", "test:exec", "test:open", "test:fork", "test:alloc"]
    seen: set[int] = set(h.pool.pids())
    try:

        async def churn() -> list[object]:
            jobs = []
            for i in range(1000):
                if i % 10 == 0:
                    job, args = hostile[(i // 10) % len(hostile)], {"bytes": 4096 * MIB}
                else:
                    job, args = "test:echo", {}
                jobs.append(h.pool.run(job, args, b"x"))
            return await asyncio.gather(*jobs, return_exceptions=True)

        results = h.runner.run(churn())
        errors = [r for r in results if isinstance(r, VisorError)]
        assert len(errors) == 100
        assert all(e.reason is Reason.DECODER_CRASHED for e in errors)
        assert sum(isinstance(r, Reply) for r in results) == 900
        pids = h.settle()
        assert len(pids) == 3
        seen |= set(pids)
        kids = _children(os.getpid())
        zombies = [k for k in kids if k[1] == "Z"]
        assert not zombies
        workers_alive = {pid for pid, _ in kids} & seen
        assert workers_alive == set(pids)
    finally:
        h.close()
    time.sleep(0.2)
    assert not {pid for pid, _ in _children(os.getpid())} & seen
    for pid in seen:  # no orphan re-parented elsewhere either
        assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_check_sandbox_cli_reports_every_protection() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "visor.cli", "gateway", "--check-sandbox"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    for name in ("rlimits", "no_new_privs", "seccomp", "netns", "unprivileged_uid"):
        assert name in out.stdout
    assert out.returncode == (0 if "missing" not in out.stdout else 1), out.stdout


def test_media_reaches_the_worker_whole_through_shared_memory_or_the_pipe(
    harness: Harness,
) -> None:
    """Media that fits the worker's 8 MiB buffer travels through it; larger media through the
    pipe. Either way the worker sees exactly the bytes sent."""
    rng = random.Random(0)
    for size in (0, 1, 445_831, 8 * MIB, 8 * MIB + 1, 9 * MIB):
        data = rng.randbytes(size)
        body = harness.run("test:echo", {}, data)
        assert (body["num_bytes"], body["crc32"]) == (size, zlib.crc32(data)), size


def test_workers_yield_the_cpu_to_the_gateway(harness: Harness) -> None:
    from gateway.sandbox import WORKER_NICE

    expected = min(19, os.nice(0) + WORKER_NICE)
    for pid in harness.settle():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(fields[16]) == expected  # field 19 of proc(5): the nice value

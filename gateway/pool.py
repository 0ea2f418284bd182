"""The sandboxed decode pool: worker processes of our own (spawned before the gRPC server), one
job at a time each, jobs over a pipe, pixels back through shared memory.

Workers are shared fairly between tenants: a free worker goes to the waiting tenant that holds the
fewest workers, taking turns among equals, so one tenant's backlog never stands between another
tenant's job and the next free worker. A request's jobs share one `Budget`:
`timeout_s` bounds their decode time together (counted once while several run), and no job runs
past the request's deadline.

A job past its deadline, or a worker that dies, costs only that job: that one worker is killed,
reaped and replaced while the others keep serving. A caller that goes away (a cancelled request)
does not kill a worker: its job finishes in the background within its deadline, the reply is
dropped and the worker serves again. A worker is recycled after `max_jobs` jobs. Replies are JSON
and shapes are checked against what was asked for: nothing a worker sends is trusted (it is never
unpickled).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import math
import mmap
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import recv_handle
from typing import Any

import numpy as np

from gateway import sandbox, worker
from shared import logs
from shared.errors import Reason, VisorError

log = logs.get("gateway.pool")
MAX_REPLY_BYTES = 64 * 1024
START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """Plain values the pool needs (the server unpacks GatewayConfig into these)."""

    workers: int  # worker processes
    timeout_s: float  # decode time per request (all its jobs), and so per job at most
    max_jobs: int  # jobs before a worker is recycled
    max_pixels: int  # Pillow's bomb threshold inside workers
    memory_bytes: int  # RLIMIT_AS per worker
    shm_bytes: int  # pixel buffer per worker
    max_queue: int  # jobs waiting for a worker before OVERLOADED
    test_jobs: bool = False  # only tests enable the `test:*` jobs


@dataclass(frozen=True, slots=True)
class Reply:
    """A worker's answer: its JSON body and any pixel arrays copied out of shared memory."""

    body: dict[str, Any]  # the `ok` object
    arrays: tuple[np.ndarray, ...]  # (tiles, 3, S, S) uint8 per item, when pixels were asked for


class _Worker:
    def __init__(self, proc: BaseProcess, conn: Connection, shm: mmap.mmap, report: dict[str, str]):
        self.proc, self.conn, self.shm, self.report = proc, conn, shm, report
        self.jobs = 0

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)


def _spawn(settings: PoolSettings) -> _Worker:
    """Starts one worker and waits until it is hardened (blocking; run off the event loop)."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process holding gRPC objects
    parent, child = ctx.Pipe(duplex=True)
    cpu = math.ceil(settings.timeout_s) + 1
    policy = sandbox.Policy(settings.memory_bytes, cpu * (settings.max_jobs + 2), 64)
    args = worker.WorkerArgs(
        policy, settings.shm_bytes, settings.max_pixels, cpu, settings.test_jobs
    )
    proc = ctx.Process(target=worker.main, args=(child, args), name="visor-decode", daemon=True)
    proc.start()
    sandbox.lower_priority(int(proc.pid or 0))
    child.close()
    try:
        if not parent.poll(START_TIMEOUT_S):
            raise TimeoutError
        fd = recv_handle(parent)
        try:
            shm = mmap.mmap(fd, settings.shm_bytes)
        finally:
            os.close(fd)
        if not parent.poll(START_TIMEOUT_S):
            raise TimeoutError
        ready = json.loads(parent.recv_bytes(MAX_REPLY_BYTES))
        report = {str(k): str(v) for k, v in dict(ready["ready"]).items()}
    except BaseException:
        _reap(proc)
        parent.close()
        raise RuntimeError("a decode worker did not start") from None
    return _Worker(proc, parent, shm, report)


def _reap(proc: BaseProcess) -> None:
    with contextlib.suppress(ProcessLookupError, TypeError):
        os.kill(int(proc.pid), signal.SIGKILL)  # type: ignore[arg-type]
    proc.join(timeout=10)


@dataclass(slots=True)
class Budget:
    """One request's claim on the pool: the tenant its jobs count against, the decode time they
    have used, and the request's deadline (`time.perf_counter()` seconds). Time counts while at
    least one of its jobs holds a worker, once however many run together: waiting for a worker
    is free, and jobs running side by side share one clock."""

    tenant: str = ""  # whose share of the workers these jobs use
    deadline: float | None = None  # when the request ends; None = no deadline
    _used_s: float = field(default=0.0, init=False)  # busy spells that have ended
    _running: int = field(default=0, init=False)  # jobs holding a worker now
    _since: float = field(default=0.0, init=False)  # when the current busy spell began

    def used_s(self, now: float) -> float:
        return self._used_s + (now - self._since if self._running else 0.0)

    def start(self, now: float) -> None:
        if not self._running:
            self._since = now
        self._running += 1

    def stop(self, now: float) -> None:
        self._running -= 1
        if not self._running:
            self._used_s += now - self._since


_Entry = tuple[int, "asyncio.Future[_Worker]"]  # (arrival number, the waiting job's future)


class DecodePool:
    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self._idle: list[_Worker] = []
        self._all: dict[int, _Worker] = {}
        self._waiting: dict[str, collections.deque[_Entry]] = {}  # by tenant, oldest first
        self._num_waiting = 0
        self._held: collections.Counter[str] = collections.Counter()  # workers busy per tenant
        self._turns: dict[str, int] = {}  # when each waiting tenant was last handed a worker
        self._arrivals = itertools.count()  # orders waiting jobs and hand-outs alike
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # where idle workers are watched
        self.report: dict[str, str] = {}
        self.exit_codes: collections.deque[int] = collections.deque(maxlen=64)  # for health/tests
        self.num_jobs: collections.Counter[str] = collections.Counter()  # sent to workers, by job

    @property
    def timeout_s(self) -> float:
        return self.settings.timeout_s

    async def start(self) -> dict[str, str]:
        """Starts every worker now, before any server socket exists; returns the protections
        the first worker reports (all workers run the same code on the same host)."""
        self._loop = asyncio.get_running_loop()
        for _ in range(self.settings.workers):
            w = await asyncio.to_thread(_spawn, self.settings)
            self._all[w.pid] = w
            self._idle_push(w)
        self.report = next(iter(self._all.values())).report
        return self.report

    def pids(self) -> list[int]:
        return sorted(self._all)

    async def run(
        self, job: str, args: dict[str, Any], data: bytes = b"", budget: Budget | None = None
    ) -> Reply:
        """Runs one job on a worker under `budget`, shared by a request's jobs (by default one of
        its own: no tenant, no deadline). Once a worker has it, the job runs to its reply or its
        deadline even if the caller is cancelled meanwhile."""
        budget = budget if budget is not None else Budget()
        for retried in (False, True):
            w = await self._acquire(budget)
            task = asyncio.get_running_loop().create_task(self._job(w, budget, job, args, data))
            self._track(task)
            try:
                return await asyncio.shield(task)
            except _Killed:
                # SIGKILL comes from outside the worker (an operator, the OOM killer), never from
                # the media's own code path: the job gets one more, fresh worker.
                if retried:
                    break
        raise VisorError(Reason.DECODER_CRASHED, "the decoder was killed twice on this media")

    async def _acquire(self, budget: Budget) -> _Worker:
        tenant = budget.tenant
        if self._idle and not self._num_waiting:
            self._held[tenant] += 1
            return self._idle_pop()
        if self._num_waiting >= self.settings.max_queue:
            raise VisorError(Reason.OVERLOADED, "the decode queue is full; retry later")
        entry: _Entry = (next(self._arrivals), asyncio.get_running_loop().create_future())
        self._waiting.setdefault(tenant, collections.deque()).append(entry)
        self._num_waiting += 1
        try:
            async with asyncio.timeout(_seconds_to(budget.deadline)):
                return await entry[1]
        except BaseException as exc:
            self._abandon(tenant, entry)
            if isinstance(exc, TimeoutError):
                raise VisorError(
                    Reason.DEADLINE_EXCEEDED, "the deadline passed while waiting for a decoder"
                ) from None
            raise

    def _abandon(self, tenant: str, entry: _Entry) -> None:
        """A waiting job gave up: it leaves the queue, or hands on the worker it was just given."""
        queue = self._waiting.get(tenant)
        if queue is not None and entry in queue:
            queue.remove(entry)
            self._num_waiting -= 1
            if not queue:
                self._forget(tenant)
        elif entry[1].done() and not entry[1].cancelled():
            self._unhold(tenant)
            self._idle_push(entry[1].result())
            self._dispatch()

    def _dispatch(self) -> None:
        """Hands free workers to waiting jobs: first to the tenant that holds the fewest workers;
        among equals, to the one served least recently (turns), then the longest waiting."""
        while self._idle and self._waiting:
            tenant = min(self._waiting, key=self._priority)
            queue = self._waiting[tenant]
            _, fut = queue.popleft()
            self._num_waiting -= 1
            self._turns[tenant] = next(self._arrivals)
            if not queue:
                self._forget(tenant)
            if fut.done():  # its caller is gone
                continue
            self._held[tenant] += 1
            fut.set_result(self._idle_pop())

    def _idle_push(self, w: _Worker) -> None:
        """Makes `w` free for jobs, watched: a free worker says nothing until given a job, so
        its pipe turning readable means it died (EOF) or misbehaves; either way it is replaced
        then, not when a job next finds it dead."""
        assert self._loop is not None
        self._loop.add_reader(w.conn.fileno(), self._idle_spoke, w)
        self._idle.append(w)

    def _idle_pop(self) -> _Worker:
        w = self._idle.pop()
        assert self._loop is not None
        self._loop.remove_reader(w.conn.fileno())
        return w

    def _idle_spoke(self, w: _Worker) -> None:
        assert self._loop is not None
        self._loop.remove_reader(w.conn.fileno())
        self._idle.remove(w)
        self._all.pop(w.pid, None)
        self._track(self._loop.create_task(self._replace(w, died=True)))

    def _priority(self, tenant: str) -> tuple[int, int, int]:
        return self._held[tenant], self._turns.get(tenant, -1), self._waiting[tenant][0][0]

    def _forget(self, tenant: str) -> None:
        """A tenant with nothing waiting keeps no turn: its next job queues as a newcomer's."""
        del self._waiting[tenant]
        self._turns.pop(tenant, None)

    def _unhold(self, tenant: str) -> None:
        self._held[tenant] -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant]

    def _limit(self, budget: Budget, now: float) -> tuple[float, VisorError]:
        """How long this job may run, and its refusal when that runs out."""
        left = self.timeout_s - budget.used_s(now)
        if budget.deadline is not None and budget.deadline - now < left:
            return budget.deadline - now, VisorError(
                Reason.DEADLINE_EXCEEDED, "the deadline passed"
            )
        message = f"decoding took longer than decode_timeout_s ({self.timeout_s:g} s)"
        return left, VisorError(Reason.DECODE_TIMEOUT, message)

    async def _job(
        self, w: _Worker, budget: Budget, job: str, args: dict[str, Any], data: bytes
    ) -> Reply:
        now = time.perf_counter()
        limit, refusal = self._limit(budget, now)
        if limit <= 0:  # nothing left: the worker never sees this job
            self._release(w, budget.tenant, True)
            raise refusal
        self.num_jobs[job] += 1
        keep = False  # a worker whose job did not end in a clean reply is replaced
        budget.start(now)
        try:
            reply = await self._exchange(w, job, args, data, limit, refusal)
            keep = True
            return reply
        except _Refusal as refused:
            keep = not refused.recycle
            raise VisorError(refused.reason, refused.message, refused.detail) from None
        finally:
            budget.stop(time.perf_counter())
            self._release(w, budget.tenant, keep)

    async def _exchange(
        self,
        w: _Worker,
        job: str,
        args: dict[str, Any],
        data: bytes,
        limit_s: float,
        refusal: VisorError,
    ) -> Reply:
        w.jobs += 1
        try:
            header: dict[str, Any] = {"job": job, "args": args}
            if len(data) <= len(w.shm):
                # The media goes through the worker's shared buffer, idle between jobs: one copy,
                # and no pipe transfer that would block this event loop while the worker reads.
                w.shm[: len(data)] = data
                header["shm_input"], data = len(data), b""
            w.conn.send_bytes(json.dumps(header).encode())
            w.conn.send_bytes(data)
            raw = await asyncio.wait_for(self._recv(w.conn), limit_s)
        except TimeoutError:
            log.warning("decode_timeout", pid=w.pid, reason=refusal.reason.value)
            raise refusal from None
        except (EOFError, OSError):
            code = await asyncio.to_thread(_exit_code, w.proc)
            self.exit_codes.append(code)
            log.warning("decoder_crashed", pid=w.pid, code=code)
            if code == -signal.SIGXCPU:
                raise VisorError(Reason.DECODE_TIMEOUT, "decoding exceeded its CPU limit") from None
            if code == -signal.SIGKILL:
                raise _Killed(Reason.DECODER_CRASHED, "the decoder was killed") from None
            raise VisorError(Reason.DECODER_CRASHED, "the decoder crashed on this media") from None
        return _parse(raw, w.shm)

    async def _recv(self, conn: Connection) -> bytes:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = conn.fileno()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        # A reply is one small write, so once readable it is all there (or EOF).
        return conn.recv_bytes(MAX_REPLY_BYTES)

    def _release(self, w: _Worker, tenant: str, keep: bool) -> None:
        self._unhold(tenant)
        if keep and w.jobs < self.settings.max_jobs and not self._closed:
            self._idle_push(w)
            self._dispatch()
            return
        self._all.pop(w.pid, None)
        self._track(asyncio.get_running_loop().create_task(self._replace(w)))

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        # Retrieved here: a job whose caller went away has no one else to see how it ended.
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, VisorError):
            log.error(
                "decode_pool_error", error_type=type(exc).__name__, where=logs.error_site(exc)
            )

    async def _replace(self, old: _Worker, died: bool = False) -> None:
        await asyncio.to_thread(_retire, old)
        if died:
            code = _exit_code(old.proc)  # reaped: returns at once
            self.exit_codes.append(code)
            log.warning("decoder_crashed", pid=old.pid, code=code, idle=True)
        while not self._closed:
            try:
                new = await asyncio.to_thread(_spawn, self.settings)
            except RuntimeError:
                log.error("decode_worker_start_failed")
                await asyncio.sleep(1.0)
                continue
            if self._closed:
                await asyncio.to_thread(_retire, new)
                return
            self._all[new.pid] = new
            self._idle_push(new)
            self._dispatch()
            return

    async def drain(self) -> None:
        """Waits until jobs whose callers went away and replacements in flight are done (tests
        use it to count workers)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        """Kills every worker; on the pool's event loop, or once it no longer runs."""
        self._closed = True
        while self._idle:
            self._idle_pop()
        for w in list(self._all.values()):
            _retire(w)
        self._all.clear()


def _seconds_to(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.perf_counter()


def _exit_code(proc: BaseProcess) -> int:
    proc.join(timeout=5)
    return int(proc.exitcode) if proc.exitcode is not None else 0


def _retire(w: _Worker) -> None:
    with contextlib.suppress(OSError):
        w.conn.close()
    _reap(w.proc)
    with contextlib.suppress(BufferError, ValueError):
        w.shm.close()


def _parse(raw: bytes, shm: mmap.mmap) -> Reply:
    """Reads a worker's reply without trusting it: known keys only, sizes checked."""
    try:
        msg = json.loads(raw)
        if not isinstance(msg, dict):
            raise ValueError
    except ValueError:
        raise VisorError(Reason.DECODER_CRASHED, "the decoder sent a malformed reply") from None
    if "error" in msg:
        err = msg["error"]
        try:
            reason = Reason(err["reason"])
        except (KeyError, ValueError, TypeError):
            reason = Reason.DECODER_CRASHED
        message = str(err.get("message", ""))[:200] or "the decoder refused this media"
        detail = str(err.get("detail", ""))[:64]
        raise _Refusal(VisorError(reason, message, detail), bool(err.get("recycle", False)))
    body = msg.get("ok")
    if not isinstance(body, dict):
        raise VisorError(Reason.DECODER_CRASHED, "the decoder sent a malformed reply")
    return Reply(body, _arrays(body.get("shapes"), shm))


class _Killed(VisorError):
    """The worker died of SIGKILL while running the job."""


class _Refusal(VisorError):
    """A worker's clean refusal: the worker itself is fine unless it asked to be recycled."""

    def __init__(self, err: VisorError, recycle: bool) -> None:
        super().__init__(err.reason, err.message, err.detail)
        self.recycle = recycle


def _arrays(shapes: object, shm: mmap.mmap) -> tuple[np.ndarray, ...]:
    if shapes is None:
        return ()
    if not isinstance(shapes, list):
        raise VisorError(Reason.DECODER_CRASHED, "the decoder sent a malformed reply")
    out, offset = [], 0
    for shape in shapes:
        dims = tuple(int(d) for d in shape)
        if len(dims) != 4 or dims[1] != 3 or min(dims) < 1:
            raise VisorError(Reason.DECODER_CRASHED, "the decoder sent a malformed reply")
        n = math.prod(dims)
        if offset + n > len(shm):
            raise VisorError(Reason.DECODER_CRASHED, "the decoder sent a malformed reply")
        out.append(np.frombuffer(shm, np.uint8, n, offset).reshape(dims).copy())
        offset += n
    return tuple(out)

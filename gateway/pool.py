"""The sandboxed decode pool: worker processes of our own (spawned before the gRPC server), one
job at a time each, jobs over a pipe, pixels back through shared memory.

A job past its wall-clock deadline, or a worker that dies, costs only that job: that one worker
is killed, reaped and replaced while the others keep serving. A worker is recycled after
`max_jobs` jobs. Replies are JSON and shapes are checked against what was asked for: nothing a
worker sends is trusted (it is never unpickled).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import mmap
import multiprocessing
import os
import signal
from dataclasses import dataclass
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
    timeout_s: float  # wall clock per job
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


class DecodePool:
    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: dict[int, _Worker] = {}
        self._waiting = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.report: dict[str, str] = {}
        self.exit_codes: collections.deque[int] = collections.deque(maxlen=64)  # for health/tests

    @property
    def timeout_s(self) -> float:
        return self.settings.timeout_s

    def start(self) -> dict[str, str]:
        """Starts every worker now, before any server socket exists; returns the protections
        the first worker reports (all workers run the same code on the same host)."""
        for _ in range(self.settings.workers):
            w = _spawn(self.settings)
            self._all[w.pid] = w
            self._idle.put_nowait(w)
        self.report = next(iter(self._all.values())).report
        return self.report

    def pids(self) -> list[int]:
        return sorted(self._all)

    async def run(self, job: str, args: dict[str, Any], data: bytes = b"") -> Reply:
        """Runs one job on the next free worker. The deadline counts from when a worker takes it."""
        if self._waiting >= self.settings.max_queue:
            raise VisorError(Reason.OVERLOADED, "the decode queue is full; retry later")
        self._waiting += 1
        try:
            w = await self._idle.get()
        finally:
            self._waiting -= 1
        keep = False  # a worker whose job did not end in a clean reply is replaced
        try:
            reply = await self._exchange(w, job, args, data)
            keep = True
            return reply
        except _Refusal as refusal:
            keep = not refusal.recycle
            raise VisorError(refusal.reason, refusal.message, refusal.detail) from None
        finally:
            self._release(w, keep)

    async def _exchange(self, w: _Worker, job: str, args: dict[str, Any], data: bytes) -> Reply:
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
            raw = await asyncio.wait_for(self._recv(w.conn), self.settings.timeout_s)
        except TimeoutError:
            log.warning("decode_timeout", pid=w.pid)
            raise VisorError(
                Reason.DECODE_TIMEOUT, f"decoding took longer than {self.timeout_s:g} s"
            ) from None
        except (EOFError, OSError):
            code = await asyncio.to_thread(_exit_code, w.proc)
            self.exit_codes.append(code)
            log.warning("decoder_crashed", pid=w.pid, code=code)
            if code == -signal.SIGXCPU:
                raise VisorError(Reason.DECODE_TIMEOUT, "decoding exceeded its CPU limit") from None
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

    def _release(self, w: _Worker, keep: bool) -> None:
        if keep and w.jobs < self.settings.max_jobs and not self._closed:
            self._idle.put_nowait(w)
            return
        self._all.pop(w.pid, None)
        task = asyncio.get_running_loop().create_task(self._replace(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, old: _Worker) -> None:
        await asyncio.to_thread(_retire, old)
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
            self._idle.put_nowait(new)
            return

    async def drain(self) -> None:
        """Waits until replacements in flight are done (tests use it to count workers)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        self._closed = True
        for w in list(self._all.values()):
            _retire(w)
        self._all.clear()


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

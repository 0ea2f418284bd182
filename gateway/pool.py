"""The decode worker pool: separate processes, started before the gRPC server, that parse every
untrusted byte. A job past its deadline has the pool's workers killed and replaced; a crashed
worker fails only its own request (DECODER_CRASHED) and the pool is rebuilt.

The hardening of these workers (rlimits, seccomp, namespaces, shared-memory results) lands with
the sandbox issue; this module is the seam it plugs into.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from gateway import decode
from shared import logs
from shared.errors import Reason, VisorError

T = TypeVar("T")
log = logs.get("gateway.pool")


def _ready() -> int:
    return os.getpid()


class DecodePool:
    def __init__(self, workers: int, timeout_s: float, max_jobs: int, max_pixels: int) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self._max_jobs, self._max_pixels = max_jobs, max_pixels
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process holding gRPC
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(
            self.workers,
            mp_context=self._ctx,
            initializer=decode.init_worker,
            initargs=(self._max_pixels,),
            max_tasks_per_child=self._max_jobs,
        )
        return pool

    def start(self) -> list[int]:
        """Starts every worker now, before any server socket exists; returns their pids."""
        futures = [self._pool.submit(_ready) for _ in range(self.workers)]
        return sorted({f.result(timeout=60) for f in futures})

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        pool = self._pool
        future = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            log.warning("decode_timeout", workers=self.workers)
            self._replace(pool)
            raise VisorError(
                Reason.DECODE_TIMEOUT, f"decoding took longer than {self.timeout_s:g} s"
            ) from None
        except BrokenProcessPool:
            log.warning("decoder_crashed", workers=self.workers)
            self._replace(pool)
            raise VisorError(Reason.DECODER_CRASHED, "the decoder crashed on this media") from None

    def _replace(self, pool: ProcessPoolExecutor) -> None:
        if pool is not self._pool:
            return  # another request already replaced it
        self._pool = self._new_pool()
        _kill(pool)

    def close(self) -> None:
        _kill(self._pool)


def _kill(pool: ProcessPoolExecutor) -> None:
    processes = dict(getattr(pool, "_processes", None) or {})
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes.values():
        proc.join(timeout=5)

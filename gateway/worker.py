"""The decode worker process: set up, harden, then serve jobs from the gateway over one pipe.

Protocol (gateway -> worker): a JSON header `{"job": name, "args": {...}}`, then the media bytes.
Reply (worker -> gateway): one JSON object, `{"ok": {...}}` or `{"error": {...}}`; pixels go into
the shared-memory buffer the worker created at start and handed over. The gateway never unpickles
anything a worker sends: a worker is assumed compromised the moment it parses a byte.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from gateway import decode, sandbox, sniff, video
from shared.errors import Reason, VisorError

MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a worker is started with (picklable; crosses the spawn boundary)."""

    policy: sandbox.Policy  # resource limits
    shm_bytes: int  # size of the pixel buffer this worker creates
    max_pixels: int  # Pillow's own bomb threshold (the explicit checks come first)
    cpu_per_job_s: int  # RLIMIT_CPU soft cap re-armed before each job
    test_jobs: bool  # enables the `test:*` jobs; only tests construct a pool with it


Job = Callable[[dict[str, Any], bytes, mmap.mmap], dict[str, Any]]


def _probe(args: dict[str, Any], data: bytes, _: mmap.mmap) -> dict[str, Any]:
    if args["fmt"] in sniff.VIDEO:
        lim = video.VideoLimits.from_json(args["video"])
        p = video.probe(data, args["fmt"], lim, args["max_pixels"], args["max_side"])
    else:
        p = decode.probe(
            data, args["fmt"], args["max_pixels"], args["max_side"], args["max_frames"]
        )
    return {
        "width": p.width,
        "height": p.height,
        "num_frames": p.num_frames,
        "starts_s": list(p.starts_s),
    }


def _decode(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    spec = decode.Spec.from_json(args)
    if spec.fmt in sniff.VIDEO:
        done = video.decode_video(data, spec, video.VideoLimits.from_json(args["video"]))
    else:
        done = decode.decode(data, spec)
    offset, shapes = 0, []
    for array in done.items:
        n = array.nbytes
        if offset + n > len(out):
            raise VisorError(Reason.PIXEL_LIMIT, "decoded tiles exceed the worker's buffer")
        out[offset : offset + n] = array.tobytes()
        offset += n
        shapes.append(list(array.shape))
    return {"shapes": shapes, "decode_ms": done.decode_ms, "preprocess_ms": done.preprocess_ms}


def _test_socket(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    return {}


def _test_exec(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    os.execv("/bin/true", ["true"])


def _test_open(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    with open(args.get("path", "/etc/passwd"), "rb") as f:
        return {"read": len(f.read())}


def _test_fork(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return {"child": pid}


def _test_alloc(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    block = bytearray(int(args["bytes"]))
    return {"allocated": len(block)}


def _test_sleep(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    time.sleep(float(args["seconds"]))
    return {}


def _test_spin(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    while True:
        pass


def _test_echo(args: dict[str, Any], data: bytes, out: mmap.mmap) -> dict[str, Any]:
    return {"num_bytes": len(data), "crc32": zlib.crc32(data), "pid": os.getpid()}


JOBS: dict[str, Job] = {"probe": _probe, "decode": _decode}
TEST_JOBS: dict[str, Job] = {
    "test:socket": _test_socket,
    "test:exec": _test_exec,
    "test:open": _test_open,
    "test:fork": _test_fork,
    "test:alloc": _test_alloc,
    "test:sleep": _test_sleep,
    "test:spin": _test_spin,
    "test:echo": _test_echo,
}


def _error(reason: Reason, message: str, detail: str = "", recycle: bool = False) -> bytes:
    body = {"reason": reason.value, "message": message, "detail": detail, "recycle": recycle}
    return json.dumps({"error": body}).encode()


def _run(jobs: dict[str, Job], header: bytes, data: bytes, out: mmap.mmap) -> bytes:
    try:
        msg = json.loads(header)
        job = jobs.get(str(msg["job"]))
        if job is None:
            return _error(Reason.INTERNAL, "unknown decode job")
        if "shm_input" in msg:  # the media is in the shared buffer; copied out before any output
            data = bytes(out[: min(int(msg["shm_input"]), len(out))])
        return json.dumps({"ok": job(msg["args"], data, out)}).encode()
    except VisorError as err:
        return _error(err.reason, err.message, err.detail)
    except MemoryError:
        # Past RLIMIT_AS: refuse this media and let the gateway replace this worker, whose heap
        # may be left fragmented.
        return _error(Reason.DECODER_CRASHED, "the decoder exceeded its memory limit", "", True)
    except Exception as exc:
        return _error(Reason.DECODER_CRASHED, "the decoder failed", type(exc).__name__, True)


def main(conn: Connection, args: WorkerArgs) -> None:
    """Spawn target. Everything that opens files or sockets happens before `harden`."""
    sandbox.die_with_parent()
    fd = os.memfd_create("visor-decode-pixels")
    os.ftruncate(fd, args.shm_bytes)
    out = mmap.mmap(fd, args.shm_bytes)
    send_handle(conn, fd, os.getppid())
    os.close(fd)
    decode.init_worker(args.max_pixels)
    decode.warm()
    video.warm()
    jobs = {**JOBS, **(TEST_JOBS if args.test_jobs else {})}
    json.loads(json.dumps({"warm": [1.5, "x"]}))
    io.BytesIO(b"").read()
    report = sandbox.harden(args.policy)
    conn.send_bytes(json.dumps({"ready": report.as_dict(), "pid": os.getpid()}).encode())
    while True:
        try:
            header = conn.recv_bytes(MAX_HEADER_BYTES)
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the gateway closed the pipe: exit quietly
        sandbox.tighten_cpu(args.cpu_per_job_s)
        conn.send_bytes(_run(jobs, header, data, out))
        del data

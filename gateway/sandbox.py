"""Hardening applied inside a decode worker before it reads its first untrusted byte.

Order matters: what needs privileges (a new network namespace, dropping to an unprivileged uid)
comes first, then resource limits, then `PR_SET_NO_NEW_PRIVS`, and the seccomp filter last, since
after it the process can no longer open files, create sockets or start processes. Each step
reports whether it took effect; the gateway logs the report and `strict` mode refuses to serve
when any protection is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import resource
from dataclasses import dataclass
from typing import Any

try:  # imported here, not lazily: after the rlimits it could no longer find libseccomp
    import pyseccomp as _sc  # type: ignore[import-untyped]
except (ImportError, OSError, RuntimeError):  # no binding or no system libseccomp
    _sc = None

WORKER_NICE = 10  # how far below the gateway's scheduling priority its decode workers run
PROTECTIONS = ("rlimits", "no_new_privs", "seccomp", "netns", "unprivileged_uid")
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
NOBODY = 65534
KILL_SIGNAL = 9

# Syscalls a worker needs once its inputs, outputs and libraries are set up: pipe I/O, memory,
# signals, time, and exiting. Everything else fails with EPERM (harmless if a library probes
# something) except the escape routes in KILLED, which end the process on the spot.
# PyAV's bundled FFmpeg (mov/matroska demuxers, H.264, VP9 and dav1d decoders, swscale) needs
# nothing beyond this list, checked by tests/gateway/test_gateway_video.py, provided it runs
# single-threaded (gateway/video.py): a decoder or swscale thread would be a clone(), which kills.
ALLOWED = (
    "read",
    "write",
    "readv",
    "writev",
    "pread64",
    "lseek",
    "close",
    "fstat",
    "newfstatat",
    "statx",
    "mmap",
    "munmap",
    "mremap",
    "mprotect",
    "brk",
    "madvise",
    "futex",
    "rt_sigaction",
    "rt_sigprocmask",
    "rt_sigreturn",
    "sigaltstack",
    "getpid",
    "gettid",
    "getppid",
    "getuid",
    "geteuid",
    "getgid",
    "getegid",
    "clock_gettime",
    "clock_getres",
    "clock_nanosleep",
    "nanosleep",
    "gettimeofday",
    "poll",
    "ppoll",
    "select",
    "pselect6",
    "sched_yield",
    "sched_getaffinity",
    "getrandom",
    "getrusage",
    "sysinfo",
    "fcntl",
    "restart_syscall",
    "rseq",
    "exit",
    "exit_group",
)
# Network, process creation, exec, opening files, and kernel attack surface a decoder never needs.
KILLED = (
    "socket",
    "socketpair",
    "connect",
    "bind",
    "listen",
    "accept",
    "accept4",
    "sendto",
    "sendmsg",
    "execve",
    "execveat",
    "fork",
    "vfork",
    "clone",
    "clone3",
    "open",
    "openat",
    "openat2",
    "creat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "unshare",
    "setns",
    "mount",
    "bpf",
    "userfaultfd",
    "io_uring_setup",
    "perf_event_open",
    "keyctl",
    "kexec_load",
    "init_module",
    "finit_module",
)


@dataclass(frozen=True, slots=True)
class Policy:
    """Resource limits for one worker (plain values, unpacked from GatewayConfig)."""

    max_memory_bytes: int  # RLIMIT_AS: the worker's whole address space
    max_cpu_s: int  # RLIMIT_CPU hard limit over the worker's life (recycling bounds it)
    max_open_files: int  # RLIMIT_NOFILE: no descriptor at or above this number


def lower_priority(pid: int) -> None:
    """Runs process `pid` (a decode worker just started) `WORKER_NICE` below this process, from
    its first milliseconds: starting a worker (interpreter, imports) costs ~0.5 s of CPU, and
    that spent at the gateway's priority delays the answers it is relaying. Decoding likewise
    yields the CPU to what it feeds (the gateway's event loop; on a shared host, the model): a
    flood of large media slows other media, not answers. Lowering a priority needs no privilege."""
    nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
    with contextlib.suppress(OSError):  # already gone: its job sees that
        os.setpriority(os.PRIO_PROCESS, pid, nice)


@dataclass(frozen=True, slots=True)
class Report:
    """Which protections are active in a worker, and why one is not."""

    active: tuple[str, ...]  # names from PROTECTIONS that took effect
    missing: dict[str, str]  # name -> short reason it is not active

    def as_dict(self) -> dict[str, str]:
        out = dict.fromkeys(self.active, "active")
        out.update({k: f"missing: {v}" for k, v in self.missing.items()})
        return {k: out[k] for k in PROTECTIONS if k in out}


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _libc() -> ctypes.CDLL:
    return _LIBC


def _prctl(option: int, arg: int) -> None:
    if _libc().prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def die_with_parent() -> None:
    """SIGKILL when the gateway dies, so no worker outlives it as an orphan."""
    _prctl(PR_SET_PDEATHSIG, KILL_SIGNAL)


def _unshare_net() -> str:
    """'' on success, else the reason. Root gets a plain new netns; others try a user namespace."""
    libc = _libc()
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWNET | CLONE_NEWUSER
    if libc.unshare(flags) == 0:
        return ""
    return errno.errorcode.get(ctypes.get_errno(), "error")


def _drop_uid() -> str:
    if os.geteuid() != 0:
        return ""  # already unprivileged
    try:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, "error")
    return ""


def _cpu_used_s() -> int:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return int(used.ru_utime + used.ru_stime) + 1


def _rlimits(policy: Policy) -> None:
    cpu_now = _cpu_used_s()
    limits = (
        (resource.RLIMIT_AS, policy.max_memory_bytes),
        (resource.RLIMIT_CPU, cpu_now + policy.max_cpu_s),
        (resource.RLIMIT_NOFILE, policy.max_open_files),
        (resource.RLIMIT_FSIZE, 0),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, 0),
    )
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def _seccomp() -> None:
    sc: Any = _sc
    if sc is None:
        raise ImportError("pyseccomp or libseccomp is not available")
    filt = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    filt.set_attr(sc.Attr.CTL_TSYNC, 1)  # every thread of the worker, not only this one
    for name in ALLOWED:
        _add(filt, sc.ALLOW, name)
    # Lowering our own limits stays allowed (the worker tightens RLIMIT_CPU per job).
    _add(filt, sc.ALLOW, "prlimit64", sc.Arg(0, sc.EQ, 0))
    for name in KILLED:
        _add(filt, sc.KILL_PROCESS, name)
    filt.load()


def _add(filt: object, action: int, name: str, *args: object) -> None:
    # A syscall this architecture does not have (e.g. `open` on arm64) is skipped.
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        filt.add_rule(action, name, *args)  # type: ignore[attr-defined]


def harden(policy: Policy) -> Report:
    """Applies every protection it can; never raises for a missing kernel feature."""
    active: list[str] = []
    missing: dict[str, str] = {}

    def step(name: str, reason: str) -> None:
        if reason:
            missing[name] = reason
        else:
            active.append(name)

    step("netns", _unshare_net())
    step("unprivileged_uid", _drop_uid())
    try:
        _rlimits(policy)
        step("rlimits", "")
    except (OSError, ValueError) as exc:
        step("rlimits", type(exc).__name__)
    try:
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        step("no_new_privs", "")
    except OSError as exc:
        step("no_new_privs", errno.errorcode.get(exc.errno or 0, "error"))
    try:
        _seccomp()
        step("seccomp", "")
    except (ImportError, OSError, RuntimeError) as exc:
        step("seccomp", type(exc).__name__)
    return Report(tuple(active), missing)


def tighten_cpu(seconds: int) -> None:
    """Caps the CPU this worker may still use (soft limit: SIGXCPU ends it past the cap)."""
    now = _cpu_used_s()
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = now + seconds
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))

"""Starting visor services as child processes and waiting for their health checks; used by
`visor demo` and by the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def start(
    kind: str,
    env: Mapping[str, str] | None = None,
    config: Path | None = None,
    log_path: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Starts `visor core` or `visor gateway` with this interpreter."""
    cmd = [sys.executable, "-m", "visor.cli", kind]
    if config is not None:
        cmd += ["--config", str(config)]
    full_env = {**os.environ, **(env or {})}
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(cmd, env=full_env, stdout=out, stderr=out)


def wait_healthy(
    target: str,
    proc: subprocess.Popen[bytes] | None = None,
    timeout_s: float = 60.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Polls grpc.health.v1 until SERVING (over mTLS with `credentials`); fails early if the
    process exits."""
    deadline = time.monotonic() + timeout_s
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service for {target} exited with {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{target} not healthy after {timeout_s:g} s")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> int:
    """SIGTERM (graceful), then SIGKILL after `timeout_s`; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode

"""Small client helpers for tests: one request, its events, its error."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from shared import secret
from shared.proto import gateway_pb2, gateway_pb2_grpc

DEV_KEY = "visor-dev-key"


@dataclass
class Outcome:
    deltas: list[str]
    final: gateway_pb2.Final | None
    code: grpc.StatusCode
    reason: str
    message: str


def generate(
    target: str, req: gateway_pb2.GenerateRequest, key: str | None = DEV_KEY, timeout: float = 60.0
) -> Outcome:
    metadata = [("authorization", f"Bearer {key}")] if key is not None else []
    deltas: list[str] = []
    final = None
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            for event in stub.Generate(req, metadata=metadata, timeout=timeout):
                if event.WhichOneof("kind") == "delta":
                    deltas.append(event.delta.text)
                else:
                    final = event.final
        except grpc.RpcError as exc:
            return Outcome(deltas, final, exc.code(), _reason(exc), exc.details() or "")
    return Outcome(deltas, final, grpc.StatusCode.OK, "", "")


def _reason(exc: grpc.RpcError) -> str:
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    if status is None:
        return ""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return ""


def request(
    prompt: str = "What is this?",
    media: tuple[bytes, ...] = (),
    max_new_tokens: int = 8,
    **params: object,
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        media=[gateway_pb2.Media(data=m) for m in media],
        params=gateway_pb2.GenerationParams(max_new_tokens=max_new_tokens, **params),  # type: ignore[arg-type]
    )


def core_metadata(env: Mapping[str, str]) -> tuple[tuple[str, str]]:
    """The metadata a gateway of the deployment whose services ran with `env` sends a core (the
    core token from its deployment secret)."""
    path = env["VISOR_DEPLOYMENT_SECRET_FILE"]
    return secret.load(secret.DeploymentConfig(path)).core_metadata()


def metric(address: str, name: str) -> float:
    """One unlabelled sample from a service's Prometheus endpoint at `address`."""
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read()
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not exported")


def run_in_child(function: str, *args: Any, timeout: float = 300) -> str:
    """Calls `function` ("package.module.name") with JSON-able `args` in a fresh Python process
    and returns its stdout; fails the test with the child's stderr if it raises. For tests that
    patch what cannot be unpatched (a fake-CUDA `Tensor.__getitem__` leaves tensors looking like
    sequences for the rest of the process)."""
    module, name = function.rsplit(".", 1)
    code = f"import json, sys; from {module} import {name}; {name}(*json.loads(sys.argv[1]))"
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout

"""`visor health`: one grpc.health.v1 Check, for container HEALTHCHECKs and Kubernetes exec
probes (kubelet's own gRPC probe cannot present a client certificate, the core requires one).
Prints the status and exits 0 only when the service answers SERVING."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import tls


def check(
    target: str, service: str, files: tls.TlsFiles, server_name: str, timeout_s: float
) -> str:
    """The status name (SERVING, NOT_SERVING, ...) or UNREACHABLE with the gRPC code."""
    if files.enabled:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(target, tls.channel_credentials(files), options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"UNREACHABLE ({exc.code().name})"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(target: str, service: str, files: tls.TlsFiles, server_name: str, timeout_s: float) -> int:
    files.check("visor health --ca/--cert/--key")
    status = check(target, service, files, server_name, timeout_s)
    print(f"{target} {service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1

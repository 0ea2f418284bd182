"""The generated protobuf modules, imported only by servicers and clients.

A source checkout that has not been built yet generates them on first import.
"""

from __future__ import annotations

try:
    from shared.pb.visor.v1 import core_pb2, core_pb2_grpc, gateway_pb2, gateway_pb2_grpc
except ModuleNotFoundError:  # pragma: no cover - first run from a fresh checkout
    from shared import protogen

    protogen.generate()
    from shared.pb.visor.v1 import core_pb2, core_pb2_grpc, gateway_pb2, gateway_pb2_grpc

__all__ = ["core_pb2", "core_pb2_grpc", "gateway_pb2", "gateway_pb2_grpc"]

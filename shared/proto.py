"""The generated protobuf modules, imported only by servicers and clients.

A source checkout that has not been built yet generates them on first import.
"""

from __future__ import annotations

from shared.sampling import ResponseFormat

try:
    from shared.pb.visor.v1 import core_pb2, core_pb2_grpc, gateway_pb2, gateway_pb2_grpc
except ModuleNotFoundError:  # pragma: no cover - first run from a fresh checkout
    from shared import protogen

    protogen.generate()
    from shared.pb.visor.v1 import core_pb2, core_pb2_grpc, gateway_pb2, gateway_pb2_grpc

__all__ = ["core_pb2", "core_pb2_grpc", "gateway_pb2", "gateway_pb2_grpc", "response_format"]


def response_format(
    msg: gateway_pb2.ResponseFormat | core_pb2.CoreResponseFormat,
) -> ResponseFormat | None:
    """The format a message names (gateway's and core's have the same oneof); None when unset."""
    kind = msg.WhichOneof("kind")
    return None if kind is None else ResponseFormat(kind, getattr(msg, kind))

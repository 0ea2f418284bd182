"""The generated protobuf modules, imported only by servicers and clients.

A source checkout that has not been built yet generates them on first import.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from shared.preprocess import PreprocessRule
from shared.sampling import ResponseFormat

try:
    from shared.pb.visor.v1 import core_pb2, core_pb2_grpc, gateway_pb2, gateway_pb2_grpc
except ModuleNotFoundError:  # pragma: no cover - first run from a fresh checkout
    from shared import protogen

    protogen.generate()
    from shared.pb.visor.v1 import core_pb2, core_pb2_grpc, gateway_pb2, gateway_pb2_grpc

__all__ = [
    "core_pb2",
    "core_pb2_grpc",
    "gateway_pb2",
    "gateway_pb2_grpc",
    "response_format",
    "rule_from_proto",
    "rule_to_proto",
]


def response_format(
    msg: gateway_pb2.ResponseFormat | core_pb2.CoreResponseFormat,
) -> ResponseFormat | None:
    """The format a message names (gateway's and core's have the same oneof); None when unset."""
    kind = msg.WhichOneof("kind")
    return None if kind is None else ResponseFormat(kind, getattr(msg, kind))


def rule_to_proto(rule: PreprocessRule) -> core_pb2.PreprocessRule:
    """The rule as Describe states it (field for field: the proto mirrors the dataclass)."""
    return core_pb2.PreprocessRule(**asdict(rule))


def rule_from_proto(msg: core_pb2.PreprocessRule) -> PreprocessRule:
    """The rule a core declared, validated (ValueError names what is wrong)."""
    values = {f.name: getattr(msg, f.name) for f in fields(PreprocessRule)}
    seqs = {name: tuple(getattr(msg, name)) for name in ("mean", "std", "pinpoints")}
    rule = PreprocessRule(**{**values, **seqs})
    rule.validate()
    return rule

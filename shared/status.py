"""VisorError <-> gRPC status with a google.rpc.ErrorInfo detail. Used by servicers and clients."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from shared.errors import Reason, VisorError

DOMAIN = "visor"


def to_status(err: VisorError) -> grpc.Status:
    """Builds the rich status a servicer aborts with."""
    info = error_details_pb2.ErrorInfo(reason=err.reason.value, domain=DOMAIN)
    detail = status_pb2.Status(code=err.code.value[0], message=err.message)
    detail.details.add().Pack(info)
    return rpc_status.to_status(detail)


def from_rpc_error(exc: grpc.RpcError) -> VisorError:
    """Reads a refusal back from a failed call; calls without ErrorInfo get a reason by status."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else "") or ""
    status = rpc_status.from_call(exc) if hasattr(exc, "trailing_metadata") else None
    if status is not None:
        for any_detail in status.details:
            if any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                any_detail.Unpack(info)
                try:
                    return VisorError(Reason(info.reason), status.message)
                except ValueError:
                    break
    return VisorError(_REASON_BY_CODE.get(code, Reason.INTERNAL), message)


_REASON_BY_CODE = {
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE: Reason.CORE_UNAVAILABLE,
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.OVERLOADED,
}

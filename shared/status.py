"""VisorError <-> gRPC status with a google.rpc.ErrorInfo detail (and a google.rpc.RetryInfo when
the caller may try again later). Used by servicers and clients."""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from shared.errors import Reason, VisorError

DOMAIN = "visor"
# The wait suggested with an OVERLOADED refusal that names none: full queues drain within about
# a second at the default limits, and a hint keeps retrying clients from hammering them.
OVERLOADED_RETRY_S = 1.0


def to_status(err: VisorError) -> grpc.Status:
    """Builds the rich status a servicer aborts with."""
    info = error_details_pb2.ErrorInfo(reason=err.reason.value, domain=DOMAIN)
    detail = status_pb2.Status(code=err.code.value[0], message=err.message)
    detail.details.add().Pack(info)
    retry_after = err.retry_after_s
    if retry_after is None and err.reason == Reason.OVERLOADED:
        retry_after = OVERLOADED_RETRY_S
    if retry_after is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(max(0, round(retry_after * 1e9)))
        detail.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return rpc_status.to_status(detail)


def from_rpc_error(exc: grpc.RpcError) -> VisorError:
    """Reads a refusal back from a failed call; calls without ErrorInfo get a reason by status."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else "") or ""
    status = rpc_status.from_call(exc) if hasattr(exc, "trailing_metadata") else None
    if status is None:
        return VisorError(_REASON_BY_CODE.get(code, Reason.INTERNAL), message)
    reason, retry_after = None, None
    for any_detail in status.details:
        if any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            any_detail.Unpack(info)
            reason = Reason.__members__.get(info.reason)
        elif any_detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            hint = error_details_pb2.RetryInfo()
            any_detail.Unpack(hint)
            retry_after = hint.retry_delay.ToNanoseconds() / 1e9
    if reason is None:
        return VisorError(_REASON_BY_CODE.get(code, Reason.INTERNAL), message)
    return VisorError(reason, status.message, retry_after_s=retry_after)


_REASON_BY_CODE = {
    grpc.StatusCode.UNAUTHENTICATED: Reason.UNAUTHENTICATED,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE: Reason.CORE_UNAVAILABLE,
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.OVERLOADED,
}

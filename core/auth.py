"""Who may call the core: only holders of the deployment's core token (`shared.secret`), on every
transport, loopback included and with mTLS on as well. The core believes the tenant a caller
names, so any process that could call it unauthenticated could probe, read and poison every
tenant's feature cache. grpc.health and reflection stay open: probes carry no token and learn
nothing about tenants.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from shared import logs
from shared.errors import Reason, VisorError
from shared.secret import CORE_TOKEN_METADATA
from shared.status import to_status

log = logs.get("core.auth")
_REFUSAL = to_status(
    VisorError(Reason.UNAUTHENTICATED, "the core serves only gateways of its deployment")
)


class CoreTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses, before any handler runs or any request message is parsed, every call to
    `service` that lacks the right `visor-core-token` metadata."""

    def __init__(self, token: str, service: str) -> None:
        self._token = token.encode()
        self._prefix = f"/{service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        if self._presented(handler_call_details.invocation_metadata):
            return handler
        log.warning("core_call_refused", reason=Reason.UNAUTHENTICATED.value, where=method)
        return _refusal_like(handler)

    def _presented(self, metadata: Any) -> bool:
        offered = b""
        for key, value in metadata or ():
            if key == CORE_TOKEN_METADATA:
                offered = value.encode() if isinstance(value, str) else bytes(value)
        return hmac.compare_digest(offered, self._token)


async def _refuse(_request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    await context.abort_with_status(_REFUSAL)


def _refusal_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses. No request deserializer: an
    unauthenticated caller's bytes are never parsed."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)

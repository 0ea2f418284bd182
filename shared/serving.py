"""What both servers do alike: health and reflection, signal-driven graceful shutdown, and
asyncio's own error reports kept to JSON log lines."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared import logs
from shared.config import ConfigError

# Keeps every message far under what a hostile peer could make us buffer, while allowing the
# 1 MiB tensor chunks and a few MiB of inline media.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def new_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )


def bind(
    server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Opens the port, TLS when `credentials` are given (plaintext is loopback-checked by each
    config's validate()); a clear error when the port is taken."""
    try:
        if credentials is not None:
            return int(server.add_secure_port(address, credentials))
        return int(server.add_insecure_port(address))
    except RuntimeError:
        raise ConfigError(f"cannot listen on {address}: is another process using it?") from None


def add_health_and_reflection(
    server: grpc.aio.Server, service_names: Sequence[str]
) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: Sequence[str]) -> None:
    for name in ("", *service_names):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def log_loop_errors(loop: asyncio.AbstractEventLoop) -> None:
    """What asyncio would print to stderr as text with a traceback (a task's exception nobody
    retrieved, a callback that raised) becomes one JSON log line: the error's type and where it
    was raised, never its message (which may quote user content)."""
    log = logs.get("asyncio")

    def handler(_: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, BaseException):
            log.error("loop_error", error_type=type(exc).__name__, where=logs.error_site(exc))
        else:
            log.error("loop_error", error_type="none")

    loop.set_exception_handler(handler)


async def serve_until_signal(
    server: grpc.aio.Server, grace_s: float, on_stop: Callable[[], Awaitable[None]]
) -> None:
    """Runs until SIGINT/SIGTERM, then stops accepting, drains for `grace_s`, and cleans up.
    asyncio's error reports go to the JSON log from here on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    log_loop_errors(loop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace_s)
    await on_stop()

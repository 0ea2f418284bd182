"""Starts the gateway: decode workers first (spawned, never forked from a process holding gRPC
objects, and before any server socket exists), then the gRPC server; serves until a signal."""

from __future__ import annotations

from gateway.auth import Authenticator
from gateway.config import GatewayConfig, LimitsConfig, Tenant
from gateway.core_client import CoreClient
from gateway.pipeline import Pipeline
from gateway.pool import DecodePool
from gateway.servicer import GatewayServicer
from shared import logs, metrics, serving
from shared.config import ConfigError
from shared.net import is_loopback
from shared.proto import gateway_pb2_grpc

SERVICE = "visor.v1.Gateway"


async def run(cfg: GatewayConfig, lim: LimitsConfig, tenants: tuple[Tenant, ...]) -> None:
    log = logs.get("gateway")
    try:
        auth = Authenticator.for_listen(tenants, is_loopback(cfg.listen))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    pool = DecodePool(cfg.decode_workers, cfg.decode_timeout_s, cfg.worker_max_jobs, lim.max_pixels)
    pool.start()
    core = CoreClient(cfg.cores[0])
    server = serving.new_server()
    servicer = GatewayServicer(auth, Pipeline(lim, pool, core, cfg.default_profile), lim)
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    health = serving.add_health_and_reflection(server, [SERVICE])
    serving.bind(server, cfg.listen)
    metrics.serve(cfg.metrics_listen)
    await server.start()
    await serving.set_serving(health, [SERVICE])
    log.info(
        "gateway_started", listen=cfg.listen, cores=list(cfg.cores), workers=cfg.decode_workers
    )

    async def close() -> None:
        await core.close()
        pool.close()
        log.info("gateway_stopped")

    await serving.serve_until_signal(server, cfg.grace_s, close)

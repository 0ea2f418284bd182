"""Starts the gateway: decode workers first (spawned, never forked from a process holding gRPC
objects, and before any server socket exists), then the gRPC server; serves until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import signal
import time
from collections.abc import Callable
from functools import partial
from importlib import metadata

import grpc
from grpc_health.v1 import health_pb2

from gateway.config import MIB, GatewayConfig, LimitsConfig
from gateway.core_client import CoreClient
from gateway.pipeline import Pipeline
from gateway.pool import DecodePool, PoolSettings
from gateway.quota import Quotas, UploadBytes
from gateway.routing import Router, RouterSettings
from gateway.sandbox import PROTECTIONS
from gateway.servicer import SERVICE, GatewayServicer, Receiving, add_to_server
from gateway.tenants import ConfigFile, LiveTenants, TenantConfigError, reread, tenants_from
from shared import logs, metrics, serving, tracing
from shared.config import ConfigError

# Health service that is SERVING only while every sandbox protection is active on this host, so
# a probe (or `grpc_health_probe -service visor.sandbox`) can see a weakened deployment.
SANDBOX_HEALTH = "visor.sandbox"


def pool_settings(cfg: GatewayConfig, lim: LimitsConfig, test_jobs: bool = False) -> PoolSettings:
    return PoolSettings(
        cfg.decode_workers,
        cfg.decode_timeout_s,
        cfg.worker_max_jobs,
        lim.max_pixels,
        cfg.worker_memory_mb * MIB,
        cfg.worker_shm_mb * MIB,
        cfg.max_decode_queue,
        test_jobs,
    )


def missing(report: dict[str, str]) -> list[str]:
    return [p for p in PROTECTIONS if report.get(p) != "active"]


def check_sandbox(cfg: GatewayConfig, lim: LimitsConfig) -> int:
    """`visor gateway --check-sandbox`: starts one worker, prints what protects it, exits 0 when
    everything is active and 1 otherwise."""

    async def start_one() -> dict[str, str]:
        pool = DecodePool(dataclasses.replace(pool_settings(cfg, lim), workers=1))
        try:
            return await pool.start()
        finally:
            pool.close()

    report = asyncio.run(start_one())
    for name in PROTECTIONS:
        print(f"{name:18} {report.get(name, 'missing: not reported')}")
    gaps = missing(report)
    print("sandbox: all protections active" if not gaps else f"sandbox: missing {', '.join(gaps)}")
    return 0 if not gaps else 1


def pillow_build() -> dict[str, str]:
    """Which build of PIL is actually imported. Pillow and pillow-simd install the same `PIL`
    package, so when both are installed the one whose version matches `PIL.__version__` owns the
    loaded files (the other's metadata is stale)."""
    import PIL
    from PIL import features

    installed = {}
    for dist in ("pillow-simd", "Pillow"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            installed[dist] = metadata.version(dist)
    loaded = [d for d, v in installed.items() if v == PIL.__version__]
    name = loaded[0] if loaded else "unknown"
    turbo = "libjpeg-turbo" if features.check_feature("libjpeg_turbo") else "libjpeg"
    out = {
        "backend": name,
        "simd": str(name == "pillow-simd").lower(),
        "version": f"{PIL.__version__} ({turbo} {features.version('jpg')})",
    }
    if len(installed) > 1:
        out["also_installed"] = ", ".join(f"{d} {v}" for d, v in installed.items() if d != name)
    return out


def new_server(cfg: GatewayConfig) -> grpc.aio.Server:
    ms = 1000
    return grpc.aio.server(
        interceptors=tracing.server_interceptors(),
        options=[
            ("grpc.max_receive_message_length", serving.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", serving.MAX_MESSAGE_BYTES),
            ("grpc.max_metadata_size", 16 * 1024),
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
            ("grpc.max_connection_idle_ms", int(cfg.max_connection_idle_s * ms)),
            # Keepalive enforcement: a client pinging more often than this, or without calls in
            # flight, gets strikes and then GOAWAY (a cheap way to keep a server busy otherwise).
            (
                "grpc.http2.min_recv_ping_interval_without_data_ms",
                int(cfg.keepalive_min_interval_s * ms),
            ),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.keepalive_time_ms", 60 * ms),
            ("grpc.keepalive_timeout_ms", 20 * ms),
        ],
        # Our own cap (max_requests_in_flight) refuses first, as OVERLOADED with ErrorInfo;
        # gRPC's refuses without one, so it stays above ours (and health checks) as a backstop.
        maximum_concurrent_rpcs=2 * cfg.max_requests_in_flight + 64,
    )


QUIET_UPLOADS_S = 5.0  # without an upload for this long, freed heap goes back to the system


def return_big_buffers() -> ctypes.CDLL | None:
    """Media and uploads are buffers of several MiB that live for one request. glibc's dynamic
    mmap threshold would move them onto the heap after the first free, where they stay as
    resident memory after the request; a fixed threshold serves each from its own mapping,
    returned to the system when freed. It sits above upload chunks (1 MiB from our clients) and
    most messages, which the heap reuses: a fresh mapping faults in every page again, and
    receiving an 18 MB upload in 1 MiB chunks that way cost ~40 ms of the event loop instead of
    ~14. Fixing it also fixes the trim threshold, at 128 KiB unless set: an upload's chunks,
    freed together, would leave the heap every time, and the next upload fault every page in
    again. Up to 32 MiB of freed heap stays resident instead, which took a large upload's cost
    to the gateway from ~60 to ~30-50 ms of CPU (bench/results/HISTORY.md), until
    `trim_after_uploads` hands it back. One arena for all threads: malloc_trim cannot shrink the
    top of another thread's arena, which kept up to 32 MiB each (~50 MB after a burst); the
    gateway's threads mostly wait on sockets, not on malloc. Returns libc, or None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD (fixing it also stops the dynamic growth)
    libc.mallopt(-1, 32 << 20)  # M_TRIM_THRESHOLD
    libc.mallopt(-8, 1)  # M_ARENA_MAX
    return libc


async def trim_after_uploads(libc: ctypes.CDLL, uploads: UploadBytes) -> None:
    """Once uploads have stopped for `QUIET_UPLOADS_S`, returns every arena's freed heap to the
    system (once per quiet spell): a burst of uploads reuses its pages, and the memory it
    leaves goes back after it."""
    trimmed = 0.0
    while True:
        await asyncio.sleep(1.0)
        last = uploads.last_end
        quiet = time.monotonic() - last >= QUIET_UPLOADS_S and not uploads.num_bytes
        if last > trimmed and quiet:
            trimmed = last
            await asyncio.to_thread(libc.malloc_trim, 0)


async def _start_pool(cfg: GatewayConfig, lim: LimitsConfig, log: object) -> DecodePool:
    pool = DecodePool(pool_settings(cfg, lim))
    report = await pool.start()
    gaps = missing(report)
    log.info("sandbox", protections=report, workers=cfg.decode_workers, pid=pool.pids())  # type: ignore[attr-defined]
    if gaps and cfg.sandbox == "strict":
        pool.close()
        raise ConfigError(f'[gateway] sandbox = "strict" but missing: {", ".join(gaps)}')
    if gaps:
        # One JSON line, like every other line on stderr (a plain-text copy broke log parsers).
        log.warning("sandbox_weakened", protections={g: report.get(g, "") for g in gaps})  # type: ignore[attr-defined]
    return pool


def reloader(
    config: ConfigFile, cfg: GatewayConfig, lim: LimitsConfig, live: LiveTenants
) -> Callable[[], None]:
    """The SIGHUP handler: the file's tenants again, swapped in whole, or (a bad file) one log
    line and the table in force kept. Messages name keys and entries; tenant ids go hashed."""
    log = logs.get("gateway.tenants")

    def reload() -> None:
        if config.path is None:
            log.warning(
                "tenants_reload_skipped", config_error="started without --config: nothing to read"
            )
            return
        try:
            table, changed = reread(config, cfg, lim)
        except TenantConfigError as exc:
            log.warning("tenants_reload_failed", config_error=exc.loggable(), tenant=exc.tenant)
            return
        except ConfigError as exc:
            log.warning("tenants_reload_failed", config_error=str(exc))
            return
        except OSError as exc:
            log.warning("tenants_reload_failed", error_type=type(exc).__name__)
            return
        live.table = table
        log.info("tenants_reloaded", num_tenants=len(table.tenants))
        if changed:
            log.warning("restart_needed", sections=changed)

    return reload


async def run(cfg: GatewayConfig, lim: LimitsConfig, config: ConfigFile, core_token: str) -> None:
    log = logs.get("gateway")
    libc = return_big_buffers()
    live = LiveTenants(tenants_from(config.data, cfg, lim))
    # Before any socket: from the first health check on, SIGHUP reloads instead of killing.
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader(config, cfg, lim, live))
    if cfg.max_upload_bytes_in_flight < lim.max_request_bytes:
        # Otherwise one request within its limits could never be uploaded, even alone.
        raise ConfigError(
            "[gateway] max_upload_bytes_in_flight must be >= [limits] max_request_bytes"
        )
    log.info("pillow", **pillow_build())
    tracing.configure("visor-gateway")  # before the core channels and the server take interceptors
    pool = await _start_pool(cfg, lim, log)
    router = Router(RouterSettings.from_config(cfg), partial(CoreClient, core_token=core_token))
    await router.start()
    quotas = Quotas(cfg.max_requests_in_flight)
    uploads = UploadBytes(cfg.max_upload_bytes_in_flight)
    trimmer = None if libc is None else asyncio.create_task(trim_after_uploads(libc, uploads))
    receiving = Receiving(cfg.default_deadline_s, cfg.upload_idle_timeout_s)
    server = new_server(cfg)
    pipeline = Pipeline(pool, router, cfg.core_attempt_timeout_s, cfg.video, cfg.core_hedge_after_s)
    add_to_server(GatewayServicer(live, pipeline, quotas, uploads, receiving), server)
    health = serving.add_health_and_reflection(server, [SERVICE])
    serving.bind(server, cfg.listen)
    metrics.serve(cfg.metrics_listen)
    await server.start()
    await serving.set_serving(health, [SERVICE])
    sandbox_ok = not missing(pool.report)
    status = health_pb2.HealthCheckResponse
    await health.set(SANDBOX_HEALTH, status.SERVING if sandbox_ok else status.NOT_SERVING)
    log.info(
        "gateway_started",
        listen=cfg.listen,
        cores=list(cfg.cores),
        num_cores=len(router.healthy()),
        workers=cfg.decode_workers,
        mtls=cfg.core_tls().enabled,
        num_tenants=len(live.table.tenants),
    )

    async def close() -> None:
        if trimmer is not None:
            trimmer.cancel()
        await router.close()
        pool.close()  # on the loop: it stops watching the idle workers
        await asyncio.to_thread(tracing.shutdown)
        log.info("gateway_stopped")

    await serving.serve_until_signal(server, cfg.grace_s, close)

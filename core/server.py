"""Starts the core: load the model, open the gRPC server, serve until a signal."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from core.auth import CoreTokenInterceptor
from core.cache import CacheUnavailable, FeatureCache, tune_malloc
from core.config import CacheConfig, CoreConfig, SchedulerConfig
from core.engine import Engine
from core.features import FeatureService
from core.servicer import CoreServicer
from core.vision_queue import EncoderThread, VisionQueue
from shared import logs, metrics, serving, tls, tracing
from shared.proto import core_pb2, core_pb2_grpc

SWITCH_INTERVAL_S = 0.0005  # Python's default is 5 ms
SERVICE = core_pb2.DESCRIPTOR.services_by_name["Core"].full_name


def open_cache(cfg: CacheConfig) -> FeatureCache | None:
    """The feature cache, or None when it cannot be opened or created (a truncated or corrupt
    file, an unwritable directory): the core then serves without it, after one log line."""
    try:
        return FeatureCache.from_config(cfg)
    except CacheUnavailable as exc:
        logs.get("core").error("feature_cache_disabled", reason=exc.reason)
        return None


async def run(cfg: CoreConfig, cache: CacheConfig, sched: SchedulerConfig, core_token: str) -> None:
    log = logs.get("core")
    tracing.configure("visor-core")  # first: a bad OTEL_* variable stops us before the model loads
    tune_malloc()
    # The event loop answers handshakes while the model thread steps: a thread waiting for the
    # GIL gets it after at most this long, and a handshake takes several turns on the loop.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    artifacts = Path(cfg.artifacts_dir).expanduser()
    engine = Engine(
        Path(cfg.model),
        cfg.resolved_core_id(),
        cfg.num_threads,
        cfg.encoder,
        artifacts,
        sched,
        cfg.device,
        cfg.dtype,
        cfg.batch_invariant,
        cfg.gpu_memory_fraction,
        cfg.cuda_graphs,
        cfg.compile,
    )
    encoder_thread = EncoderThread()  # batches never wait for, nor hold up, an LLM step
    queue = VisionQueue(
        engine.encoder.encode,
        encoder_thread.run,
        cfg.encode_batch_tiles,
        cfg.encode_max_wait_ms / 1000,
        engine.encoder.per_view,
    )
    store = open_cache(cache) if cache.enabled else None
    features = FeatureService(engine.info, queue, store)
    # The token check runs first: a caller without it is refused before any span is made.
    interceptors = [CoreTokenInterceptor(core_token, SERVICE), *tracing.server_interceptors()]
    server = serving.new_server(interceptors)
    core_pb2_grpc.add_CoreServicer_to_server(CoreServicer(engine, features), server)  # type: ignore[no-untyped-call]
    health = serving.add_health_and_reflection(server, [SERVICE])
    creds = tls.server_credentials(cfg.tls()) if cfg.tls().enabled else None
    serving.bind(server, cfg.listen, creds)
    metrics.serve(cfg.metrics_listen)
    await engine.warm_up()  # before SERVING: the first steps' set-up is not a caller's wait
    await server.start()
    await serving.set_serving(health, [SERVICE])
    log.info(
        "core_started",
        backend=engine.encoder.name,
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        listen=cfg.listen,
        model=engine.info.model_id,
        core_id=engine.info.core_id,
        mtls=creds is not None,
    )

    async def close() -> None:
        await features.close()
        encoder_thread.close()
        engine.close()
        await asyncio.to_thread(tracing.shutdown)
        log.info("core_stopped")

    await serving.serve_until_signal(server, cfg.grace_s, close)

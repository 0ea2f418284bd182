"""OpenTelemetry tracing for both services: whether it is on (the standard `OTEL_*` variables
decide), the tracer provider and its exporters, the gRPC interceptors of the servers and of the
gateway's core channels, and what a request adds to its server span: one child span per stage
and attributes that are counts.

Off unless `OTEL_TRACES_EXPORTER` names `otlp` or `console` (`OTEL_SDK_DISABLED=true` wins):
then no SDK is imported, no interceptor is installed and a request pays for a few clock reads.
Spans never carry content: no prompt or output text, no media, no stop strings, no keys, no
tenant id. The gRPC instrumentation records method names, status codes and the peer address;
our own attributes are counts, ids we mint, and reasons.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from shared.config import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

EXPORTERS = ("otlp", "console")
ATTRIBUTE_PREFIX = "visor."
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


def exporters(env: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters the standard variables ask for; () means tracing is off. Unset means
    off here (not the SDK's default of otlp): a service exports only when told where."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = {n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
    unknown = names - {*EXPORTERS, "none", ""}
    if unknown:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER names {', '.join(sorted(unknown))}: "
            f"visor exports spans by {' or '.join(EXPORTERS)}"
        )
    wanted = tuple(n for n in EXPORTERS if n in names)
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if "otlp" in wanted and protocol.strip().lower() != "grpc":
        raise ConfigError("OTEL_EXPORTER_OTLP_PROTOCOL must be grpc: visor exports OTLP over gRPC")
    return wanted


def configure(service: str) -> bool:
    """Installs the global tracer provider when the environment asks for an exporter; returns
    whether it did. `service` is the resource's service.name unless OTEL_SERVICE_NAME is set."""
    global _provider, _tracer
    wanted = exporters(os.environ)
    if not wanted or _provider is not None:
        return _provider is not None
    # Imported only here, so a service with tracing off never loads the SDK.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    named = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service}
    provider = TracerProvider(resource=Resource.create(named))
    for name in wanted:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers, TLS, timeout: OTEL_EXPORTER_OTLP_*
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* tune it
    trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer("visor")
    return True


def shutdown() -> None:
    """Flushes and closes the exporters (on graceful stop). Blocks for at most the exporter's
    timeout (OTEL_EXPORTER_OTLP_TIMEOUT) when the collector is unreachable."""
    if _provider is not None:
        _provider.shutdown()


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The instrumentation's server interceptor (continues the caller's `traceparent`, makes the
    request's server span); none when tracing is off. Health and reflection stay untraced:
    probes would otherwise fill the tracing backend."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    untraced = filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
    return [aio_server_interceptor(_provider, filters.negate(untraced))]  # type: ignore[no-untyped-call]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The instrumentation's client interceptors (a client span per call, `traceparent` into its
    metadata); none when tracing is off. The router's periodic health checks stay untraced."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters

    untraced = filters.health_check()
    traced: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        _provider, filters.negate(untraced)
    )
    return traced


def _request_span() -> trace.Span | None:
    """The current request's server span, or None when tracing is off or it is not sampled."""
    if _provider is None:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def note(**attributes: int | str) -> None:
    """Sets `visor.<name>` attributes on the request's span: counts, ids we mint, reasons."""
    span = _request_span()
    if span is not None:
        span.set_attributes({ATTRIBUTE_PREFIX + k: v for k, v in attributes.items()})


def refused(reason: str) -> None:
    """Marks the request's span as failed with the refusal's reason (never its message)."""
    span = _request_span()
    if span is not None:
        span.set_attribute(ATTRIBUTE_PREFIX + "refusal_reason", reason)
        span.set_status(trace.Status(trace.StatusCode.ERROR, reason))


class Stages(dict[str, float]):
    """A request's stage timings in milliseconds (a plain dict to every reader) that also keeps
    when each stage ended, so that each can become a span with its real start and end.

    `stages[key] = ms` reports a stage that has just ended. `stages.update(...)` reports stages
    that ran back to back in the order given, the last one ending now: the runner's queue ->
    prefill -> generate are exact this way; the decode workers' image_decode -> preprocess are
    sums over parallel jobs, so their spans are approximate (they may start before the decode
    phase did)."""

    __slots__ = ("_ends",)

    def __init__(self) -> None:
        super().__init__()
        self._ends: dict[str, float] = {}  # perf_counter() when each stage ended

    def __setitem__(self, key: str, ms: float) -> None:
        super().__setitem__(key, ms)
        self._ends[key] = time.perf_counter()

    def update(self, *args: Any, **kwargs: float) -> None:
        stages: dict[str, float] = dict(*args, **kwargs)
        end = time.perf_counter()
        for key in reversed(stages):
            self._ends[key] = end
            end -= stages[key] / 1000
        super().update(stages)

    def intervals(self) -> dict[str, tuple[float, float]]:
        """(start, end) in perf_counter() seconds per stage."""
        return {k: (self._ends[k] - ms / 1000, self._ends[k]) for k, ms in self.items()}


def record_stages(stages: Stages) -> None:
    """One child span of the request's span per stage, placed where the stage ran."""
    span = _request_span()
    if span is None or _tracer is None:
        return
    # perf_counter times become wall-clock nanoseconds through one pair of readings.
    offset_ns = time.time_ns() - time.perf_counter_ns()
    parent = trace.set_span_in_context(span)
    for name, (start, end) in stages.intervals().items():
        child = _tracer.start_span(name, parent, start_time=int(start * 1e9) + offset_ns)
        child.end(end_time=int(end * 1e9) + offset_ns)

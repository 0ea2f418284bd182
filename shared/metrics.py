"""Prometheus helpers: the metrics endpoint and per-stage timing histograms."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Histogram, start_http_server

# The stage keys of DESIGN.md "Observability", in request order, with `handshake` (gateway: header
# to the core's cache reply) and `admit` (core: admission checks), which overlap the others.
STAGES = (
    "receive",
    "sniff",
    "probe",
    "handshake",
    "admit",
    "image_decode",
    "preprocess",
    "transfer",
    "cache_lookup",
    "encode",
    "compress",
    "queue",
    "prefill",
    "ttft",
    "generate",
)
STAGE_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


def stage_histogram(service: str) -> Histogram:
    return Histogram(
        f"visor_{service}_stage_ms",
        "Per-request stage timings in milliseconds (DESIGN.md stage keys).",
        ["stage"],
        buckets=STAGE_BUCKETS_MS,
    )


def observe(histogram: Histogram, timings_ms: Mapping[str, float]) -> None:
    for stage, value in timings_ms.items():
        histogram.labels(stage=stage).observe(value)


def serve(listen: str) -> None:
    """Starts the /metrics endpoint on `host:port`; an empty address disables it."""
    if not listen:
        return
    host, _, port = listen.rpartition(":")
    start_http_server(int(port), addr=host.strip("[]") or "127.0.0.1")

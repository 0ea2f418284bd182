"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from shared.metrics import stage_histogram

REQUESTS = Counter("visor_gateway_requests_total", "Generate calls by outcome.", ["outcome"])
STAGES = stage_histogram("gateway")
CORES_HEALTHY = Gauge("visor_gateway_cores_healthy", "Cores that passed their last health check.")
CORE_FAILOVERS = Counter(
    "visor_gateway_core_failovers_total", "Requests moved to the next core after UNAVAILABLE."
)
CORE_HEDGES = Counter(
    "visor_gateway_core_hedges_total",
    "Handshakes also sent to the next core after core_hedge_after_s without a cache reply.",
)

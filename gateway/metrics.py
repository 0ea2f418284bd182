"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter

from shared.metrics import stage_histogram

REQUESTS = Counter("visor_gateway_requests_total", "Generate calls by outcome.", ["outcome"])
STAGES = stage_histogram("gateway")

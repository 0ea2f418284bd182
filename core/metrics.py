"""The core's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.metrics import stage_histogram

REQUESTS = Counter("visor_core_requests_total", "Infer calls by outcome.", ["outcome"])
ACTIVE_GENERATIONS = Gauge("visor_core_active_generations", "Sequences generating now.")
CANCELLED_GENERATIONS = Counter(
    "visor_core_cancelled_generations_total",
    "Generations stopped early because the caller went away or its deadline passed.",
)
GENERATED_TOKENS = Counter("visor_core_generated_tokens_total", "Output tokens generated.")
STAGES = stage_histogram("core")
ENCODER_BATCH_TILES = Histogram(
    "visor_core_encoder_batch_tiles", "Tiles per encoder batch.", buckets=(1, 2, 4, 8, 16, 32, 64)
)
CACHE_LOOKUPS = Counter("visor_core_cache_lookups_total", "Feature-cache lookups.", ["result"])
TENSOR_BYTES = Counter("visor_core_tensor_bytes_total", "Tensor bytes received from gateways.")

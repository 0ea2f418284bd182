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

# Scheduler and KV cache (issue 5).
QUEUE_DEPTH = Gauge("visor_core_scheduler_waiting", "Requests waiting for admission.")
RUNNING_SEQS = Gauge("visor_core_scheduler_running", "Sequences in the running batch.")
TOKENS_PER_STEP = Histogram(
    "visor_core_scheduler_tokens_per_step",
    "Tokens (prefill chunks + decode tokens) run per model step.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
STEP_SECONDS = Histogram(
    "visor_core_scheduler_step_seconds",
    "Wall time of one model step.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
KV_BLOCKS_TOTAL = Gauge("visor_core_kv_blocks_total", "Blocks in the paged KV cache.")
KV_BLOCKS_USED = Gauge("visor_core_kv_blocks_used", "KV blocks held by sequences.")
PREFIX_QUERIED_TOKENS = Counter(
    "visor_core_prefix_queried_tokens_total", "Prompt tokens looked up in the prefix cache."
)
PREFIX_HIT_TOKENS = Counter(
    "visor_core_prefix_hit_tokens_total",
    "Prompt tokens whose KV came from the prefix cache (hit rate = hit / queried).",
)
PREFIX_HIT_RATE = Gauge("visor_core_prefix_hit_rate", "Prefix-cache hit rate over all prompts.")
PREEMPTIONS = Counter(
    "visor_core_scheduler_preemptions_total", "Sequences preempted (recomputed later)."
)
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TTFT = Histogram("visor_core_ttft_seconds", "Submission to first output token.", buckets=_LATENCY)
TPOT = Histogram(
    "visor_core_tpot_seconds",
    "Time per output token after the first.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)

"""`Engine.warm_up` (run by `visor core` before it reports SERVING): a prefill and a few decode
steps through the real engine, kept out of the metrics, and never a reason for a start to fail."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import REGISTRY

from core.config import SchedulerConfig
from core.engine import Engine

SAMPLES = (
    "visor_core_generated_tokens_total",
    "visor_core_step_seconds_count",
    "visor_core_prefix_queried_tokens_total",
    "visor_core_ttft_seconds_count",
)


def _metrics() -> dict[str, float | None]:
    return {name: REGISTRY.get_sample_value(name) for name in SAMPLES}


def test_warm_up_runs_steps_that_no_metric_counts(model_dir: Path) -> None:
    engine = Engine(model_dir, "warm-up")
    try:
        before = _metrics()
        asyncio.run(engine.warm_up(64))
        assert engine.scheduler.clock == 64 + 3  # the prefill, then a token per decode step
        assert engine.kv_manager.num_queried_tokens == 64
        assert _metrics() == before
        # Steps after it are counted from there, without the warm-up's prefix lookups.
        engine._record(engine.scheduler.schedule(), 0.0)
        queried = "visor_core_prefix_queried_tokens_total"
        assert _metrics()[queried] == before[queried]
    finally:
        engine.close()


def test_a_warm_up_that_cannot_fit_is_skipped(model_dir: Path) -> None:
    engine = Engine(model_dir, "warm-up-tight", scheduler=SchedulerConfig(max_request_tokens=4))
    try:
        asyncio.run(engine.warm_up())
        assert engine.scheduler.clock == 0
    finally:
        engine.close()

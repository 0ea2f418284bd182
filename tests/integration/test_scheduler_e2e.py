"""The scheduler through the real core and gateway over gRPC: prefix reuse never crosses tenants
(read from the core's Prometheus metrics), an oversized request is refused with TOKEN_BUDGET before
the core encodes anything, and a full queue answers OVERLOADED."""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from tests.conftest import OTHER_KEY, Stack, start_stack, stop_stack
from tests.helpers import DEV_KEY, generate, metric, request


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (80, 80, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


HITS = "visor_core_prefix_hit_tokens_total"


def test_identical_image_and_prompt_from_two_tenants_share_no_kv_blocks(stack: Stack) -> None:
    png, prompt = _png(11), "What colour is the circle?"
    first = generate(stack.gateway, request(prompt, media=(png,)), key=DEV_KEY)
    assert first.final is not None
    before = metric(stack.core_metrics, HITS)
    other = generate(stack.gateway, request(prompt, media=(png,)), key=OTHER_KEY)
    assert other.final is not None
    assert metric(stack.core_metrics, HITS) == before  # tenant-b found none of dev's blocks
    again = generate(stack.gateway, request("How many shapes?", media=(png,)), key=DEV_KEY)
    assert again.final is not None
    # dev's own blocks up to the question were reused: 64 visual tokens make at least 4 full blocks
    assert metric(stack.core_metrics, HITS) - before >= 64


@pytest.fixture(scope="module")
def tight(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(  # a one-at-a-time core with a tiny queue and a tiny per-request cap
        model_dir,
        tmp_path_factory.mktemp("tight"),
        VISOR_SCHEDULER_MAX_REQUEST_TOKENS="250",
        VISOR_SCHEDULER_POLICY="none",
        VISOR_SCHEDULER_MAX_WAITING="1",
    )
    yield s
    stop_stack(s)


def test_oversized_request_is_refused_before_any_compute(tight: Stack) -> None:
    encoded = metric(tight.core_metrics, "visor_core_encoder_batch_tiles_count")
    out = generate(tight.gateway, request("Describe it.", media=(_png(12),), max_new_tokens=200))
    assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED and out.reason == "TOKEN_BUDGET"
    assert "250" in out.message
    assert (
        metric(tight.core_metrics, "visor_core_encoder_batch_tiles_count") == encoded
    )  # nothing encoded
    assert metric(tight.core_metrics, "visor_core_generated_tokens_total") == 0


def test_full_queue_answers_overloaded(tight: Stack) -> None:
    req = request("describe this picture", max_new_tokens=200, min_new_tokens=200)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: generate(tight.gateway, req), range(8)))
    codes = {(o.code, o.reason) for o in outs}
    assert (grpc.StatusCode.UNAVAILABLE, "OVERLOADED") in codes
    assert any(o.final is not None for o in outs)  # the admitted ones still finish
    assert codes <= {(grpc.StatusCode.OK, ""), (grpc.StatusCode.UNAVAILABLE, "OVERLOADED")}

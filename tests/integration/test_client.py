"""The client library (`visor.Client`, `visor.AsyncClient`) against real servers: streaming and
one-shot answers, a typed exception per refusal, the upload path chosen by size, retries that
wait the server's hint, and no retry once a token has arrived."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import visor
from tests.conftest import SAMPLES, Stack, free_port, start_stack, stop_stack
from tests.gateway import hostile
from tests.gateway.test_gateway_admission import _chunk, _counted, _header, _outcomes, stalled
from tests.gateway.test_gateway_hardening import gateway
from tests.helpers import DEV_KEY

PNG = (SAMPLES / "shapes.png").read_bytes()
JPEG = (SAMPLES / "number.jpg").read_bytes()


def _check_stream(events: list[visor.Delta | visor.Answer]) -> visor.Answer:
    *deltas, answer = events
    assert deltas and all(isinstance(d, visor.Delta) for d in deltas)
    assert isinstance(answer, visor.Answer)
    assert "".join(d.text for d in deltas) == answer.text
    assert sum(d.num_tokens for d in deltas) == answer.usage["output_tokens"] == 6
    assert answer.usage["visual_tokens_before"] > 0 and answer.served_by
    return answer


def test_sync_stream_and_one_shot_call(stack: Stack) -> None:
    with visor.Client(stack.gateway, DEV_KEY) as client:
        streamed = _check_stream(
            list(client.generate("What is it?", [PNG], max_new_tokens=6, min_new_tokens=6))
        )
        once = client.ask(
            "What is it?", [PNG], max_new_tokens=6, min_new_tokens=6, logprobs=True, top_logprobs=2
        )
    assert once.text == streamed.text  # greedy: the same answer both ways
    assert streamed.logprobs is None
    assert once.logprobs is not None and len(once.logprobs) == 6
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in once.logprobs)
    assert once.as_json()["logprobs"][0].keys() == {"token", "logprob", "top"}


def test_async_stream_and_one_shot_call(stack: Stack) -> None:
    async def run() -> tuple[list[visor.Delta | visor.Answer], list[visor.Answer]]:
        async with visor.AsyncClient(stack.gateway, DEV_KEY) as client:
            events = [
                e
                async for e in client.generate(
                    "What is it?", [PNG], max_new_tokens=6, min_new_tokens=6
                )
            ]
            both = await asyncio.gather(  # one channel, two calls at once
                client.ask("What is it?", [PNG], max_new_tokens=6, min_new_tokens=6),
                client.ask("What is it?", [JPEG], max_new_tokens=6, min_new_tokens=6),
            )
            return events, list(both)

    events, (again, other) = asyncio.run(run())
    assert _check_stream(events).text == again.text
    assert other.cache[0]["content_hash"] != again.cache[0]["content_hash"]


def test_a_stream_left_early_is_cancelled(stack: Stack) -> None:
    with visor.Client(stack.gateway, DEV_KEY) as client:
        stream = client.generate("Tell a long story.", max_new_tokens=200, min_new_tokens=200)
        first = next(stream)
        assert isinstance(first, visor.Delta)
        stream.close()  # the call ends here; the same client goes on serving
        assert client.ask("What is it?", [PNG], max_new_tokens=2).usage["output_tokens"] == 2


REFUSALS = [
    ({"media": [hostile.png_declaring(100000, 100000)]}, DEV_KEY, visor.PixelLimit),
    ({"media": [PNG]}, "not-a-key", visor.Unauthenticated),
    ({"media": [PNG], "temperature": -1.0}, DEV_KEY, visor.InvalidRequest),
    ({"media": [b"GIF89a" + b"\0" * 4]}, DEV_KEY, visor.CorruptMedia),
    ({"media": [b"plain text, no image"]}, DEV_KEY, visor.UnsupportedFormat),
]


@pytest.mark.parametrize(("options", "key", "error"), REFUSALS)
def test_each_refusal_raises_its_own_class(
    stack: Stack, options: dict[str, object], key: str, error: type[visor.VisorError]
) -> None:
    with visor.Client(stack.gateway, key) as client, pytest.raises(error) as sync_raised:
        client.ask("What is it?", **options)

    async def run() -> None:
        async with visor.AsyncClient(stack.gateway, key) as client:
            await client.ask("What is it?", **options)

    with pytest.raises(error) as async_raised:
        asyncio.run(run())
    for raised in (sync_raised.value, async_raised.value):
        assert isinstance(raised, visor.VisorError) and raised.reason == error.REASON
        assert raised.code == visor.VisorError(error.REASON, "").code
        assert raised.message and raised.retry_after_s is None


def test_upload_is_chosen_by_total_media_size(stack: Stack, tmp_path: Path) -> None:
    """Only uploads count against max_upload_bytes_in_flight: while a stalled upload holds most
    of it, the client's upload path is refused OVERLOADED and its inline path is served."""
    cap = 4096  # bytes: the two images fit a request, not beside the stalled upload
    assert len(PNG + JPEG) <= cap < len(PNG + JPEG) + 3000 and len(PNG) + 3000 <= cap
    env = {
        "VISOR_GATEWAY_MAX_UPLOAD_BYTES_IN_FLIGHT": str(cap),
        "VISOR_LIMITS_MAX_REQUEST_BYTES": str(cap),
        "VISOR_LIMITS_MAX_ITEM_BYTES": str(cap),
    }
    with gateway(stack, tmp_path, **env) as gw, stalled(gw, 1, [_header(), _chunk(b"\0" * 3000)]):
        small = 64  # bytes: every request here goes through GenerateUpload
        with visor.Client(gw, DEV_KEY, inline_limit=small, retry=visor.NO_RETRY) as upload:
            assert upload.ask("What is it?", [PNG], max_new_tokens=2).usage["output_tokens"] == 2
            with pytest.raises(visor.Overloaded) as refused:
                upload.ask("Compare them.", [PNG, JPEG], max_new_tokens=2)
            assert "max_upload_bytes_in_flight" in refused.value.message
            assert refused.value.retry_after_s == pytest.approx(1.0)  # OVERLOADED's hint
        with visor.Client(gw, DEV_KEY) as inline:
            assert len(inline.ask("Compare them.", [PNG, JPEG], max_new_tokens=2).cache) == 2


def test_an_upload_of_several_chunks_is_assembled_byte_for_byte(stack: Stack) -> None:
    """An item of two chunks beside one of one (1.2 MB in all: assembled off the event loop)
    reaches the core as sent: each item's content hash is the SHA-256 of its bytes, and the
    answer is the one the same media get inline."""
    noise = np.random.default_rng(0).integers(0, 256, (640, 640, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(noise).save(out, format="PNG")
    big = out.getvalue()
    media = [big, JPEG]
    assert 1 << 20 < len(big) < 2 << 20
    ask = {"max_new_tokens": 3, "min_new_tokens": 3}
    with visor.Client(stack.gateway, DEV_KEY, inline_limit=64) as client:
        uploaded = client.ask("Compare them.", media, **ask)
    with visor.Client(stack.gateway, DEV_KEY) as client:
        inline = client.ask("Compare them.", media, **ask)
    hashes = [hashlib.sha256(m).hexdigest() for m in media]
    assert [c["content_hash"] for c in uploaded.cache] == hashes
    assert [c["content_hash"] for c in inline.cache] == hashes
    assert uploaded.text == inline.text


def test_quota_refusal_is_retried_after_the_servers_hint(stack: Stack, tmp_path: Path) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    env = {
        "VISOR_GATEWAY_RATE_PER_TENANT": "0.5",  # one request per 2 s
        "VISOR_GATEWAY_BURST_PER_TENANT": "1",
        "VISOR_GATEWAY_METRICS_LISTEN": metrics,
    }
    with gateway(stack, tmp_path, **env) as gw:
        with visor.Client(gw, DEV_KEY, retry=visor.NO_RETRY) as once:
            once.ask("hi", max_new_tokens=1)  # takes the bucket's one token
            with pytest.raises(visor.QuotaExceeded) as refused:
                once.ask("hi", max_new_tokens=1)
        hint = refused.value.retry_after_s
        assert hint is not None and 0.5 < hint <= 2.0
        before = _outcomes(metrics)
        t0 = time.monotonic()
        with visor.Client(gw, DEV_KEY) as patient:
            assert patient.ask("hi", max_new_tokens=1).usage["output_tokens"] == 1
        assert time.monotonic() - t0 >= 0.5  # it waited for the bucket
        assert _counted(metrics, before, {"ok": 1}) == {"QUOTA_EXCEEDED": 1, "ok": 1}
        t0 = time.monotonic()
        with (
            visor.Client(gw, DEV_KEY, timeout=0.3) as hurried,
            pytest.raises(visor.QuotaExceeded),
        ):
            hurried.ask("hi", max_new_tokens=1)  # the hint outlives its deadline: no wait
        assert time.monotonic() - t0 < 0.3


@pytest.fixture()
def kill_stack(model_dir: Path, tmp_path: Path) -> Iterator[tuple[Stack, str]]:
    metrics = f"127.0.0.1:{free_port()}"
    env = {
        "VISOR_GATEWAY_METRICS_LISTEN": metrics,
        "VISOR_LIMITS_MAX_NEW_TOKENS": "4096",
        "VISOR_GATEWAY_CORE_ATTEMPT_TIMEOUT_S": "1.0",
    }
    s = start_stack(model_dir, tmp_path, **env)
    yield s, metrics
    with contextlib.suppress(Exception):
        stop_stack(s)


def test_no_retry_after_a_token_and_retries_before_one(kill_stack: tuple[Stack, str]) -> None:
    stack, metrics = kill_stack
    policy = visor.Retry(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1)
    before = _outcomes(metrics)
    with visor.Client(stack.gateway, DEV_KEY, retry=policy, timeout=60) as client:
        stream = client.generate("Tell a long story.", max_new_tokens=4000, min_new_tokens=4000)
        assert isinstance(next(stream), visor.Delta)
        stack.core_proc.kill()  # SIGKILL mid-stream
        stack.core_proc.wait(10)
        with pytest.raises(visor.CoreUnavailable):
            for _ in stream:
                pass
        moved = _counted(metrics, before, {"CORE_UNAVAILABLE": 1})
        assert moved == {"CORE_UNAVAILABLE": 1}  # one call: the answer was not asked again

        before = _outcomes(metrics)  # no core at all: refused before any token, so retried
        with pytest.raises(visor.CoreUnavailable):
            client.ask("What is it?", max_new_tokens=2)
        assert _counted(metrics, before, {"CORE_UNAVAILABLE": 3}) == {"CORE_UNAVAILABLE": 3}
    assert stack.gateway_proc.poll() is None

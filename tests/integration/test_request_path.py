"""The whole request path through a real gateway and a real core on loopback."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from shared.errors import Reason, VisorError
from shared.proto import gateway_pb2
from tests.conftest import CORPUS, SAMPLES, Stack, corpus_rows, need_corpus
from tests.helpers import Outcome, generate, request
from visor.client import Client

# Stage keys every served image request must report (DESIGN.md "Observability").
REQUIRED_STAGES = {
    "receive",
    "image_decode",
    "preprocess",
    "transfer",
    "encode",
    "prefill",
    "ttft",
    "generate",
}
MISS_ONLY = {"image_decode", "preprocess", "transfer", "encode"}
ACCEPT = [r["file"] for r in corpus_rows() if r["expect"] == "accept"]
REJECT = [(r["file"], r["reason"]) for r in corpus_rows() if r["expect"] == "reject"]
EITHER = [r["file"] for r in corpus_rows() if r["expect"] == "either"]


def assert_served(out: Outcome) -> gateway_pb2.Final:
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
    assert out.final is not None
    # Text streams before the final event (an answer that is only end-of-sequence has none).
    assert "".join(out.deltas) == out.final.text
    assert out.final.usage.output_tokens > 0
    stages = set(out.final.timings_ms)
    if out.final.cache and all(c.hit for c in out.final.cache):
        # Features came from the core's cache: nothing was decoded, sent or encoded.
        assert not stages & MISS_ONLY, sorted(stages)
        assert stages >= REQUIRED_STAGES - MISS_ONLY, sorted(stages)
    else:
        assert stages >= REQUIRED_STAGES, sorted(stages)
    assert all(v >= 0 for v in out.final.timings_ms.values())
    assert out.final.served_by
    return out.final


@pytest.mark.parametrize(
    "name", sorted(p.name for p in SAMPLES.iterdir() if p.suffix in {".png", ".jpg", ".gif"})
)
def test_samples_are_served(stack: Stack, name: str) -> None:
    data = (SAMPLES / name).read_bytes()
    final = assert_served(generate(stack.gateway, request(media=(data,))))
    # An animation becomes one item per sampled frame (up to [limits] max_sampled_frames = 8).
    with Image.open(io.BytesIO(data)) as img:
        items = min(int(getattr(img, "n_frames", 1)), 8)
    assert final.usage.visual_tokens_before == 64 * items  # 224 px tiles of 28 px patches
    assert len(final.cache) == items  # hit or miss: earlier tests may have sent these samples


@pytest.mark.parametrize("name", ACCEPT or ["(corpus absent)"])
def test_corpus_accept_files_are_served(stack: Stack, name: str) -> None:
    need_corpus()
    final = assert_served(generate(stack.gateway, request(media=((CORPUS / name).read_bytes(),))))
    # First sight: decoded, sent and encoded; an animation is one item per sampled frame.
    assert final.cache and [c.hit for c in final.cache] == [False] * len(final.cache)


@pytest.mark.parametrize(("name", "reason"), REJECT or [("(corpus absent)", "")])
def test_corpus_reject_files_get_their_reason(stack: Stack, name: str, reason: str) -> None:
    need_corpus()
    out = generate(stack.gateway, request(media=((CORPUS / name).read_bytes(),)))
    assert out.final is None
    assert out.reason == reason, (out.code, out.reason, out.message)
    assert out.code == VisorError(Reason(reason), "").code


@pytest.mark.parametrize("name", EITHER or ["(corpus absent)"])
def test_corpus_either_files_get_a_clean_answer(stack: Stack, name: str) -> None:
    need_corpus()
    out = generate(stack.gateway, request(media=((CORPUS / name).read_bytes(),)))
    assert out.code == grpc.StatusCode.OK or out.reason in {r.value for r in Reason}
    assert out.reason != "INTERNAL"


def test_generated_bmp_is_unsupported(stack: Stack) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "BMP")
    out = generate(stack.gateway, request(media=(buf.getvalue(),)))
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "UNSUPPORTED_FORMAT")


def test_text_only_request_is_served(stack: Stack) -> None:
    out = generate(stack.gateway, request("Say something."))
    assert out.code == grpc.StatusCode.OK and out.final is not None
    assert out.final.usage.visual_tokens_before == 0
    assert {"receive", "prefill", "ttft", "generate"} <= set(out.final.timings_ms)


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_key_is_unauthenticated(stack: Stack, key: str | None) -> None:
    out = generate(stack.gateway, request("hello"), key=key)
    assert (out.code, out.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")


def test_request_limits(stack: Stack) -> None:
    png = (SAMPLES / "shapes.png").read_bytes()
    cases = {
        "IMAGE_COUNT_LIMIT": request(media=(png,) * 9),
        "PROMPT_TOO_LONG": request("x" * 20000),
        "TOKEN_BUDGET": request("hi", max_new_tokens=100000),
        "INVALID_REQUEST": request(""),
    }
    for reason, req in cases.items():
        out = generate(stack.gateway, req)
        assert out.reason == reason, (reason, out.code, out.message)
        assert "x" * 50 not in out.message  # refusals never echo user content


def test_greedy_is_deterministic_and_stop_strings_cut(stack: Stack) -> None:
    png = (SAMPLES / "shapes.png").read_bytes()
    first = generate(stack.gateway, request(media=(png,), max_new_tokens=12, min_new_tokens=12))
    again = generate(stack.gateway, request(media=(png,), max_new_tokens=12, min_new_tokens=12))
    assert first.final is not None and again.final is not None
    assert first.final.text == again.final.text
    assert first.final.finish_reason == "length" and first.final.usage.output_tokens == 12
    text = first.final.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        cut = generate(
            stack.gateway, request(media=(png,), max_new_tokens=12, min_new_tokens=12, stop=[stop])
        )
        assert cut.final is not None and cut.final.finish_reason == "stop"
        assert cut.final.text == text[: text.find(stop)]


def test_sampling_with_a_seed_repeats(stack: Stack) -> None:
    req = request(
        "Describe it.",
        max_new_tokens=10,
        min_new_tokens=10,
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        seed=7,
    )
    a, b = generate(stack.gateway, req), generate(stack.gateway, req)
    assert a.final is not None and b.final is not None and a.final.text == b.final.text


def test_multi_turn_conversation(stack: Stack) -> None:
    png = (SAMPLES / "shapes.png").read_bytes()
    req = gateway_pb2.GenerateRequest(
        turns=[
            gateway_pb2.Turn(role=gateway_pb2.ROLE_SYSTEM, text="Answer briefly."),
            gateway_pb2.Turn(
                role=gateway_pb2.ROLE_USER,
                text="What is this?",
                media=[gateway_pb2.Media(data=png)],
            ),
            gateway_pb2.Turn(role=gateway_pb2.ROLE_ASSISTANT, text="Two shapes."),
        ],
        prompt="Which one is red?",
        params=gateway_pb2.GenerationParams(max_new_tokens=4),
    )
    final = assert_served(generate(stack.gateway, req))
    single = generate(stack.gateway, request("Which one is red?", max_new_tokens=4))
    assert single.final is not None
    assert final.usage.text_tokens > single.final.usage.text_tokens
    assert final.usage.visual_tokens_before == 64


def _noise_png(side: int) -> bytes:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_upload_variant_serves_an_image_above_the_message_limit(stack: Stack) -> None:
    big = _noise_png(1400)
    assert len(big) > 5 * 1024 * 1024
    inline = generate(stack.gateway, request(media=(big,)))
    assert inline.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's own 4 MiB message limit
    with Client(stack.gateway, "visor-dev-key") as client:
        answer = client.ask("What is it?", [big], max_new_tokens=4)
    assert answer.usage["visual_tokens_before"] == 64
    assert set(answer.timings_ms) >= REQUIRED_STAGES


def test_health_and_reflection_on_both_servers(stack: Stack) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for target, service in ((stack.gateway, "visor.v1.Gateway"), (stack.core, "visor.v1.Core")):
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = {s.name for r in replies for s in r.list_services_response.service}
            assert service in names


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "visor.cli", "ask", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_ask_json(stack: Stack) -> None:
    ok = _cli(
        str(SAMPLES / "shapes.png"),
        "--prompt",
        "What?",
        "--target",
        stack.gateway,
        "--max-new-tokens",
        "4",
        "--json",
    )
    assert ok.returncode == 0, ok.stderr
    body = json.loads(ok.stdout)
    assert set(body) >= {"text", "usage", "timings_ms", "cache", "served_by"}
    assert body["usage"]["visual_tokens_before"] == 64
    bad = _cli(
        str(SAMPLES / "shapes.png"),
        "--prompt",
        "What?",
        "--target",
        stack.gateway,
        "--key",
        "nope",
        "--json",
    )
    assert bad.returncode == 1
    assert json.loads(bad.stdout) == {
        "error": {
            "status": "UNAUTHENTICATED",
            "reason": "UNAUTHENTICATED",
            "message": "unknown API key",
        }
    }


def test_logs_hold_no_user_content(stack: Stack) -> None:
    secret_prompt = "my-secret-prompt-4711"
    out = generate(
        stack.gateway, request(secret_prompt, media=((SAMPLES / "number.jpg").read_bytes(),))
    )
    assert out.code == grpc.StatusCode.OK
    for name in ("gateway.log", "core.log"):
        text = (stack.logs / name).read_text()
        assert secret_prompt not in text
        assert "visor-dev-key" not in text
        answer = out.final.text.strip() if out.final is not None else ""
        # The answer is user content too, where it is distinctive enough to find ("1" is not).
        assert len(answer) < 4 or answer not in text
        lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert any("timings_ms" in line for line in lines), name


def test_profiles_reduce_visual_tokens(stack: Stack) -> None:
    from core import compression
    from shared import wire

    assert set(wire.PROFILES) == set(compression.PROFILES), "gateway and core disagree on profiles"
    image = (SAMPLES / "number.jpg").read_bytes()
    seen = {}
    for name in wire.PROFILES:
        req = request(media=(image,))
        req.profile = name
        final = assert_served(generate(stack.gateway, req))
        seen[name] = (final.usage.visual_tokens_before, final.usage.visual_tokens_after)
    before = seen["none"][0]
    assert before > 0 and all(b == before for b, _ in seen.values())
    assert seen["none"][1] == before
    assert seen["balanced"][1] <= before // 2 + 1
    assert seen["low-latency"][1] < seen["balanced"][1] < seen["high-precision"][1] < before
    bad = request(media=(image,))
    bad.profile = "ultra"
    out = generate(stack.gateway, bad)
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")

"""The core serves only its deployment's gateways, on loopback too (issue 24, item 2): a caller
without the core token, or with a wrong one, gets UNAUTHENTICATED (with its ErrorInfo reason) from
Describe and Infer, so a local process can neither test whether a tenant holds an image nor plant
its own pixels under that tenant's content hash. Health checks stay open; the gateway's own path
works. Each attack is also run with the token, to show it is a real one that the token alone stops.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from shared import procs
from shared.hashing import content_hash
from shared.proto import core_pb2, core_pb2_grpc
from shared.wire import chunks
from tests.conftest import Stack, free_port
from tests.helpers import _reason, core_metadata, generate, request

WRONG = (("visor-core-token", "0" * 64),)


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _describe(stack: Stack, metadata: tuple[tuple[str, str], ...]) -> core_pb2.CoreInfo:
    with grpc.insecure_channel(stack.core) as channel:
        stub = core_pb2_grpc.CoreStub(channel)  # type: ignore[no-untyped-call]
        return stub.Describe(core_pb2.DescribeRequest(), metadata=metadata, timeout=10)


def _messages(
    info: core_pb2.CoreInfo, tenant: str, digest: str, tensor: np.ndarray | None
) -> Iterator[core_pb2.CoreMessage]:
    """A gateway's Infer stream for one still image as the gateway would declare it (one tile):
    the header, then (when given) the tensor, sent without waiting for the cache reply."""
    size = info.image_size
    header = core_pb2.InferHeader(tenant=tenant, request_id=f"probe-{digest[:8]}")
    header.params.max_new_tokens = 1
    header.turns.add(role="user", text="What is this?", num_images=1)
    header.items.add(
        content_hash=digest,
        preprocess_version=info.preprocess_version,
        resolution=size,
        tile_rows=1,
        tile_cols=1,
        dtype="uint8",
        shape=[1, 3, size, size],
    )
    yield core_pb2.CoreMessage(header=header)
    if tensor is not None:
        for piece in chunks(tensor):
            yield core_pb2.CoreMessage(tensor=core_pb2.TensorChunk(item_index=0, data=piece))


def _infer(
    stack: Stack, messages: Iterator[core_pb2.CoreMessage], metadata: tuple[tuple[str, str], ...]
) -> tuple[list[core_pb2.CoreEvent], grpc.StatusCode, str]:
    """Runs Infer to its end; (events, status, ErrorInfo reason)."""
    events: list[core_pb2.CoreEvent] = []
    with grpc.insecure_channel(stack.core) as channel:
        stub = core_pb2_grpc.CoreStub(channel)  # type: ignore[no-untyped-call]
        try:
            for event in stub.Infer(messages, metadata=metadata, timeout=60):
                events.append(event)
        except grpc.RpcError as exc:
            return events, exc.code(), _reason(exc)
    return events, grpc.StatusCode.OK, ""


@pytest.mark.parametrize("metadata", [(), WRONG], ids=["no-token", "wrong-token"])
def test_core_rpcs_refuse_callers_without_the_token(
    stack: Stack, metadata: tuple[tuple[str, str], ...]
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _describe(stack, metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _reason(refused.value) == "UNAUTHENTICATED"
    info = _describe(stack, core_metadata(stack.env))  # the deployment's token is accepted
    assert info.image_size > 0
    events, code, reason = _infer(stack, _messages(info, "dev", "0" * 64, None), metadata)
    assert (events, code, reason) == ([], grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")


def test_health_answers_without_the_token(stack: Stack) -> None:
    with grpc.insecure_channel(stack.core) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "visor.v1.Core"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_local_process_cannot_probe_a_tenants_cache(stack: Stack) -> None:
    png = _png(1)
    out = generate(stack.gateway, request(media=(png,), max_new_tokens=2))  # dev caches it
    assert out.code == grpc.StatusCode.OK and out.final is not None, (out.code, out.reason)
    info = _describe(stack, core_metadata(stack.env))
    for metadata in ((), WRONG):
        probe = _messages(info, "dev", content_hash(png), None)
        events, code, reason = _infer(stack, probe, metadata)
        assert (events, code, reason) == ([], grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    # The same header from a gateway gets the answer the attacker was after.
    probe = _messages(info, "dev", content_hash(png), None)
    events, code, _ = _infer(stack, probe, core_metadata(stack.env))
    assert code == grpc.StatusCode.OK and list(events[0].cache.held) == [True]


def test_a_local_process_cannot_poison_a_tenants_cache(stack: Stack) -> None:
    info = _describe(stack, core_metadata(stack.env))
    size = info.image_size
    own_pixels = np.full((1, 3, size, size), 7, dtype=np.uint8)
    victim, control = _png(2), _png(3)
    poison = _messages(info, "dev", content_hash(victim), own_pixels)
    events, code, reason = _infer(stack, poison, ())
    assert (events, code, reason) == ([], grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    out = generate(stack.gateway, request(media=(victim,), max_new_tokens=2))
    assert out.code == grpc.StatusCode.OK and out.final is not None, (out.code, out.reason)
    assert [c.hit for c in out.final.cache] == [False]  # its own pixels, encoded now
    # With the token the same stream is stored and later served as a hit: the attack was real.
    planted = _messages(info, "dev", content_hash(control), own_pixels)
    _, code, _ = _infer(stack, planted, core_metadata(stack.env))
    assert code == grpc.StatusCode.OK
    out = generate(stack.gateway, request(media=(control,), max_new_tokens=2))
    assert out.code == grpc.StatusCode.OK and out.final is not None
    assert [c.hit for c in out.final.cache] == [True]


def test_a_gateway_of_another_deployment_gets_core_unavailable(stack: Stack) -> None:
    """A gateway whose secret differs is never let in; its clients see CORE_UNAVAILABLE (their
    own keys are fine), not UNAUTHENTICATED."""
    env = {
        **stack.env,
        "VISOR_GATEWAY_LISTEN": f"127.0.0.1:{free_port()}",
        "VISOR_GATEWAY_DECODE_WORKERS": "1",
        "VISOR_DEPLOYMENT_SECRET_FILE": str(stack.logs / "other-deployment.secret"),
    }
    config, log = stack.logs / "visor.toml", stack.logs / "gateway-other.log"
    gw = procs.start("gateway", env, config, log_path=log)
    try:
        procs.wait_healthy(env["VISOR_GATEWAY_LISTEN"], gw, timeout_s=60)
        out = generate(env["VISOR_GATEWAY_LISTEN"], request(max_new_tokens=2))
        assert (out.code, out.reason) == (grpc.StatusCode.UNAVAILABLE, "CORE_UNAVAILABLE")
    finally:
        procs.stop(gw)

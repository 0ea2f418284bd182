"""The core declares its preprocessing rule through Describe, refuses at admission an item whose
shape breaks it (INVALID_REQUEST, before any tensor), and the llava demo still serves a repeated
image from its cache with the rule's digest in every key."""

from __future__ import annotations

import io
from collections.abc import Iterator

import grpc
import numpy as np
from PIL import Image

from shared.hashing import content_hash
from shared.preprocess import tiles
from shared.proto import core_pb2, core_pb2_grpc, rule_from_proto
from tests.conftest import Stack
from tests.helpers import _reason, core_metadata, generate, request


def _describe(stack: Stack) -> core_pb2.CoreInfo:
    with grpc.insecure_channel(stack.core) as channel:
        stub = core_pb2_grpc.CoreStub(channel)  # type: ignore[no-untyped-call]
        info: core_pb2.CoreInfo = stub.Describe(
            core_pb2.DescribeRequest(), metadata=core_metadata(stack.env), timeout=10
        )
        return info


def _header(info: core_pb2.CoreInfo, shape: list[int], version: str) -> core_pb2.CoreMessage:
    header = core_pb2.InferHeader(tenant="dev", request_id="rule-check")
    header.params.max_new_tokens = 1
    header.turns.add(role="user", text="What is this?", num_images=1)
    size = info.image_size
    header.items.add(
        content_hash="0" * 64,
        preprocess_version=version,
        resolution=size,
        tile_rows=1,
        tile_cols=1,
        dtype="uint8",
        shape=shape,
    )
    return core_pb2.CoreMessage(header=header)


def _infer(stack: Stack, first: core_pb2.CoreMessage) -> tuple[grpc.StatusCode, str, int]:
    """(status, ErrorInfo reason, events received) of an Infer that sends only its header."""

    def messages() -> Iterator[core_pb2.CoreMessage]:
        yield first

    events = 0
    with grpc.insecure_channel(stack.core) as channel:
        stub = core_pb2_grpc.CoreStub(channel)  # type: ignore[no-untyped-call]
        try:
            for _ in stub.Infer(messages(), metadata=core_metadata(stack.env), timeout=30):
                events += 1
        except grpc.RpcError as exc:
            return exc.code(), _reason(exc), events
    return grpc.StatusCode.OK, "", events


def test_describe_carries_the_rule_and_its_digest(stack: Stack) -> None:
    info = _describe(stack)
    rule = rule_from_proto(info.rule)
    assert rule.kind == "tiles" and rule.resample == "bicubic"
    assert info.preprocess_version == rule.version() != "pp1"
    # The old fields still describe the same tiles rule (old gateways read only them).
    legacy = tiles(info.image_size, info.tokens_per_tile, rule.mean, rule.std)
    assert legacy == rule
    assert np.allclose(info.image_mean, rule.mean) and np.allclose(info.image_std, rule.std)


def test_admission_refuses_a_shape_that_breaks_the_rule(stack: Stack) -> None:
    info = _describe(stack)
    size, version = info.image_size, info.preprocess_version
    refused = {
        "not square": _header(info, [1, 3, size, size + 1], version),
        "four channels": _header(info, [1, 4, size, size], version),
        "another rule": _header(info, [1, 3, size, size], "pp1-" + "0" * 64),
        "old version": _header(info, [1, 3, size, size], "pp1"),
    }
    for name, first in refused.items():
        code, reason, events = _infer(stack, first)
        assert (code, reason, events) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_REQUEST",
            0,
        ), name
    # The same header with the rule's shape and version is admitted (its cache reply comes).
    code, reason, events = _infer(stack, _header(info, [1, 3, size, size], version))
    assert events == 1, (code, reason)


def test_the_demo_hits_its_cache_on_a_repeat(stack: Stack) -> None:
    pixels = np.random.default_rng(11).integers(0, 256, (90, 130, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    png = buf.getvalue()
    hits = []
    for _ in range(2):
        out = generate(stack.gateway, request(media=(png,), max_new_tokens=2))
        assert out.code == grpc.StatusCode.OK and out.final is not None, (out.code, out.reason)
        assert [c.content_hash for c in out.final.cache] == [content_hash(png)]
        hits.append(out.final.cache[0].hit)
    assert hits == [False, True]

"""Tracing through a real gateway and core: a caller's `traceparent` is continued by both, the
spans reach an OTLP collector (a real gRPC TraceService in this process), each service adds one
span per stage and count attributes, and no content ever appears in what is exported."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from shared.proto import core_pb2, core_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.conftest import SAMPLES, Stack, start_stack, stop_stack
from tests.helpers import DEV_KEY, request

GATEWAY_STAGES = {
    "receive", "sniff", "probe", "handshake", "image_decode", "preprocess", "transfer", "ttft"
}  # fmt: skip
CORE_STAGES = {"admit", "cache_lookup", "encode", "compress", "queue", "prefill", "generate"}
CANARY_PROMPT = "canary-prompt-5f0c9e"  # must appear in no exported byte
CANARY_STOP = "canary-stop-a71d"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every export request as it arrived, bytes included."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.raw: list[bytes] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            self.raw.append(request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[str, trace_pb2.Span]]:
        """(service.name, span) for every span exported so far."""
        out = []
        with self.lock:
            raw = list(self.raw)
        for data in raw:
            req = trace_service_pb2.ExportTraceServiceRequest.FromString(data)
            for rs in req.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                out += [(attrs["service.name"], s) for ss in rs.scope_spans for s in ss.spans]
        return out


@dataclass
class Traced:
    stack: Stack
    collector: Collector


@pytest.fixture(scope="module")
def traced(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    otel = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    stack = start_stack(model_dir, tmp_path_factory.mktemp("traced"), **otel)
    try:
        yield Traced(stack, collector)
    finally:
        stop_stack(stack)
        server.stop(0)


def _call(target: str, req: gateway_pb2.GenerateRequest, metadata: list[tuple[str, str]]) -> str:
    """The final answer's text, or the refusal's status code name."""
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            finals = [e.final for e in stub.Generate(req, metadata=metadata, timeout=60)]
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return str(finals[-1].text)


def _trace(collector: Collector, trace_id: bytes, want: int) -> list[tuple[str, trace_pb2.Span]]:
    """The trace's spans once at least `want` arrived (the exporters batch for 100 ms)."""
    deadline = time.monotonic() + 20
    while True:
        found = [(svc, s) for svc, s in collector.spans() if s.trace_id == trace_id]
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind) if kind else None
    return out


def _server_span(spans: list[tuple[str, trace_pb2.Span]], service: str) -> trace_pb2.Span:
    found = [s for svc, s in spans if svc == service and s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    assert len(found) == 1, [s.name for _, s in spans]
    return found[0]


def _ancestors(span: trace_pb2.Span, by_id: dict[bytes, trace_pb2.Span]) -> set[bytes]:
    seen = set()
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        seen.add(span.span_id)
    return seen


def test_one_trace_across_gateway_and_core_with_stage_spans(traced: Traced) -> None:
    trace_id, caller_span = secrets.token_bytes(16), secrets.token_bytes(8)
    traceparent = f"00-{trace_id.hex()}-{caller_span.hex()}-01"
    image = (SAMPLES / "colour.png").read_bytes()
    req = request(CANARY_PROMPT, (image,), max_new_tokens=8, min_new_tokens=8, stop=[CANARY_STOP])
    req.profile = "balanced"
    metadata = [("authorization", f"Bearer {DEV_KEY}"), ("traceparent", traceparent)]
    answer = _call(traced.stack.gateway, req, metadata)

    want = 2 + len(GATEWAY_STAGES) + len(CORE_STAGES)
    spans = _trace(traced.collector, trace_id, want)
    gateway = _server_span(spans, "visor-gateway")
    core = _server_span(spans, "visor-core")
    assert gateway.name == "/visor.v1.Gateway/Generate" and core.name == "/visor.v1.Core/Infer"
    assert gateway.parent_span_id == caller_span  # the caller's trace is continued
    by_id = {s.span_id: s for _, s in spans}
    assert gateway.span_id in _ancestors(core, by_id)  # through the gateway's client span

    for service, parent, names in (
        ("visor-gateway", gateway, GATEWAY_STAGES),
        ("visor-core", core, CORE_STAGES),
    ):
        stages = {
            s.name: s
            for svc, s in spans
            if svc == service
            and s.parent_span_id == parent.span_id
            and s.kind == trace_pb2.Span.SPAN_KIND_INTERNAL
        }
        assert set(stages) == names
        slack = 5_000_000  # ns: perf_counter and the wall clock are read a moment apart
        for name, s in stages.items():
            assert s.start_time_unix_nano <= s.end_time_unix_nano
            if name in ("image_decode", "preprocess"):
                continue  # sums over parallel jobs: placed approximately
            assert s.start_time_unix_nano >= parent.start_time_unix_nano - slack, name
            assert s.end_time_unix_nano <= parent.end_time_unix_nano + slack, name
    core_stages = {s.name: s for svc, s in spans if svc == "visor-core" and s.name in CORE_STAGES}
    # The runner's stages ran back to back.
    assert core_stages["queue"].end_time_unix_nano == core_stages["prefill"].start_time_unix_nano
    assert core_stages["prefill"].end_time_unix_nano == core_stages["generate"].start_time_unix_nano

    g, c = _attrs(gateway), _attrs(core)
    assert g["visor.request_id"] == c["visor.request_id"]
    assert (g["visor.num_items"], g["visor.cache_hits"], g["visor.cache_misses"]) == (1, 0, 1)
    assert g["visor.output_tokens"] == c["visor.output_tokens"] == 8  # min = max = 8
    assert g["visor.finish_reason"] == c["visor.finish_reason"] == "length"
    assert (c["visor.num_tiles"], c["visor.profile"]) == (1, "balanced")
    assert c["visor.visual_tokens_after"] < c["visor.visual_tokens_before"]

    exported = b"".join(traced.collector.raw)
    assert CANARY_PROMPT.encode() not in exported and CANARY_STOP.encode() not in exported
    assert DEV_KEY.encode() not in exported
    if len(answer.strip()) >= 8:  # the demo model's answer, when long enough to be telling
        assert answer.encode() not in exported
    assert not [s.name for _, s in traced.collector.spans() if "grpc.health" in s.name]


def test_a_refusal_marks_the_gateway_span(traced: Traced) -> None:
    trace_id = secrets.token_bytes(16)
    traceparent = f"00-{trace_id.hex()}-{secrets.token_bytes(8).hex()}-01"
    metadata = [("authorization", "Bearer not-a-key"), ("traceparent", traceparent)]
    assert _call(traced.stack.gateway, request(CANARY_PROMPT), metadata) == "UNAUTHENTICATED"
    gateway = _server_span(_trace(traced.collector, trace_id, 1), "visor-gateway")
    assert gateway.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert _attrs(gateway)["visor.refusal_reason"] == "UNAUTHENTICATED"
    assert gateway.status.message == "UNAUTHENTICATED"
    assert CANARY_PROMPT.encode() not in b"".join(traced.collector.raw)


def test_a_core_call_without_the_token_makes_no_span(traced: Traced) -> None:
    """The core's token check runs before the tracing interceptor: a caller that is not one of
    the deployment's gateways cannot put spans into its trace."""
    trace_id = secrets.token_bytes(16)
    traceparent = f"00-{trace_id.hex()}-{secrets.token_bytes(8).hex()}-01"
    with grpc.insecure_channel(traced.stack.core) as channel:
        stub = core_pb2_grpc.CoreStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Describe(core_pb2.DescribeRequest(), metadata=[("traceparent", traceparent)])
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A span that goes out goes within the 100 ms batch delay; a traced call proves the
    # exporter is still sending.
    marker = secrets.token_bytes(16)
    marker_parent = f"00-{marker.hex()}-{secrets.token_bytes(8).hex()}-01"
    metadata = [("authorization", "Bearer not-a-key"), ("traceparent", marker_parent)]
    _call(traced.stack.gateway, request("hi"), metadata)
    assert _trace(traced.collector, marker, 1)
    time.sleep(0.3)
    assert _trace(traced.collector, trace_id, 0) == []

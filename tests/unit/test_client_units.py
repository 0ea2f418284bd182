"""The client library's parts that need no server: one exception class per reason, the retry
policy, the RetryInfo a refusal carries, the upload stream; and the ground floor (`shared/`)
importing no service code."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from shared.errors import Reason, VisorError
from shared.status import OVERLOADED_RETRY_S, to_status
from tests.conftest import ROOT
from visor import errors, request
from visor.retry import NO_RETRY, RETRYABLE, Retry

SERVICE_PACKAGES = {"core", "gateway", "bench", "visor"}


def _imported_roots(path: Path) -> set[str]:
    """Top-level packages `path` imports anywhere (function-level imports included)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_shared_imports_no_service_code() -> None:
    files = sorted((ROOT / "shared").glob("*.py"))
    assert len(files) > 10
    found = {f.name: _imported_roots(f) & SERVICE_PACKAGES for f in files}
    assert {name: roots for name, roots in found.items() if roots} == {}


def test_the_ast_walk_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from core import engine\n    import gateway.pool\n")
    assert _imported_roots(source) == {"core", "gateway"}


def test_every_reason_has_exactly_one_error_class() -> None:
    assert set(errors.ERROR_OF) == set(Reason)
    assert len({cls.__name__ for cls in errors.ERROR_OF.values()}) == len(Reason)
    for reason, cls in errors.ERROR_OF.items():
        err = errors.typed(VisorError(reason, "names the limit", retry_after_s=0.25))
        assert type(err) is cls and isinstance(err, VisorError)
        assert (err.reason, err.message, err.retry_after_s) == (reason, "names the limit", 0.25)
        assert err.code == VisorError(reason, "").code  # the status comes from the one table
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and back.message == err.message and back.retry_after_s == 0.25


def _details(status: grpc.Status) -> status_pb2.Status:
    (blob,) = [v for k, v in status.trailing_metadata if k == "grpc-status-details-bin"]
    return status_pb2.Status.FromString(blob)


def _retry_delay(status: grpc.Status) -> float | None:
    for detail in _details(status).details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            hint = error_details_pb2.RetryInfo()
            detail.Unpack(hint)
            return float(hint.retry_delay.ToNanoseconds() / 1e9)
    return None


def test_refusals_carry_a_retry_hint_only_when_waiting_helps() -> None:
    quota = to_status(VisorError(Reason.QUOTA_EXCEEDED, "rate", retry_after_s=0.75))
    assert _retry_delay(quota) == pytest.approx(0.75)
    assert _retry_delay(to_status(VisorError(Reason.OVERLOADED, "queue"))) == OVERLOADED_RETRY_S
    assert _retry_delay(to_status(VisorError(Reason.PIXEL_LIMIT, "max_pixels"))) is None
    info = error_details_pb2.ErrorInfo()
    assert _details(quota).details[0].Unpack(info) and info.reason == "QUOTA_EXCEEDED"


def test_retry_only_safe_refusals_before_any_event() -> None:
    policy = Retry(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.3)
    quota = VisorError(Reason.QUOTA_EXCEEDED, "rate", retry_after_s=0.5)
    for reason in RETRYABLE:
        assert policy.wait_s(VisorError(reason, ""), 0, 0, None) is not None
    for reason in set(Reason) - RETRYABLE:
        assert policy.wait_s(VisorError(reason, ""), 0, 0, None) is None
    assert policy.wait_s(VisorError(Reason.CORE_UNAVAILABLE, ""), 0, 1, None) is None  # a token
    assert policy.wait_s(quota, 2, 0, None) is None  # the third call was the last
    assert NO_RETRY.wait_s(quota, 0, 0, None) is None
    assert policy.wait_s(quota, 0, 0, time_left_s=0.4) is None  # the hint outlives the deadline


def test_waits_honour_the_hint_and_back_off_with_jitter_up_to_the_cap() -> None:
    policy = Retry(max_attempts=10, initial_backoff_s=0.1, max_backoff_s=0.3)
    hinted = VisorError(Reason.QUOTA_EXCEEDED, "rate", retry_after_s=2.0)  # above the cap: kept
    plain = VisorError(Reason.OVERLOADED, "queue")
    for _ in range(200):
        assert 2.0 <= (policy.wait_s(hinted, 0, 0, None) or 0) <= 2.4
        assert 0.05 <= (policy.wait_s(plain, 0, 0, None) or 0) <= 0.1
        assert 0.1 <= (policy.wait_s(plain, 1, 0, None) or 0) <= 0.2
        assert 0.15 <= (policy.wait_s(plain, 5, 0, None) or 0) <= 0.3
    waits = {policy.wait_s(plain, 3, 0, None) for _ in range(20)}
    assert len(waits) > 1  # jittered: clients refused together do not come back together
    with pytest.raises(ValueError):
        Retry(max_attempts=0)


def test_upload_stream_carries_every_item_in_the_gateways_index_order() -> None:
    first, second, third = b"a" * 10, b"b" * (request.UPLOAD_CHUNK_BYTES + 5), b"c"
    turns = [request.Turn("user", "earlier", (first,)), request.Turn("assistant", "ok")]
    req = request.build("now?", [second, third], turns=turns, detail="high", max_new_tokens=3)
    assert request.media_bytes(req) == len(first + second + third)
    head, *chunks = request.upload(req)
    assert head.WhichOneof("kind") == "request"
    assert head.request.params.max_new_tokens == 3 and head.request.prompt == "now?"
    assert [m.data for t in head.request.turns for m in t.media] == [b""]
    assert [m.data for m in head.request.media] == [b"", b""]
    joined: dict[int, bytes] = {}
    for c in chunks:
        assert len(c.chunk.data) <= request.UPLOAD_CHUNK_BYTES
        joined[c.chunk.media_index] = joined.get(c.chunk.media_index, b"") + c.chunk.data
    assert joined == {0: first, 1: second, 2: third}
    with pytest.raises(ValueError):
        request.build("x", detail="huge")
    with pytest.raises(ValueError):
        request.build("x", no_such_param=1)

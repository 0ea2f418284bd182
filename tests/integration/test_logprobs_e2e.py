"""Token logprobs through a real gateway and core: one entry per generated token across the
deltas, their texts spelling the answer, the alternatives as asked, and the ranges refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import grpc
import pytest

from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.conftest import Stack
from tests.helpers import DEV_KEY, generate, request


def _stream(
    target: str, req: gateway_pb2.GenerateRequest
) -> tuple[list[gateway_pb2.TokenDelta], gateway_pb2.Final]:
    deltas, final = [], None
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        metadata = [("authorization", f"Bearer {DEV_KEY}")]
        for event in stub.Generate(req, metadata=metadata, timeout=60):
            if event.WhichOneof("kind") == "delta":
                deltas.append(event.delta)
            else:
                final = event.final
    assert final is not None
    return deltas, final


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_logprob_per_generated_token(stack: Stack, temperature: float) -> None:
    req = request(
        "Describe it.",
        max_new_tokens=10,
        min_new_tokens=10,
        temperature=temperature,
        seed=11,
        logprobs=True,
        top_logprobs=5,
    )
    deltas, final = _stream(stack.gateway, req)
    entries = [lp for d in deltas for lp in d.logprobs]
    assert [len(d.logprobs) for d in deltas] == [d.num_tokens for d in deltas]
    assert len(entries) == final.usage.output_tokens == 10
    assert "".join(e.token for e in entries) == final.text == "".join(d.text for d in deltas)
    for e in entries:
        values = [t.logprob for t in e.top]
        assert len(e.top) == 5 and values == sorted(values, reverse=True)
        assert math.isfinite(e.logprob) and e.logprob <= 0 and all(v <= 0 for v in values)
        if temperature == 0.0 and e.top[0].token != "</s>":  # min_new_tokens masks EOS only
            assert (e.top[0].token, e.top[0].logprob) == (e.token, e.logprob)


def test_entries_travel_with_held_back_text(stack: Stack) -> None:
    """A stop string that never matches holds text back; every step's entry still arrives with
    that step's delta, and the answer is the same as without logprobs."""
    args = {"max_new_tokens": 8, "min_new_tokens": 8, "stop": [" red red red red red red red X"]}
    deltas, final = _stream(stack.gateway, request("Describe it.", logprobs=True, **args))
    plain = generate(stack.gateway, request("Describe it.", **args))
    assert plain.final is not None and final.text == plain.final.text
    assert sum(d.num_tokens for d in deltas) == 8 and all(
        len(d.logprobs) == d.num_tokens for d in deltas
    )
    assert any(d.num_tokens and not d.text for d in deltas), "nothing was held back"
    assert "".join(lp.token for d in deltas for lp in d.logprobs) == final.text
    assert all(not lp.top for d in deltas for lp in d.logprobs)  # top_logprobs 0: none


def test_no_logprobs_unless_asked(stack: Stack) -> None:
    deltas, final = _stream(stack.gateway, request("Describe it.", min_new_tokens=4))
    assert final.usage.output_tokens >= 4 and not any(d.logprobs for d in deltas)


@pytest.mark.parametrize(
    ("params", "limit"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ],
)
def test_gateway_refuses_bad_logprob_values(
    stack: Stack, params: dict[str, object], limit: str
) -> None:
    out = generate(stack.gateway, request("hi", **params))
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    assert limit in out.message


def test_visor_ask_json_reports_logprobs(stack: Stack) -> None:
    args = ["--prompt", "Describe it.", "--max-new-tokens", "5", "--json", "--logprobs", "2"]
    cli = [sys.executable, "-m", "visor.cli", "ask", "--target", stack.gateway, *args]
    answer = json.loads(subprocess.run(cli, capture_output=True, check=True, text=True).stdout)
    entries = answer["logprobs"]
    assert "".join(e["token"] for e in entries) == answer["text"]
    assert 1 <= len(entries) <= 5 and all(len(e["top"]) == 2 for e in entries)
    plain = subprocess.run(cli[:-2], capture_output=True, check=True, text=True).stdout
    assert "logprobs" not in json.loads(plain)

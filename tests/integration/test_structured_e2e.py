"""Structured output through a real gateway and core on the demo model: every answer to a JSON
schema, a regex or a Lark grammar parses and validates (greedy and sampled with several seeds),
and a format that does not compile is refused before any media is decoded, sent or encoded."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import grpc
import jsonschema
import numpy as np
import pytest
from PIL import Image

from shared.proto import gateway_pb2
from tests.conftest import Stack
from tests.helpers import generate, metric, request

SCHEMAS: dict[str, dict[str, Any]] = {
    "record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": 0, "maximum": 1000},
            "colour": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "count", "colour"],
        "additionalProperties": False,
    },
    # multipleOf bounds the fraction: a JSON number may have any number of digits, and the
    # demo model's weights are random (greedy, it writes 7.7555... until max_new_tokens).
    "numbers": {
        "type": "array",
        "items": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.25},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "shape": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["circle", "square"]},
                    "size": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["kind", "size"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["shape", "ok"],
        "additionalProperties": False,
    },
}
REGEX = r"(yes|no), [0-9]{1,3} (apples|pears)"
# A Lark grammar and the same language as a Python regex, to check the answers by hand.
LARK = (
    'start: "(" item ("," item)* ")"\nitem: WORD | NUMBER\nWORD: /[a-z]{1,6}/\nNUMBER: /[0-9]{1,3}/'
)
LARK_CHECK = r"\((?:[a-z]{1,6}|[0-9]{1,3})(?:,(?:[a-z]{1,6}|[0-9]{1,3}))*\)"
# Greedy, and sampled at temperature 1 with several seeds.
RUNS = [{"temperature": 0.0}] + [{"temperature": 1.0, "seed": s} for s in (1, 2, 3, 4)]


def _answer(stack: Stack, fmt: gateway_pb2.ResponseFormat, **params: object) -> str:
    req = request("Describe the picture as asked.", max_new_tokens=200, **params)
    req.params.response_format.CopyFrom(fmt)
    out = generate(stack.gateway, req)
    assert out.final is not None, (out.code, out.reason, out.message)
    # The format was complete before max_new_tokens: the answer is whole.
    assert out.final.finish_reason == "stop"
    assert "".join(out.deltas) == out.final.text
    return out.final.text


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_answer_validates_against_its_schema(stack: Stack, name: str) -> None:
    schema = SCHEMAS[name]
    fmt = gateway_pb2.ResponseFormat(json_schema=json.dumps(schema))
    for run in RUNS:
        text = _answer(stack, fmt, **run)
        jsonschema.validate(json.loads(text), schema)


def test_every_answer_matches_the_regex(stack: Stack) -> None:
    fmt = gateway_pb2.ResponseFormat(regex=REGEX)
    for run in RUNS:
        assert re.fullmatch(REGEX, _answer(stack, fmt, **run))


def test_every_answer_derives_from_the_lark_grammar(stack: Stack) -> None:
    fmt = gateway_pb2.ResponseFormat(grammar=LARK)
    for run in RUNS:
        assert re.fullmatch(LARK_CHECK, _answer(stack, fmt, **run))


def _unique_png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("fmt", "kind"),
    [
        (gateway_pb2.ResponseFormat(json_schema='{"$ref": "#/definitions/secret"}'), "json_schema"),
        (gateway_pb2.ResponseFormat(json_schema="{secret"), "json_schema"),
        (gateway_pb2.ResponseFormat(regex="(secret"), "regex"),
        (gateway_pb2.ResponseFormat(grammar="start: secret"), "grammar"),
    ],
)
def test_a_format_that_does_not_compile_is_refused_before_compute(
    stack: Stack, fmt: gateway_pb2.ResponseFormat, kind: str
) -> None:
    """A fresh image would be a cache miss: decoded, sent and encoded. The refusal comes at the
    core's header, so no tensor byte arrives and no token is generated."""
    tensors = metric(stack.core_metrics, "visor_core_tensor_bytes_total")
    tokens = metric(stack.core_metrics, "visor_core_generated_tokens_total")
    req = request("What is it?", media=(_unique_png(len(str(fmt)) * 31 + len(kind)),))
    req.params.response_format.CopyFrom(fmt)
    out = generate(stack.gateway, req)
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    assert f"response_format.{kind}" in out.message and "secret" not in out.message
    assert metric(stack.core_metrics, "visor_core_tensor_bytes_total") == tensors
    assert metric(stack.core_metrics, "visor_core_generated_tokens_total") == tokens


def test_the_format_counts_against_max_prompt_bytes(stack: Stack) -> None:
    req = request("hi")
    req.params.response_format.regex = "a" * (16 * 1024)
    out = generate(stack.gateway, req)
    assert (out.code, out.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "PROMPT_TOO_LONG")

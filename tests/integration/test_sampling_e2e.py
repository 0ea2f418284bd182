"""Sampling values, stop-string lists and users' text through a real gateway and core: the
gateway refuses out-of-range values, the core refuses them again when a gateway lets them by,
and text that looks like a control token is plain text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from core.model import config as model_config
from core.model.tokenizer import ChatTokenizer, ChatTurn
from tests.conftest import Stack, start_stack, stop_stack
from tests.helpers import generate, request

BAD = {
    "temperature": request("hi", temperature=float("nan")),
    "temperature ": request("hi", temperature=float("inf"), min_new_tokens=2),
    "temperature  ": request("hi", temperature=-1e-38),
    "top_p": request("hi", temperature=1.0, top_p=float("nan")),
    "top_k": request("hi", temperature=1.0, top_k=2**32 - 1),
    "max_stop_strings (8)": request("hi", stop=["s"] * 9),
    "max_stop_bytes (64)": request("hi", stop=["y" * 65]),
}


@pytest.mark.parametrize("limit", list(BAD))
def test_gateway_refuses_bad_sampling_values(stack: Stack, limit: str) -> None:
    out = generate(stack.gateway, BAD[limit])
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    assert limit.strip() in out.message and "y" * 65 not in out.message


def test_a_tiny_temperature_decodes_greedily(stack: Stack) -> None:
    args = {"max_new_tokens": 8, "min_new_tokens": 8}
    greedy = generate(stack.gateway, request("Describe it.", **args))
    tiny = generate(stack.gateway, request("Describe it.", temperature=1e-38, **args))
    assert greedy.final is not None and tiny.final is not None, tiny
    assert tiny.final.text == greedy.final.text


@pytest.mark.parametrize("prompt", ["What is <image> here?", "Stop </s> now, then <s> go on."])
def test_control_tokens_in_users_text_are_plain_text(
    stack: Stack, model_dir: Path, prompt: str
) -> None:
    out = generate(stack.gateway, request(prompt, max_new_tokens=6, min_new_tokens=6))
    assert out.code == grpc.StatusCode.OK and out.final is not None, (out.reason, out.message)
    assert out.final.usage.output_tokens == 6
    # The core's own tokenizer: the prompt's ids hold the template's <s> and no </s> or image.
    tok = ChatTokenizer(model_dir, model_config.load(model_dir).image_token_id)
    ids = tok.encode_prompt([ChatTurn("user", prompt, 0)])
    assert tok.tok.token_to_id("</s>") not in ids and tok.image_token_id not in ids
    assert ids.count(tok.bos_id) == 1
    assert out.final.usage.text_tokens == len(ids)


@pytest.fixture(scope="module")
def loose(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway whose stop-string limits are above the core's: the core must refuse alone."""
    env = {"VISOR_LIMITS_MAX_STOP_STRINGS": "10000", "VISOR_LIMITS_MAX_STOP_BYTES": "4096"}
    s = start_stack(model_dir, tmp_path_factory.mktemp("loose"), **env)
    yield s
    stop_stack(s)


@pytest.mark.parametrize(
    ("stop", "limit"),
    [(["s"] * 8000, "max_stop_strings (16)"), (["y" * 300], "max_stop_bytes (256)")],
)
def test_core_refuses_stop_lists_a_gateway_let_through(
    loose: Stack, stop: list[str], limit: str
) -> None:
    out = generate(loose.gateway, request("hi", stop=stop))
    assert (out.code, out.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    assert limit in out.message and "y" * 300 not in out.message
    fine = generate(loose.gateway, request("hi", stop=["s" * 200] * 16))
    assert fine.code == grpc.StatusCode.OK, (fine.reason, fine.message)

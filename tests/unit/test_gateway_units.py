"""Pure gateway pieces: sniffing, request limits, auth, redaction."""

from __future__ import annotations

import hashlib
import hmac
import io
import json

import pytest
import structlog
from PIL import Image

from gateway.auth import authenticate
from gateway.config import GatewayConfig, LimitsConfig
from gateway.limits import check_request
from gateway.sniff import sniff
from gateway.tenants import tenants_from
from gateway.types import Ask, Params, Turn
from shared import logs, secret
from shared.config import ConfigError
from shared.errors import Reason, VisorError
from shared.hashing import key_sha256


def _encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF"])
def test_sniff_allows_by_magic_bytes(fmt: str) -> None:
    assert sniff(_encoded(fmt)) == fmt


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO", "PPM"])
def test_sniff_refuses_everything_else(fmt: str) -> None:
    with pytest.raises(VisorError) as info:
        sniff(_encoded(fmt))
    assert info.value.reason is Reason.UNSUPPORTED_FORMAT


def _ask(text: str = "hi", media: tuple[bytes, ...] = (), **params: object) -> Ask:
    return Ask((Turn("user", text, media),), Params(**params), "", "auto")  # type: ignore[arg-type]


def test_limits() -> None:
    lim = LimitsConfig(
        max_items=2,
        max_item_bytes=10,
        max_request_bytes=15,
        max_prompt_bytes=5,
        max_new_tokens=8,
        default_new_tokens=4,
    )
    assert check_request(lim, _ask()) == 4
    assert check_request(lim, _ask(temperature=1e-38, top_k=1000, top_p=0.0)) == 4
    assert check_request(lim, _ask(max_new_tokens=8)) == 8
    cases = [
        (_ask(media=(b"x",) * 3), Reason.IMAGE_COUNT_LIMIT),
        (_ask(media=(b"x" * 11,)), Reason.MEDIA_TOO_LARGE),
        (_ask(media=(b"x" * 8, b"x" * 8)), Reason.MEDIA_TOO_LARGE),
        (_ask("toolong"), Reason.PROMPT_TOO_LONG),
        (_ask(max_new_tokens=9), Reason.TOKEN_BUDGET),
        (_ask(""), Reason.INVALID_REQUEST),
        (_ask(temperature=-1.0), Reason.INVALID_REQUEST),
        (_ask(temperature=float("nan")), Reason.INVALID_REQUEST),
        (_ask(temperature=float("inf"), min_new_tokens=2), Reason.INVALID_REQUEST),
        (_ask(temperature=101.0), Reason.INVALID_REQUEST),
        (_ask(top_p=float("nan")), Reason.INVALID_REQUEST),
        (_ask(top_k=1001), Reason.INVALID_REQUEST),
        (_ask(min_new_tokens=5), Reason.INVALID_REQUEST),
    ]
    for ask, reason in cases:
        with pytest.raises(VisorError) as info:
            check_request(lim, ask)
        assert info.value.reason is reason
        assert "toolong" not in info.value.message


def test_stop_string_limits() -> None:
    lim = LimitsConfig(max_stop_strings=8, max_stop_bytes=64)
    assert check_request(lim, _ask(stop=("b" * 64,) * 8)) == lim.default_new_tokens
    for stop, limit in [(("a",) * 9, "max_stop_strings (8)"), (("é" * 33,), "max_stop_bytes (64)")]:
        with pytest.raises(VisorError) as info:
            check_request(lim, _ask(stop=stop))  # 33 x "é" is 66 UTF-8 bytes
        assert info.value.reason is Reason.INVALID_REQUEST and limit in info.value.message
        assert "é" not in info.value.message


def test_auth_dev_key_only_on_loopback() -> None:
    lim, public = LimitsConfig(), GatewayConfig(listen="0.0.0.0:50051")
    dev = tenants_from({}, GatewayConfig(), lim)
    assert authenticate(dev, [("authorization", "Bearer visor-dev-key")]).id == "dev"
    with pytest.raises(ConfigError, match="tenants"):
        tenants_from({}, public, lim)
    acme = {"tenants": [{"id": "acme", "key_sha256": key_sha256("s3cret")}]}
    auth = tenants_from(acme, public, lim)
    assert authenticate(auth, [("authorization", "Bearer s3cret")]).id == "acme"
    for metadata in (
        [],
        [("authorization", "Bearer visor-dev-key")],
        [("authorization", "s3cret")],
    ):
        with pytest.raises(VisorError) as info:
            authenticate(auth, metadata)
        assert info.value.reason is Reason.UNAUTHENTICATED


def test_redaction_is_an_allow_list(capsys: pytest.CaptureFixture[str]) -> None:
    structlog.reset_defaults()
    logs.configure("test")
    logs.get("t").info(
        "request_done",
        prompt="the secret question",
        tenant="acme",
        exif={"GPS": "51N"},
        data=b"\x89PNG",
        authorization="Bearer k",
        timings_ms={"encode": 1.5},
        reason="a\nb",
    )
    line = capsys.readouterr().err.strip()
    record = json.loads(line)
    assert (
        "secret" not in line and "acme" not in line and "GPS" not in line and "Bearer" not in line
    )
    assert record["prompt_len"] == len("the secret question")
    assert record["tenant_hash"] == logs.tenant_hash("acme") != logs.short_hash("acme")
    assert record["timings_ms"] == {"encode": 1.5}
    assert record["reason"] == "a\\nb"
    assert record["redacted"] == ["authorization", "data", "exif"]
    structlog.reset_defaults()


def test_tenant_hashes_are_keyed_by_the_deployment_secret(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before configure() gets the log key, a random per-process key (never a bare SHA-256, which
    anyone could recompute from a guessed name); after, HMAC-SHA256 under the deployment's key,
    the same in every service that loaded that secret."""
    structlog.reset_defaults()
    unsalted = hashlib.sha256(b"acme").hexdigest()[:16]
    assert logs.tenant_hash("acme") != unsalted
    keys = secret.derive(b"k" * 32)
    logs.configure("test", log_key=keys.log_key)
    logs.get("t").info("request_done", tenant="acme")
    record = json.loads(capsys.readouterr().err.strip())
    expected = hmac.new(keys.log_key, b"acme", hashlib.sha256).hexdigest()[:16]
    assert record["tenant_hash"] == expected != unsalted
    assert secret.derive(b"j" * 32).log_key != keys.log_key
    structlog.reset_defaults()

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import CoreConfig
from gateway.config import GatewayConfig, LimitsConfig
from gateway.tenants import ConfigFile, tenants_from
from shared.config import ConfigError, build, read_file


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "visor.toml"
    path.write_text(text)
    return path


def test_defaults_are_loopback_and_tight() -> None:
    gw = build(GatewayConfig, "gateway", {}, {})
    core = build(CoreConfig, "core", {}, {})
    assert gw.listen == "127.0.0.1:50051" and core.listen == "127.0.0.1:50052"
    assert gw.cores == ("127.0.0.1:50052",)
    assert build(LimitsConfig, "limits", {}, {}).max_items == 8


def test_file_then_environment_override(tmp_path: Path) -> None:
    data = read_file(_write(tmp_path, '[gateway]\nlisten = "127.0.0.1:6000"\ndecode_workers = 3\n'))
    env = {"VISOR_GATEWAY_DECODE_WORKERS": "4", "VISOR_GATEWAY_CORES": "127.0.0.1:1,127.0.0.1:2"}
    cfg = build(GatewayConfig, "gateway", data, env)
    assert cfg.listen == "127.0.0.1:6000"
    assert cfg.decode_workers == 4
    assert cfg.cores == ("127.0.0.1:1", "127.0.0.1:2")


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ('[gatway]\nlisten = "x"\n', {}, "unknown config section"),
        ('[gateway]\nlisten_addr = "127.0.0.1:1"\n', {}, "unknown key"),
        ("[gateway]\ndecode_workers = 'two'\n", {}, "must be of type int"),
        ("", {"VISOR_GATEWAY_LISTN": "127.0.0.1:1"}, "names no key"),
        ("", {"VISOR_GATEWAY_DECODE_WORKERS": "many"}, "must be of type int"),
        ("[gateway]\ndecode_workers = 0\n", {}, "decode_workers"),
        ('[gateway]\nlisten = "nowhere"\n', {}, "host:port"),
        ("[gateway\n", {}, "not valid TOML"),
    ],
)
def test_bad_config_is_an_error_at_start(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build(GatewayConfig, "gateway", read_file(_write(tmp_path, text)), env)


def test_tenants_are_checked(tmp_path: Path) -> None:
    good = "a" * 64
    data = read_file(_write(tmp_path, f'[[tenants]]\nid = "acme"\nkey_sha256 = "{good}"\n'))
    assert tenants_from(data, GatewayConfig(), LimitsConfig()).tenants[0].id == "acme"
    for bad in (
        '[[tenants]]\nid = "a"\nkey_sha256 = "short"\n',
        f'[[tenants]]\nid = "a"\nkey_sha256 = "{good}"\nrole = "x"\n',
    ):
        with pytest.raises(ConfigError):
            tenants_from(read_file(_write(tmp_path, bad)), GatewayConfig(), LimitsConfig())


def test_core_refuses_a_public_plaintext_listen() -> None:
    with pytest.raises(ConfigError, match="plaintext is allowed only on loopback"):
        build(CoreConfig, "core", {}, {"VISOR_CORE_LISTEN": "0.0.0.0:50052"})


def test_core_listens_publicly_only_with_mtls() -> None:
    tls = {"VISOR_CORE_TLS_CERT": "c.crt", "VISOR_CORE_TLS_KEY": "c.key"}
    with pytest.raises(ConfigError, match="all three TLS files"):
        build(CoreConfig, "core", {}, {**tls, "VISOR_CORE_LISTEN": "0.0.0.0:50052"})
    tls["VISOR_CORE_TLS_CLIENT_CA"] = "ca.crt"
    cfg = build(CoreConfig, "core", {}, {**tls, "VISOR_CORE_LISTEN": "0.0.0.0:50052"})
    assert cfg.tls().enabled


def test_example_config_holds_every_key_with_its_default() -> None:
    from core.config import CacheConfig, SchedulerConfig
    from shared.config import LogConfig
    from shared.secret import DeploymentConfig

    path = Path(__file__).resolve().parents[2] / "deploy" / "visor.example.toml"
    data = read_file(path)
    for cls, name in (
        (GatewayConfig, "gateway"),
        (LimitsConfig, "limits"),
        (CoreConfig, "core"),
        (CacheConfig, "cache"),
        (SchedulerConfig, "scheduler"),
        (LogConfig, "log"),
        (DeploymentConfig, "deployment"),
    ):
        assert build(cls, name, data, {}) == cls(), name  # type: ignore[call-arg]
        assert set(data[name]) == {f for f in cls.__dataclass_fields__}, name


@pytest.mark.parametrize(
    "key",
    [
        "max_requests_in_flight",
        "upload_idle_timeout_s",
        "max_upload_bytes_in_flight",
        "core_attempt_timeout_s",
        "core_hedge_after_s",
    ],
)
def test_admission_keys_must_be_positive(key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build(GatewayConfig, "gateway", {}, {f"VISOR_GATEWAY_{key.upper()}": "0"})


def test_upload_bytes_in_flight_must_hold_one_whole_request() -> None:
    """Checked across sections when the gateway starts, before any worker or socket."""
    import asyncio

    from gateway import server

    cfg = build(GatewayConfig, "gateway", {}, {"VISOR_GATEWAY_MAX_UPLOAD_BYTES_IN_FLIGHT": "1024"})
    with pytest.raises(ConfigError, match="max_upload_bytes_in_flight"):
        asyncio.run(server.run(cfg, LimitsConfig(), ConfigFile(None, {}), core_token="unused"))

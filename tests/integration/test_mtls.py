"""mTLS between gateway and core on loopback: a core with client auth serves the gateway's
certificate and refuses a client with no certificate, with one from another CA, or in plaintext."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from shared import procs
from shared.certs import DevCerts, write_dev_certs
from shared.proto import core_pb2, core_pb2_grpc
from shared.tls import TlsFiles, channel_credentials
from tests.conftest import ROOT, SAMPLES, TENANTS_TOML, free_port
from tests.helpers import core_metadata, generate, request


@dataclass
class TlsCore:
    address: str
    pki: DevCerts  # the CA the core trusts, its cert, the gateway's cert
    other: DevCerts  # a second, unrelated CA and its certificates
    env: dict[str, str]
    logs: Path


@pytest.fixture(scope="module")
def tls_core(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCore]:
    d = tmp_path_factory.mktemp("mtls")
    pki, other = write_dev_certs(d / "pki"), write_dev_certs(d / "other")
    address = f"127.0.0.1:{free_port()}"
    env = {
        "VISOR_CORE_LISTEN": address,
        "VISOR_CORE_MODEL": str(model_dir),
        "VISOR_CORE_METRICS_LISTEN": "",
        "VISOR_CORE_ENCODER": "torch",
        "VISOR_CACHE_PATH": str(d / "cache"),
        "VISOR_DEPLOYMENT_SECRET_FILE": str(d / "deployment.secret"),
        "VISOR_CORE_TLS_CERT": str(pki.core_cert),
        "VISOR_CORE_TLS_KEY": str(pki.core_key),
        "VISOR_CORE_TLS_CLIENT_CA": str(pki.ca_cert),
    }
    proc = procs.start("core", env, log_path=d / "core.log")
    try:
        creds = _creds(pki.ca_cert, pki.gateway_cert, pki.gateway_key)
        procs.wait_healthy(address, proc, timeout_s=120, credentials=creds)
        yield TlsCore(address, pki, other, env, d)
    finally:
        procs.stop(proc)


def _creds(ca: Path, cert: Path | None, key: Path | None) -> grpc.ChannelCredentials:
    if cert is None or key is None:
        return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    return channel_credentials(TlsFiles(str(ca), str(cert), str(key)))


def _describe(
    tls_core: TlsCore, creds: grpc.ChannelCredentials | None, token: bool = True
) -> grpc.StatusCode:
    address = tls_core.address
    channel = (
        grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
    )
    metadata = core_metadata(tls_core.env) if token else ()
    with channel:
        stub = core_pb2_grpc.CoreStub(channel)  # type: ignore[no-untyped-call]
        try:
            info = stub.Describe(core_pb2.DescribeRequest(), metadata=metadata, timeout=5)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    assert info.image_size > 0
    return grpc.StatusCode.OK


def test_gateway_certificate_is_accepted(tls_core: TlsCore) -> None:
    p = tls_core.pki
    assert _describe(tls_core, _creds(p.ca_cert, p.gateway_cert, p.gateway_key)) == (
        grpc.StatusCode.OK
    )


def test_a_valid_certificate_without_the_core_token_is_refused(tls_core: TlsCore) -> None:
    """Defence in depth: mTLS proves the caller holds a certificate of the CA, the token that it
    belongs to this deployment; the core wants both."""
    p = tls_core.pki
    assert _describe(tls_core, _creds(p.ca_cert, p.gateway_cert, p.gateway_key), False) == (
        grpc.StatusCode.UNAUTHENTICATED
    )


def test_client_without_certificate_is_refused(tls_core: TlsCore) -> None:
    p = tls_core.pki
    assert _describe(tls_core, _creds(p.ca_cert, None, None)) == (grpc.StatusCode.UNAVAILABLE)


def test_certificate_from_another_ca_is_refused(tls_core: TlsCore) -> None:
    p, o = tls_core.pki, tls_core.other
    # Trusts the real server, but presents a client certificate the core's CA never signed.
    assert _describe(tls_core, _creds(p.ca_cert, o.gateway_cert, o.gateway_key)) == (
        grpc.StatusCode.UNAVAILABLE
    )


def test_plaintext_client_is_refused(tls_core: TlsCore) -> None:
    assert _describe(tls_core, None) == grpc.StatusCode.UNAVAILABLE


def test_health_command_over_mtls(tls_core: TlsCore) -> None:
    p = tls_core.pki
    base = [sys.executable, "-m", "visor.cli", "health", "--target", tls_core.address]
    base += ["--service", "visor.v1.Core", "--ca", str(p.ca_cert)]
    # The core's own certificate carries clientAuth: the pod's probe dials itself with it.
    ok = [*base, "--cert", str(p.core_cert), "--key", str(p.core_key)]
    out = subprocess.run(ok, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr
    o = tls_core.other
    bad = [*base, "--cert", str(o.gateway_cert), "--key", str(o.gateway_key)]
    out = subprocess.run(bad, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 1 and "UNREACHABLE" in out.stdout


def _probe_command(tls_core: TlsCore) -> list[str]:
    """The core's exec probe exactly as deploy/k8s/base/core.yaml has it, pointed at this core
    (port and certificate paths swapped for the test's, `visor` run from this checkout)."""
    docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / "core.yaml").read_text())
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    command = container["readinessProbe"]["exec"]["command"]
    assert container["livenessProbe"]["exec"]["command"] == command
    p = tls_core.pki
    swap = {
        "/etc/visor/tls/ca.crt": str(p.ca_cert),
        "/etc/visor/tls/tls.crt": str(p.core_cert),
        "/etc/visor/tls/tls.key": str(p.core_key),
        "localhost:50052": "localhost:" + tls_core.address.rsplit(":", 1)[1],
    }
    assert command[0] == "visor" and set(swap) <= set(command)
    return [sys.executable, "-m", "visor.cli", *(swap.get(a, a) for a in command[1:])]


def test_the_manifests_probe_passes_against_a_tls_core(tls_core: TlsCore) -> None:
    """The pod dials itself by name (localhost is in the core certificate) with its own cert."""
    out = subprocess.run(
        _probe_command(tls_core), capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr


def _gateway_env(tls_core: TlsCore, ca: Path) -> dict[str, str]:
    p = tls_core.pki
    return {
        "VISOR_GATEWAY_LISTEN": f"127.0.0.1:{free_port()}",
        "VISOR_GATEWAY_CORES": tls_core.address,
        "VISOR_GATEWAY_METRICS_LISTEN": "",
        "VISOR_GATEWAY_DECODE_WORKERS": "1",
        "VISOR_GATEWAY_CORE_TLS_CA": str(ca),
        "VISOR_GATEWAY_CORE_TLS_CERT": str(p.gateway_cert),
        "VISOR_GATEWAY_CORE_TLS_KEY": str(p.gateway_key),
        "VISOR_DEPLOYMENT_SECRET_FILE": tls_core.env["VISOR_DEPLOYMENT_SECRET_FILE"],
    }


@pytest.mark.parametrize("trusted", [True, False], ids=["right-ca", "wrong-ca"])
def test_gateway_serves_through_mtls(tls_core: TlsCore, trusted: bool) -> None:
    """With the right CA the whole request path works; a gateway that does not trust the core's
    certificate never talks to it (CORE_UNAVAILABLE, not a plaintext fallback)."""
    ca = tls_core.pki.ca_cert if trusted else tls_core.other.ca_cert
    env = _gateway_env(tls_core, ca)
    config = tls_core.logs / "tenants.toml"
    config.write_text(TENANTS_TOML)
    gw = procs.start("gateway", env, config, log_path=tls_core.logs / f"gateway-{trusted}.log")
    try:
        procs.wait_healthy(env["VISOR_GATEWAY_LISTEN"], gw, timeout_s=60)
        png = (SAMPLES / "shapes.png").read_bytes()
        out = generate(env["VISOR_GATEWAY_LISTEN"], request(media=(png,), max_new_tokens=2))
        if trusted:
            assert out.code == grpc.StatusCode.OK, (out.code, out.reason)
            assert out.final is not None and out.final.served_by
        else:
            assert (out.code, out.reason) == (grpc.StatusCode.UNAVAILABLE, "CORE_UNAVAILABLE")
    finally:
        procs.stop(gw)


def test_plaintext_core_off_loopback_refuses_to_start() -> None:
    env = {"VISOR_CORE_LISTEN": "0.0.0.0:1", "VISOR_CORE_METRICS_LISTEN": ""}
    cmd = [sys.executable, "-m", "visor.cli", "core"]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "plaintext is allowed only on loopback" in out.stderr

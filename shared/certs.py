"""Development certificates for mTLS between gateways and cores (`visor certs dev`).

Makes one CA, a core server certificate and a gateway client certificate with `cryptography`.
Production certificates come from the operator's PKI (cert-manager, Vault, ...); this exists so
that a developer or a test can run the whole authenticated path in seconds.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Names every core certificate carries, so a probe inside the pod can dial itself on loopback.
LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")

KeyPair = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


@dataclass(frozen=True, slots=True)
class DevCerts:
    """Where `write_dev_certs` put each PEM file."""

    ca_cert: Path  # ca.crt: the development CA (trust anchor for both sides)
    core_cert: Path  # core.crt: server cert (serverAuth; clientAuth for the pod's own probe)
    core_key: Path  # core.key
    gateway_cert: Path  # gateway.crt: client cert (clientAuth)
    gateway_key: Path  # gateway.key


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "visor development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def make_ca(common_name: str, days: int) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    builder = _builder(name, name, key.public_key(), days)
    cert = (
        builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue(
    ca: KeyPair,
    common_name: str,
    dns_names: Sequence[str],
    ips: Sequence[str],
    server: bool,
    client: bool,
    days: int,
) -> KeyPair:
    """Issues a leaf certificate signed by `ca` with the given SANs and extended key usages."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    builder = _builder(_name(common_name), ca_cert.subject, key.public_key(), days)
    builder = builder.add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True
    ).add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = builder.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
    )
    return builder.sign(ca_key, hashes.SHA256()), key


def _write(path: Path, data: bytes, secret: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Keys are created 0600 from the start; never world-readable, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> bytes:
    if key is None:
        return cert.public_bytes(serialization.Encoding.PEM)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_dev_certs(out: Path, dns_names: Sequence[str] = (), days: int = 30) -> DevCerts:
    """Writes ca.crt, core.crt/.key and gateway.crt/.key into `out`.

    The core certificate names localhost, 127.0.0.1, ::1 and every name in `dns_names` (e.g. the
    headless Service `visor-core.visor.svc.cluster.local` and `*.visor-core.visor.svc...`).
    """
    ca = make_ca("visor development CA", days)
    core = issue(
        ca,
        "visor-core",
        [*LOOPBACK_NAMES, *dns_names],
        LOOPBACK_IPS,
        server=True,
        client=True,
        days=days,
    )
    gateway = issue(ca, "visor-gateway", [], [], server=False, client=True, days=days)
    return DevCerts(
        _write(out / "ca.crt", _pem(ca[0]), secret=False),
        _write(out / "core.crt", _pem(core[0]), secret=False),
        _write(out / "core.key", _pem(*core), secret=True),
        _write(out / "gateway.crt", _pem(gateway[0]), secret=False),
        _write(out / "gateway.key", _pem(*gateway), secret=True),
    )

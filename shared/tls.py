"""mTLS credentials for the gateway <-> core link: PEM files in, gRPC credentials out.

The core requires a client certificate signed by its client CA whenever TLS is on; the gateway
presents its client certificate and verifies the core's against its CA. Files are read once at
start (rotate by restarting the pod, which is what a Secret update does anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from shared.config import ConfigError


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Three PEM paths; all empty means plaintext (allowed on loopback only)."""

    ca: str = ""  # CA that signed the peer's certificate
    cert: str = ""  # our certificate chain
    key: str = ""  # our private key

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert or self.key)

    def check(self, where: str) -> None:
        """All three or none: half a TLS set-up is a typo, never a silent plaintext fallback."""
        if self.enabled and not (self.ca and self.cert and self.key):
            raise ConfigError(f"{where}: set all three TLS files (CA, certificate, key) or none")

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for path in (self.ca, self.cert, self.key):
            try:
                out.append(Path(path).expanduser().read_bytes())
            except OSError as exc:
                raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from None
        return out[0], out[1], out[2]


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server side: our cert + key; a client certificate signed by `files.ca` is required."""
    ca, cert, key = files.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client side: verify the server against `files.ca`, present our cert + key."""
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )

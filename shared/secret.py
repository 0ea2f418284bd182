"""The deployment secret: 32 random bytes in one file, shared by every gateway and core of a
deployment (a Kubernetes Secret mounted into both; on one host, created by whichever service
starts first). From it, with HMAC-SHA256 under distinct labels: the token a core requires from
its callers on every Core RPC, and the key the logs hash tenant ids with (so a gateway's and a
core's hashes of one tenant agree, and nobody without the secret can test a guessed name).

The file is refused when anyone but its owner could read it, with one exception: a root-owned
file readable by one of our own groups and nobody else, which is how the kubelet mounts a Secret
into a pod with an fsGroup (root:fsGroup, 0440) and the only way a non-root pod can read one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from shared.config import ConfigError

SECRET_BYTES = 32
# gRPC metadata key a gateway sends the core token under.
CORE_TOKEN_METADATA = "visor-core-token"
_CORE_TOKEN_LABEL = b"visor core-auth v1"
_LOG_KEY_LABEL = b"visor log-hash v1"


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    # 32 random bytes (raw, or 64 hex digits) shared by gateways and cores; created 0600 if absent
    secret_file: str = "~/.cache/visor/deployment.secret"

    def validate(self) -> None:
        if not self.secret_file:
            raise ConfigError("[deployment] secret_file must not be empty")


@dataclass(frozen=True, slots=True)
class DeploymentKeys:
    """What the services derive from the secret; the secret itself is not kept."""

    core_token: str  # hex; a gateway sends it, a core requires it, on every Core RPC
    log_key: bytes  # HMAC key of the tenant hashes in logs

    def core_metadata(self) -> tuple[tuple[str, str]]:
        """The metadata a caller of the Core API sends."""
        return ((CORE_TOKEN_METADATA, self.core_token),)


def derive(secret: bytes) -> DeploymentKeys:
    token = hmac.new(secret, _CORE_TOKEN_LABEL, hashlib.sha256).hexdigest()
    return DeploymentKeys(token, hmac.new(secret, _LOG_KEY_LABEL, hashlib.sha256).digest())


def load(cfg: DeploymentConfig) -> DeploymentKeys:
    """Reads the secret file, creating it first when it does not exist."""
    path = Path(cfg.secret_file).expanduser()
    if not path.exists():
        _create(path)
    return derive(_read(path))


def _create(path: Path) -> None:
    """Writes a fresh secret atomically: a private temporary file, complete before it is linked
    under the final name. link() fails when the name exists, so when two services start at once
    exactly one secret wins and the other service reads it, never a half-written file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(SECRET_BYTES))
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)
        except FileExistsError:
            pass  # another service created it first: use theirs
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create [deployment] secret_file {path}: {exc.strerror}"
        ) from None


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ConfigError(f"cannot read [deployment] secret_file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        # fstat of the open file: what is checked is what is read (symlinks, as in a Secret
        # mount, are followed).
        check_private(os.fstat(f.fileno()), path)
        raw = f.read(4 * SECRET_BYTES)
    if len(raw) == SECRET_BYTES:
        return raw
    text = raw.strip()
    if len(text) == 2 * SECRET_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except ValueError:
            pass
    raise ConfigError(
        f"[deployment] secret_file {path} must hold {SECRET_BYTES} bytes "
        f"(raw, or {2 * SECRET_BYTES} hex digits)"
    )


def check_private(st: os.stat_result, path: Path) -> None:
    """Refuses a secret file others could read or change (see the module docstring)."""
    mode = stat.S_IMODE(st.st_mode)
    kubelet_layout = (
        st.st_uid == 0
        and os.geteuid() != 0
        and st.st_gid in {os.getegid(), *os.getgroups()}
        and mode & 0o077 == 0o040
    )
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"[deployment] secret_file {path} is not a regular file")
    if mode & 0o077 and not kubelet_layout:
        raise ConfigError(
            f"[deployment] secret_file {path} is open to other users (mode {mode:04o}): "
            "chmod 600 it, or mount it from a Secret"
        )

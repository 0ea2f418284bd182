"""The deployment secret file (shared/secret.py): created 0600 with 32 random bytes by whichever
service starts first, read by the others; refused with one clear line when other users could
read it; accepted in the layout a Kubernetes Secret has under an fsGroup (root:group 0440)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shared import secret
from shared.config import ConfigError
from tests.conftest import ROOT, free_port

NOBODY = 65534


def _load(path: Path) -> secret.DeploymentKeys:
    return secret.load(secret.DeploymentConfig(str(path)))


def test_created_0600_with_32_random_bytes_then_read_back(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "deployment.secret"
    keys = _load(path)
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == secret.SECRET_BYTES
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert _load(path) == keys == secret.derive(path.read_bytes())
    assert keys.core_token != keys.log_key.hex()  # distinct labels, distinct keys
    assert list(tmp_path.glob("a/b/.*")) == []  # no temporary file left behind
    other = _load(tmp_path / "other.secret")
    assert other.core_token != keys.core_token and other.log_key != keys.log_key


def test_services_starting_together_agree_on_one_secret(tmp_path: Path) -> None:
    path = tmp_path / "deployment.secret"
    code = (
        "import sys; from shared import secret; "
        "print(secret.load(secret.DeploymentConfig(sys.argv[1])).core_token)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    tokens = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert tokens == {_load(path).core_token}


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602])
def test_a_file_open_to_other_users_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "deployment.secret"
    path.write_bytes(os.urandom(32))
    path.chmod(mode)
    with pytest.raises(ConfigError, match="open to other users"):
        _load(path)


def test_hex_form_is_accepted_and_other_sizes_refused(tmp_path: Path) -> None:
    raw = os.urandom(32)
    path = tmp_path / "hex.secret"
    path.write_text(raw.hex() + "\n")
    path.chmod(0o600)
    assert _load(path) == secret.derive(raw)
    for body in (os.urandom(16), os.urandom(33), b"z" * 64):
        path.write_bytes(body)
        with pytest.raises(ConfigError, match="must hold 32 bytes"):
            _load(path)


@pytest.mark.parametrize("service", ["core", "gateway"])
def test_a_service_refuses_to_start_with_one_line(tmp_path: Path, service: str) -> None:
    path = tmp_path / "deployment.secret"
    path.write_bytes(os.urandom(32))
    path.chmod(0o644)
    env = {
        **os.environ,
        "VISOR_DEPLOYMENT_SECRET_FILE": str(path),
        "VISOR_CORE_LISTEN": f"127.0.0.1:{free_port()}",
        "VISOR_CORE_METRICS_LISTEN": "",
        "VISOR_GATEWAY_LISTEN": f"127.0.0.1:{free_port()}",
        "VISOR_GATEWAY_METRICS_LISTEN": "",
    }
    cmd = [sys.executable, "-m", "visor.cli", service]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "open to other users (mode 0644)" in lines[0], out.stderr


def _load_as_nobody(path: Path) -> str:
    """secret.load in a child process running as nobody:nobody; what it got, or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, try, report, exit without cleanup
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = "ok:" + _load(path).core_token
        except ConfigError as exc:
            result = f"refused:{exc}"
        except BaseException as exc:
            result = f"crashed:{type(exc).__name__}"
        os.write(write, result.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        result = f.read().decode()
    os.waitpid(pid, 0)
    return result


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set up a root-owned file")
def test_the_kubelet_secret_layout_is_accepted_and_nothing_wider() -> None:
    folder = Path(tempfile.mkdtemp(prefix="visor-secret-"))
    try:
        folder.chmod(0o755)
        path = folder / "deployment.secret"
        path.write_bytes(os.urandom(32))
        os.chown(path, 0, NOBODY)
        path.chmod(0o440)  # what a Secret volume gets under fsGroup
        assert _load_as_nobody(path) == "ok:" + secret.derive(path.read_bytes()).core_token
        path.chmod(0o444)
        assert "open to other users" in _load_as_nobody(path)
        path.chmod(0o460)  # group may write: refused
        assert "open to other users" in _load_as_nobody(path)
        os.chown(path, 0, 0)
        path.chmod(0o440)  # a group we are not in: unreadable, one clear line
        assert _load_as_nobody(path).startswith("refused:cannot read [deployment] secret_file")
    finally:
        shutil.rmtree(folder)

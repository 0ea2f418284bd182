"""Shared fixtures: the demo model, free loopback ports, a running core + gateway, the corpus."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared import procs
from shared.hashing import key_sha256
from shared.net import free_port

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("VISOR_TEST_CORPUS", ROOT.parent / "shared" / "corpus"))
SAMPLES = ROOT / "models" / "samples"


def corpus_rows() -> list[dict[str, str]]:
    manifest = CORPUS / "MANIFEST.tsv"
    if not manifest.exists():
        return []
    with manifest.open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


def need_corpus() -> None:
    if not (CORPUS / "MANIFEST.tsv").exists():
        pytest.skip(f"media corpus not found at {CORPUS} (present in CI, absent in a user's clone)")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = ROOT / "models" / "demo"
    if (built / "config.json").exists():
        return built
    from core.model import demo

    return demo.build(tmp_path_factory.mktemp("model") / "demo")


@dataclass
class Stack:
    """A core and a gateway running as real processes on loopback."""

    gateway: str
    core: str
    core_metrics: str
    env: dict[str, str]
    logs: Path
    core_proc: subprocess.Popen[bytes]
    gateway_proc: subprocess.Popen[bytes]

    def restart_core(self) -> None:
        self.core_proc = procs.start(
            "core", self.env, self.logs / "visor.toml", log_path=self.logs / "core.log"
        )
        procs.wait_healthy(self.core, self.core_proc, timeout_s=120)


# Two tenants: the dev key (used by most tests) and a second one for isolation tests.
OTHER_KEY = "tenant-b-key"
TENANTS_TOML = f"""
[[tenants]]
id = "dev"
key_sha256 = "{key_sha256("visor-dev-key")}"

[[tenants]]
id = "tenant-b"
key_sha256 = "{key_sha256(OTHER_KEY)}"
"""


def start_stack(
    model: Path, logs: Path, tenants_toml: str = TENANTS_TOML, **gateway_env: str
) -> Stack:
    """`tenants_toml` is the config file both services read (logs/visor.toml)."""
    core, gw, metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
    config = logs / "visor.toml"
    config.write_text(tenants_toml)
    env = {
        "VISOR_CORE_LISTEN": core,
        "VISOR_CORE_MODEL": str(model),
        "VISOR_CORE_METRICS_LISTEN": metrics,
        "VISOR_CACHE_PATH": str(logs / "cache"),
        "VISOR_DEPLOYMENT_SECRET_FILE": str(logs / "deployment.secret"),
        "VISOR_GATEWAY_LISTEN": gw,
        "VISOR_GATEWAY_CORES": core,
        "VISOR_GATEWAY_METRICS_LISTEN": "",
        **gateway_env,
    }
    started = [procs.start("core", env, config, log_path=logs / "core.log")]
    try:  # a stack that fails to start leaves no process behind (no teardown will run)
        procs.wait_healthy(core, started[0], timeout_s=120)
        started.append(procs.start("gateway", env, config, log_path=logs / "gateway.log"))
        procs.wait_healthy(gw, started[1], timeout_s=60)
    except BaseException:
        for proc in reversed(started):
            procs.stop(proc)
        raise
    return Stack(gw, core, metrics, env, logs, started[0], started[1])


def stop_stack(stack: Stack) -> None:
    for proc in (stack.gateway_proc, stack.core_proc):
        procs.stop(proc)


@pytest.fixture(scope="session")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(model_dir, tmp_path_factory.mktemp("stack"))
    yield s
    stop_stack(s)


@pytest.fixture(autouse=True)
def _tensor_class_untouched() -> Iterator[None]:
    """Fails the test that leaves `torch.Tensor` patched (fake-CUDA stand-ins for `__getitem__`
    or `copy_` cannot be undone: they belong in a child process, `tests.helpers.run_in_child`),
    before it breaks every later test of the run."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        patched = {"__getitem__", "copy_"} & set(vars(torch.Tensor))
        assert not patched, f"torch.Tensor left patched: {sorted(patched)}"

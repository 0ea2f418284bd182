"""Container images (no Docker engine here: the Dockerfiles are read and checked, not built).

Both run as a numeric non-root user, pin their base image, health-check through grpc.health.v1
(`visor health`), and keep the model out of the core image; the gateway image installs only
`.[gateway]` (tests/unit/test_no_torch.py proves the gateway's module graph needs no torch)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

DOCKER = ROOT / "deploy" / "docker"
IMAGES = ("gateway", "core")


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = (DOCKER / f"{name}.Dockerfile").read_text()
    joined = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args(name: str) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in _instructions(name) if k == "ARG" and "=" in a)


@pytest.mark.parametrize("name", IMAGES)
def test_runs_as_numeric_non_root_user(name: str) -> None:
    users = [a for k, a in _instructions(name) if k == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, users[-1]  # numeric: runAsNonRoot can verify it
    assert not gid or (gid.isdigit() and int(gid) > 0)


@pytest.mark.parametrize("name", IMAGES)
def test_base_images_are_pinned(name: str) -> None:
    args = _args(name)
    froms = [a.split()[0] for k, a in _instructions(name) if k == "FROM"]
    assert froms
    for ref in froms:
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        tag = ref.rpartition("/")[2].partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), ref


@pytest.mark.parametrize(
    ("name", "service"), [("gateway", "visor.v1.Gateway"), ("core", "visor.v1.Core")]
)
def test_health_check_uses_grpc_health(name: str, service: str) -> None:
    checks = [a for k, a in _instructions(name) if k == "HEALTHCHECK"]
    assert len(checks) == 1
    assert "visor" in checks[0] and "health" in checks[0] and service in checks[0]


def test_gateway_image_installs_no_torch_and_no_model() -> None:
    text = " ".join(a for _k, a in _instructions("gateway")).lower()
    assert '".[gateway]"' in text
    assert "torch" not in text.replace("find_spec('torch')", "")  # the build asserts its absence
    assert "[core" not in text and "models" not in text


def test_core_image_mounts_the_model_and_bakes_none_in() -> None:
    ins = _instructions("core")
    assert any(k == "RUN" and '".[${EXTRAS}]"' in a for k, a in ins)
    assert _args("core")["EXTRAS"] == "core"
    copies = [a for k, a in ins if k in {"COPY", "ADD"}]
    assert not [c for c in copies if "models" in c], copies
    volumes = " ".join(a for k, a in ins if k == "VOLUME")
    assert "/models" in volumes and "/var/lib/visor" in volumes
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "models" in ignore  # not even in the build context

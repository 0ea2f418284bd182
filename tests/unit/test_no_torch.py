"""The gateway and the client start without torch (fast `visor ask`, torch-free gateway image),
and the client library installs and imports on its own: `pip install visor` without extras pulls
no Pillow and no torch, and `import visor` needs neither, nor numpy, nor any service package."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.conftest import ROOT


def test_gateway_and_client_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import gateway.server, gateway.pipeline, gateway.decode, visor.client, visor.cli\n"
        "from visor.cli import parser\n"
        "parser().parse_args(['ask', 'x.png', '--prompt', 'hi'])\n"
        "roots = {'torch', 'transformers', 'core'}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in roots)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_every_gateway_module_and_visor_health_import_no_torch() -> None:
    """Everything `visor gateway` and `visor health` load, checked in a fresh interpreter."""
    code = (
        "import sys, pkgutil, importlib, gateway\n"
        "for m in pkgutil.iter_modules(gateway.__path__):\n"
        "    importlib.import_module('gateway.' + m.name)\n"
        "import visor.cli, shared.probe, shared.tls, shared.procs, shared.serving\n"
        "from visor.cli import parser\n"
        "parser().parse_args(['health', '--target', 'x:1'])\n"
        "roots = {'torch', 'core', 'cryptography'}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in roots)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_the_client_library_imports_without_service_code_or_heavy_packages() -> None:
    """Imports that would reach torch, Pillow, numpy or a service package fail outright here."""
    code = (
        "import sys\n"
        "for name in ('torch', 'PIL', 'numpy', 'av', 'core', 'gateway', 'bench'):\n"
        "    sys.modules[name] = None  # `import name` now raises ImportError\n"
        "import visor, visor.client, visor.aio, visor.errors, visor.retry\n"
        "visor.Client('127.0.0.1:1', 'k').close()\n"
        "visor.AsyncClient('127.0.0.1:1', 'k')\n"
        "print(sorted(m for m in sys.modules if m.startswith('visor.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'visor.client'" in out.stdout and "'visor.cli'" not in out.stdout


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def test_base_dependencies_pull_no_imaging_library_and_no_torch() -> None:
    """What `pip install visor` (no extras) installs, read from the package metadata; the wheel
    carries the client package."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    base = {_name(r) for r in meta["project"]["dependencies"]}
    assert base, "no base dependencies read"
    assert not base & {"pillow", "pillow-simd", "torch", "av", "transformers"}, base
    extras = meta["project"]["optional-dependencies"]
    assert {_name(r) for r in extras["gateway"]} >= {"pillow-simd", "av"}  # they live here
    assert "torch" in {_name(r) for r in extras["core"]}
    assert "visor" in meta["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    assert meta["project"]["scripts"]["visor"] == "visor.cli:main"

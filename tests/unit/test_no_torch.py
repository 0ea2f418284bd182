"""The gateway and the client start without torch (fast `visor ask`, torch-free gateway image)."""

from __future__ import annotations

import subprocess
import sys


def test_gateway_and_client_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import gateway.server, gateway.pipeline, gateway.decode, shared.client, shared.cli\n"
        "from shared.cli import parser\n"
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
        "import shared.cli, shared.probe, shared.tls, shared.procs, shared.serving\n"
        "from shared.cli import parser\n"
        "parser().parse_args(['health', '--target', 'x:1'])\n"
        "roots = {'torch', 'core', 'cryptography'}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in roots)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""

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

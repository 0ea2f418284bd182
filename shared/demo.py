"""`visor demo`: starts a core and a gateway, sends the sample media through the gateway, prints
each answer with its stage timings, then stops both (or, with --serve, keeps serving until Ctrl-C).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from shared import client, procs
from shared.errors import VisorError
from shared.metrics import STAGES

GATEWAY, CORE = "127.0.0.1:50051", "127.0.0.1:50052"
NOTE = (
    "note: the demo model has random weights (built by `visor model init-demo`), so its "
    "answers are noise; what this shows is the request path and its timings."
)


def _samples(folder: Path) -> list[tuple[Path, str]]:
    questions = json.loads((folder / "questions.json").read_text())
    return [(folder / name, prompt) for name, prompt in questions.items()]


def run(model: Path, samples: Path, serve: bool, config: Path | None) -> int:
    if not (model / "config.json").exists():
        from core.model import demo as demo_model

        demo_model.build(model)
    env = {"VISOR_CORE_MODEL": str(model)}
    core = procs.start("core", env, config)
    gateway = None
    try:
        procs.wait_healthy(CORE, core, timeout_s=120)
        gateway = procs.start("gateway", env, config)
        procs.wait_healthy(GATEWAY, gateway, timeout_s=60)
        print(f"core on {CORE} and gateway on {GATEWAY} are serving\n{NOTE}\n", flush=True)
        failures = sum(_ask(path, prompt) for path, prompt in _samples(samples))
        if serve:
            print("serving; press Ctrl-C to stop", flush=True)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            while core.poll() is None and gateway.poll() is None:
                time.sleep(0.5)
            # Ctrl-C reaches the services too; they stop cleanly (exit 0) on their own.
            codes = [p.poll() for p in (core, gateway)]
            if any(code not in (None, 0) for code in codes):
                print(f"a service exited with {codes}; stopping", file=sys.stderr)
                return 1
            return 0
        return 1 if failures else 0
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in (gateway, core):
            if proc is not None:
                procs.stop(proc)
        print("stopped core and gateway", flush=True)


def _ask(path: Path, prompt: str) -> int:
    req = client.build_request(prompt, [path.read_bytes()], max_new_tokens=24)
    t0 = time.perf_counter()
    try:
        answer = client.ask(GATEWAY, "visor-dev-key", req, timeout=60)
    except VisorError as err:
        print(f"{path.name}: refused {err.reason.value}: {err.message}", file=sys.stderr)
        return 1
    wall = (time.perf_counter() - t0) * 1000
    stages = ", ".join(f"{k} {answer.timings_ms[k]:.1f}" for k in STAGES if k in answer.timings_ms)
    print(
        f"{path.name}: Q: {prompt}\n  A: {answer.text!r}\n  usage: {answer.usage}\n"
        f"  timings_ms: {stages}\n  wall {wall:.0f} ms, served by {answer.served_by}\n",
        flush=True,
    )
    return 0

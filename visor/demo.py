"""`visor demo`: starts a core and a gateway, sends the sample media through the gateway, prints
each answer (with the expected one) and its stage timings, then stops both (or, with --serve,
keeps serving until Ctrl-C). Exits 1 when a sample is refused (a wrong answer is a quality
matter, measured by `visor eval`, not a failure of the request path).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared import procs
from shared.metrics import STAGES
from visor.client import Client
from visor.errors import VisorError

GATEWAY, CORE = "127.0.0.1:50051", "127.0.0.1:50052"
UNTRAINED = (
    "note: this demo model has random weights (built by `visor model init-demo`), so its "
    "answers are noise; train it with `visor model train-demo` or use the committed one."
)


@dataclass(frozen=True, slots=True)
class Sample:
    path: Path  # the media file
    question: str  # what the demo asks
    answer: str  # what a correct model answers


def _samples(folder: Path) -> list[Sample]:
    questions = json.loads((folder / "questions.json").read_text())
    return [
        Sample(folder / name, str(q["question"]), str(q["answer"])) for name, q in questions.items()
    ]


def _trained(model: Path) -> bool:
    block = json.loads((model / "config.json").read_text()).get("visor_demo", {})
    return bool(block.get("trained", True))  # not a demo build: assume a real checkpoint


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
        trained = _trained(model)
        print(f"core on {CORE} and gateway on {GATEWAY} are serving", flush=True)
        print("" if trained else UNTRAINED + "\n", flush=True)
        results = [_ask(s) for s in _samples(samples)]
        correct = sum(ok for _, ok in results)
        print(f"{correct}/{len(results)} samples answered correctly\n", flush=True)
        failures = sum(not served for served, _ in results)
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


def _ask(sample: Sample) -> tuple[bool, bool]:
    """Asks one sample: (served, answered as expected)."""
    t0 = time.perf_counter()
    try:
        with Client(GATEWAY, "visor-dev-key", timeout=60) as client:
            answer = client.ask(sample.question, [sample.path.read_bytes()], max_new_tokens=24)
    except VisorError as err:
        print(f"{sample.path.name}: refused {err.reason.value}: {err.message}", file=sys.stderr)
        return False, False
    wall = (time.perf_counter() - t0) * 1000
    got = answer.text.strip()
    ok = got.lower() == sample.answer.lower()
    stages = ", ".join(f"{k} {answer.timings_ms[k]:.1f}" for k in STAGES if k in answer.timings_ms)
    print(
        f"{sample.path.name}: Q: {sample.question}\n"
        f"  A: {got!r}  expected {sample.answer!r}  {'correct' if ok else 'WRONG'}\n"
        f"  usage: {answer.usage}\n"
        f"  timings_ms: {stages}\n  wall {wall:.0f} ms, served by {answer.served_by}\n",
        flush=True,
    )
    return True, ok

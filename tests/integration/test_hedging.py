"""Two cores behind a gateway whose health loop is slow to notice anything: when the core a
request would go to hangs (SIGSTOP), the gateway asks the next core after core_hedge_after_s (or
sooner, once it has seen how long handshakes take) and the request is answered in well under the
attempt timeout, by the other core; the hung core is then checked out of turn and marked down."""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image

from shared import procs
from tests.conftest import TENANTS_TOML, free_port
from tests.helpers import generate, metric, request

IDS = ("core-a", "core-b")


@dataclass
class Pair:
    gateway: str
    metrics: str  # the gateway's Prometheus endpoint
    procs: dict[str, procs.subprocess.Popen[bytes]]  # core id -> process


@pytest.fixture(scope="module")
def cores(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two cores, shared by the tests; each test starts a gateway of its own in front of them."""
    logs = tmp_path_factory.mktemp("hedging")
    addresses = {i: f"127.0.0.1:{free_port()}" for i in IDS}
    started: dict[str, procs.subprocess.Popen[bytes]] = {}
    try:
        for i, address in addresses.items():
            env = {
                "VISOR_CORE_LISTEN": address,
                "VISOR_CORE_CORE_ID": i,
                "VISOR_CORE_MODEL": str(model_dir),
                "VISOR_CORE_METRICS_LISTEN": "",
                "VISOR_CORE_ENCODER": "torch",
                "VISOR_CACHE_PATH": str(logs / f"cache-{i}"),
            }
            started[i] = procs.start("core", env, log_path=logs / f"{i}.log")
        for i, address in addresses.items():
            procs.wait_healthy(address, started[i], timeout_s=120)
        yield {"addresses": addresses, "procs": started, "logs": logs}
    finally:
        for p in started.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
            procs.stop(p)


@contextmanager
def _gateway(cores: dict[str, Any], health_interval_s: float) -> Iterator[Pair]:
    logs = cores["logs"]
    pair = Pair(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", cores["procs"])
    gw_env = {
        "VISOR_GATEWAY_LISTEN": pair.gateway,
        "VISOR_GATEWAY_CORES": ",".join(cores["addresses"].values()),
        "VISOR_GATEWAY_HEALTH_INTERVAL_S": str(health_interval_s),
        "VISOR_GATEWAY_CORE_ATTEMPT_TIMEOUT_S": "5.0",
        "VISOR_GATEWAY_CORE_HEDGE_AFTER_S": "1.0",
        "VISOR_GATEWAY_METRICS_LISTEN": pair.metrics,
        "VISOR_GATEWAY_DECODE_WORKERS": "1",
    }
    config = logs / "tenants.toml"
    config.write_text(TENANTS_TOML)
    gw = procs.start("gateway", gw_env, config, log_path=logs / f"gateway-{free_port()}.log")
    try:
        procs.wait_healthy(pair.gateway, gw, timeout_s=60)
        yield pair
    finally:
        for p in pair.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        procs.stop(gw)


@pytest.fixture
def pair(cores: dict[str, Any]) -> Iterator[Pair]:
    """A gateway whose health loop is too slow to see a hang within a test: only a hedge, and
    the check out of turn it sets off, can."""
    with _gateway(cores, health_interval_s=60) as pair:
        yield pair


def _png(seed: int) -> bytes:
    img = Image.new("RGB", (32, 32), ((seed * 53) % 256, (seed * 29) % 256, (seed * 71) % 256))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def test_a_hung_core_costs_a_hedge_not_the_attempt_timeout(pair: Pair) -> None:
    owner = {}
    for seed in range(8):
        out = generate(pair.gateway, request(media=(_png(seed),), max_new_tokens=1), timeout=30)
        assert out.code == grpc.StatusCode.OK and out.final is not None, out
        owner[seed] = out.final.served_by
    on_a = [seed for seed, core in owner.items() if core == "core-a"]
    assert on_a and len(on_a) < len(owner), owner  # rendezvous spreads 8 images over both
    hedges = metric(pair.metrics, "visor_gateway_core_hedges_total")
    os.kill(pair.procs["core-a"].pid, signal.SIGSTOP)
    try:
        for seed in on_a:
            t0 = time.monotonic()
            req = request(media=(_png(seed),), max_new_tokens=1)
            out = generate(pair.gateway, req, timeout=30)
            took = time.monotonic() - t0
            assert out.code == grpc.StatusCode.OK and out.final is not None, out
            assert out.final.served_by == "core-b"
            assert took < 2.5, took  # the attempt timeout alone is 5 s
    finally:
        os.kill(pair.procs["core-a"].pid, signal.SIGCONT)
    assert metric(pair.metrics, "visor_gateway_core_hedges_total") >= hedges + 1


def test_a_core_that_lets_a_hedge_win_is_checked_at_once(pair: Pair) -> None:
    """The hedge that outran core-a's handshake sets off a health check of core-a out of turn:
    hung, it is marked down within about health_timeout_s (1 s), though the health loop would
    not look for a minute; until then the requests it owns ask core-b at once too."""
    seed = next(s for s in range(300, 400) if _served_by(pair, s) == "core-a")
    assert metric(pair.metrics, "visor_gateway_cores_healthy") == 2
    os.kill(pair.procs["core-a"].pid, signal.SIGSTOP)
    try:
        out = generate(pair.gateway, request(media=(_png(seed),), max_new_tokens=1), timeout=30)
        assert out.final is not None and out.final.served_by == "core-b", out
        deadline = time.monotonic() + 5.0
        while metric(pair.metrics, "visor_gateway_cores_healthy") != 1:
            assert time.monotonic() < deadline, "core-a was not marked down"
            time.sleep(0.1)
        t0 = time.monotonic()  # core-a is down now: its requests go straight to core-b
        out = generate(pair.gateway, request(media=(_png(seed),), max_new_tokens=1), timeout=30)
        assert out.final is not None and out.final.served_by == "core-b", out
        assert time.monotonic() - t0 < 0.8  # no hedge delay (the cap is 1 s)
    finally:
        os.kill(pair.procs["core-a"].pid, signal.SIGCONT)


def test_a_slow_core_keeps_its_requests_once_it_answers(cores: dict[str, Any]) -> None:
    """Back to its owner once it answers again: neither the hedge nor the check out of turn
    moves the key for good (the health loop, here every second, marks it up again)."""
    with _gateway(cores, health_interval_s=1.0) as pair:
        seed = next(s for s in range(400, 500) if _served_by(pair, s) == "core-a")
        os.kill(pair.procs["core-a"].pid, signal.SIGSTOP)
        try:
            assert _served_by(pair, seed) == "core-b"
        finally:
            os.kill(pair.procs["core-a"].pid, signal.SIGCONT)
        deadline = time.monotonic() + 10.0
        while _served_by(pair, seed) != "core-a":
            assert time.monotonic() < deadline, "the key did not go back to core-a"
            time.sleep(0.2)


def test_once_handshakes_are_known_a_hung_core_costs_about_one_of_them(pair: Pair) -> None:
    """After enough handshakes the hedge waits their 95th percentile (milliseconds here), not the
    1 s cap: a request owned by a hung core is answered well before the cap would have let the
    second core be asked."""
    for seed in range(100, 130):  # more than HedgeDelay's warm-up, most of them quick
        out = generate(pair.gateway, request(media=(_png(seed),), max_new_tokens=1), timeout=30)
        assert out.code == grpc.StatusCode.OK, out
    seed = next(s for s in range(200, 300) if _served_by(pair, s) == "core-a")
    os.kill(pair.procs["core-a"].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = generate(pair.gateway, request(media=(_png(seed),), max_new_tokens=1), timeout=30)
        took = time.monotonic() - t0
    finally:
        os.kill(pair.procs["core-a"].pid, signal.SIGCONT)
    assert out.final is not None and out.final.served_by == "core-b", out
    assert took < 0.8, took  # the cap alone is 1 s


def _served_by(pair: Pair, seed: int) -> str:
    out = generate(pair.gateway, request(media=(_png(seed),), max_new_tokens=1), timeout=30)
    assert out.final is not None, out
    return out.final.served_by

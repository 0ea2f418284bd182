"""Three core processes behind one gateway on loopback: cache affinity and fail-over.

Repeats of an image land on one core and hit its cache; SIGKILL of that core moves its traffic
to the next core in rendezvous order within the health interval, failing at most the requests
that were streaming from it (CORE_UNAVAILABLE); when it comes back, its keys come back to it.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from PIL import Image

from shared import procs
from shared.proto import gateway_pb2_grpc
from tests.conftest import TENANTS_TOML, free_port
from tests.helpers import DEV_KEY, Outcome, _reason, generate, metric, request

HEALTH_INTERVAL_S = 0.5
IDS = ("core-a", "core-b", "core-c")


@dataclass
class Cluster:
    gateway: str
    metrics: str  # the gateway's Prometheus endpoint
    cores: dict[str, str]  # core id -> address
    procs: dict[str, procs.subprocess.Popen[bytes]]  # core id -> process
    envs: dict[str, dict[str, str]]  # core id -> its environment
    logs: Path

    def kill(self, core_id: str) -> None:
        self.procs[core_id].kill()  # SIGKILL: no drain, no goodbye
        self.procs[core_id].wait(10)

    def start(self, core_id: str) -> None:
        log = self.logs / f"{core_id}.log"
        self.procs[core_id] = procs.start("core", self.envs[core_id], log_path=log)
        procs.wait_healthy(self.cores[core_id], self.procs[core_id], timeout_s=120)


def _core_env(model: Path, logs: Path, core_id: str, address: str) -> dict[str, str]:
    return {
        "VISOR_CORE_LISTEN": address,
        "VISOR_CORE_CORE_ID": core_id,
        "VISOR_CORE_MODEL": str(model),
        "VISOR_CORE_METRICS_LISTEN": "",
        "VISOR_CORE_ENCODER": "torch",  # skips the ONNX export and the start-up race
        "VISOR_CORE_NUM_THREADS": "1",
        "VISOR_CACHE_PATH": str(logs / f"cache-{core_id}"),  # each core its own LMDB
    }


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("scaleout")
    cores = {i: f"127.0.0.1:{free_port()}" for i in IDS}
    envs = {i: _core_env(model_dir, logs, i, a) for i, a in cores.items()}
    c = Cluster("", f"127.0.0.1:{free_port()}", cores, {}, envs, logs)
    gw = None
    try:
        for i in IDS:
            c.procs[i] = procs.start("core", envs[i], log_path=logs / f"{i}.log")
        for i in IDS:
            procs.wait_healthy(cores[i], c.procs[i], timeout_s=120)
        c.gateway = f"127.0.0.1:{free_port()}"
        # The third core is named through DNS (localhost), as a headless Service would be.
        port_c = cores["core-c"].rsplit(":", 1)[1]
        gw_env = {
            "VISOR_GATEWAY_LISTEN": c.gateway,
            "VISOR_GATEWAY_CORES": f"{cores['core-a']},{cores['core-b']},dns:///localhost:{port_c}",
            "VISOR_GATEWAY_HEALTH_INTERVAL_S": str(HEALTH_INTERVAL_S),
            "VISOR_GATEWAY_HEALTH_TIMEOUT_S": "0.5",
            "VISOR_GATEWAY_METRICS_LISTEN": c.metrics,
            "VISOR_GATEWAY_DECODE_WORKERS": "1",
        }
        config = logs / "tenants.toml"
        config.write_text(TENANTS_TOML)
        gw = procs.start("gateway", gw_env, config, log_path=logs / "gateway.log")
        procs.wait_healthy(c.gateway, gw, timeout_s=60)
        yield c
    finally:
        for p in [*c.procs.values(), *([gw] if gw else [])]:
            procs.stop(p)


def _png(seed: int) -> bytes:
    img = Image.new("RGB", (32, 32), ((seed * 37) % 256, (seed * 91) % 256, (seed * 13) % 256))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _ask(cluster: Cluster, png: bytes, tokens: int = 1) -> Outcome:
    return generate(cluster.gateway, request(media=(png,), max_new_tokens=tokens), timeout=30)


def _stream_until_killed(target: str, png: bytes, started: threading.Event) -> Outcome:
    """A long request that signals once its first token arrived."""
    req = request("Tell a long story.", media=(png,), max_new_tokens=400, min_new_tokens=400)
    deltas: list[str] = []
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        metadata = [("authorization", f"Bearer {DEV_KEY}")]
        try:
            for event in stub.Generate(req, metadata=metadata, timeout=60):
                if event.WhichOneof("kind") == "delta":
                    deltas.append(event.delta.text)
                    started.set()
        except grpc.RpcError as exc:
            return Outcome(deltas, None, exc.code(), _reason(exc), exc.details() or "")
    return Outcome(deltas, None, grpc.StatusCode.OK, "", "")


def test_requests_spread_and_repeats_stick(cluster: Cluster) -> None:
    served = {}
    for seed in range(9):
        out = _ask(cluster, _png(seed))
        assert out.code == grpc.StatusCode.OK, (out.code, out.reason)
        assert out.final is not None and out.final.served_by in IDS
        served[seed] = out.final.served_by
    assert len(set(served.values())) >= 2, served  # rendezvous hashing spreads distinct images
    for seed in range(9):  # every repeat lands where its features are, and hits
        out = _ask(cluster, _png(seed))
        assert out.final is not None and out.final.served_by == served[seed]
        assert out.final.cache[0].hit, seed
    text_only = generate(cluster.gateway, request("hello", max_new_tokens=1))
    assert text_only.code == grpc.StatusCode.OK and text_only.final is not None


def test_killing_a_core_moves_only_its_traffic(cluster: Cluster) -> None:
    png = _png(100)
    first = _ask(cluster, png)
    assert first.final is not None
    victim = first.final.served_by
    time.sleep(0.5)  # the feature write runs in the background after the answer
    others = [s for s in range(20) if _served_by(cluster, _png(s)) != victim][:4]
    assert others, "no image routed to another core"
    assert metric(cluster.metrics, "visor_gateway_cores_healthy") == len(IDS)
    failovers = metric(cluster.metrics, "visor_gateway_core_failovers_total")
    started = threading.Event()
    in_flight: list[Outcome] = []
    streams = [
        threading.Thread(
            target=lambda: in_flight.append(_stream_until_killed(cluster.gateway, png, started))
        )
        for _ in range(2)
    ]
    for t in streams:
        t.start()
    assert started.wait(30), "the long requests never started streaming"
    cluster.kill(victim)
    killed_at = time.monotonic()
    after = _ask(cluster, png)  # the victim's key, right after the kill
    moved_in = time.monotonic() - killed_at
    for t in streams:
        t.join(60)
    assert after.code == grpc.StatusCode.OK, (after.code, after.reason)
    assert after.final is not None and after.final.served_by not in (victim, "")
    assert moved_in < HEALTH_INTERVAL_S + 5.0  # one decode + encode on a loaded 2-core host
    new_home = after.final.served_by
    # The victim is marked down by whichever fails first on it: the in-flight streams (no
    # failover: they had streamed tokens) or `after` (one failover to the next core).
    assert metric(cluster.metrics, "visor_gateway_core_failovers_total") in (
        failovers,
        failovers + 1,
    )
    assert metric(cluster.metrics, "visor_gateway_cores_healthy") == len(IDS) - 1
    again = _ask(cluster, png)
    assert again.final is not None and again.final.served_by == new_home
    assert again.final.cache[0].hit  # the new home caches it from then on
    for out in in_flight:  # in flight on the victim: failed cleanly, or finished before it died
        assert out.code == grpc.StatusCode.OK or (out.code, out.reason) == (
            grpc.StatusCode.UNAVAILABLE,
            "CORE_UNAVAILABLE",
        ), (out.code, out.reason)
    assert any(out.code != grpc.StatusCode.OK for out in in_flight)
    for seed in others:  # traffic of the other cores never noticed
        out = _ask(cluster, _png(seed))
        assert out.code == grpc.StatusCode.OK and out.final is not None
        assert out.final.served_by != victim and out.final.cache[0].hit
    _comes_back(cluster, victim, png)


def _served_by(cluster: Cluster, png: bytes) -> str:
    out = _ask(cluster, png)
    assert out.final is not None, (out.code, out.reason)
    return out.final.served_by


def _comes_back(cluster: Cluster, victim: str, png: bytes) -> None:
    """A restarted core gets its keys back within a health interval, and its LMDB still holds
    their features."""
    cluster.start(victim)
    deadline = time.monotonic() + HEALTH_INTERVAL_S + 10
    while True:
        out = _ask(cluster, png)
        if (out.final is not None and out.final.served_by == victim) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(HEALTH_INTERVAL_S / 2)
    assert out.final is not None and out.final.served_by == victim
    assert out.final.cache[0].hit

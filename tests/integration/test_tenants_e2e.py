"""Per-tenant policy and live reload through a real core and gateway: a limit tightened for one
tenant only, allowed and default profiles, per-tenant concurrency and rate, no_cache and cache
TTL reaching the core, SIGHUP reloads (key rotation, a broken file kept out, a request in flight
finishing under the policy it started with), and loosening refused at start."""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from PIL import Image

from shared.hashing import key_sha256
from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.conftest import OTHER_KEY, ROOT, Stack, free_port, start_stack, stop_stack
from tests.helpers import DEV_KEY, Outcome, generate, request

SINGLE_KEY, RATED_KEY, BRIEF_KEY, NEW_KEY = "single-key", "rated-key", "brief-key", "rotated-key"


def _entry(tenant: str, keys: list[str], limits: str = "", policy: str = "") -> str:
    hashes = ", ".join(f'"{key_sha256(k)}"' for k in keys)
    text = f'\n[[tenants]]\nid = "{tenant}"\nkeys_sha256 = [{hashes}]\n'
    text += f"[tenants.limits]\n{limits}\n" if limits else ""
    return text + (f"[tenants.policy]\n{policy}\n" if policy else "")


def config(dev_keys: tuple[str, ...] = (DEV_KEY,), dev_limits: str = "", b_limits: str = "") -> str:
    """The module's tenants: dev (global policy unless told), tenant-b (one media item, two
    profiles, no cache), single (one request at a time), rated (2 then 0.01/s), brief (1 s TTL)."""
    b_policy = 'profiles = ["low-latency", "balanced"]\ndefault_profile = "balanced"\n'
    return (
        _entry("dev", list(dev_keys), dev_limits)
        + _entry("tenant-b", [OTHER_KEY], b_limits or "max_items = 1", b_policy + "no_cache = true")
        + _entry("single", [SINGLE_KEY], policy="max_concurrent = 1")
        + _entry("rated", [RATED_KEY], policy="rate_per_s = 0.01\nburst = 2")
        + _entry("brief", [BRIEF_KEY], policy="cache_ttl_s = 1.0")
    )


@pytest.fixture(scope="module")
def tenants_stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        model_dir,
        tmp_path_factory.mktemp("tenants"),
        tenants_toml=config(),
        VISOR_LIMITS_MAX_NEW_TOKENS="4096",  # a stream long enough to outlast a reload
    )
    yield s
    stop_stack(s)


@pytest.fixture
def restore(tenants_stack: Stack) -> Iterator[Stack]:
    """For tests that reload: the module's table is back in force afterwards."""
    yield tenants_stack
    reload(tenants_stack, config())


def reload(stack: Stack, text: str, expect: str = "tenants_reloaded") -> dict[str, Any]:
    """Writes the config file, sends SIGHUP, and returns the gateway's log line about it."""
    log = stack.logs / "gateway.log"

    def lines() -> list[dict[str, Any]]:
        out = []
        for line in log.read_text(errors="replace").splitlines():
            if '"tenants_reload' in line:
                out.append(json.loads(line))
        return out

    before = len(lines())
    (stack.logs / "visor.toml").write_text(text)
    os.kill(stack.gateway_proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while len(found := lines()) == before:
        assert time.monotonic() < deadline, "no reload line in the gateway's log"
        time.sleep(0.05)
    assert found[-1]["event"] == expect, found[-1]
    return found[-1]


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _ok(out: Outcome) -> gateway_pb2.Final:
    assert out.code == grpc.StatusCode.OK and out.final is not None, out
    return out.final


class Stream:
    """One long Generate read on a thread: `started` is set at its first delta."""

    def __init__(self, target: str, key: str, num_tokens: int) -> None:
        self.started, self.final = threading.Event(), None
        self.error: grpc.RpcError | None = None
        req = request("Tell a long story.", max_new_tokens=num_tokens, min_new_tokens=num_tokens)
        self._thread = threading.Thread(target=self._run, args=(target, key, req), daemon=True)
        self._thread.start()
        assert self.started.wait(60), self.error

    def _run(self, target: str, key: str, req: gateway_pb2.GenerateRequest) -> None:
        with grpc.insecure_channel(target) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            try:
                for event in stub.Generate(req, metadata=[("authorization", f"Bearer {key}")]):
                    self.started.set()
                    if event.WhichOneof("kind") == "final":
                        self.final = event.final
            except grpc.RpcError as exc:
                self.error = exc
                self.started.set()

    def join(self) -> gateway_pb2.Final:
        self._thread.join(120)
        assert self.error is None and self.final is not None, self.error
        return self.final


def test_a_tighter_limit_applies_to_its_tenant_only(tenants_stack: Stack) -> None:
    two = request("Compare them.", media=(_png(1), _png(2)), max_new_tokens=2)
    refused = generate(tenants_stack.gateway, two, key=OTHER_KEY)
    assert (refused.code, refused.reason) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "IMAGE_COUNT_LIMIT",
    )
    assert "max_items (1)" in refused.message
    _ok(generate(tenants_stack.gateway, two))  # dev: the global max_items (8)


def test_allowed_and_default_profiles(tenants_stack: Stack) -> None:
    png = _png(3)
    other = request("What is it?", media=(png,), max_new_tokens=2)
    other.profile = "none"
    refused = generate(tenants_stack.gateway, other, key=OTHER_KEY)
    assert (refused.code, refused.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
    assert "policy" in refused.message and "balanced" in refused.message
    default = request("What is it?", media=(png,), max_new_tokens=2)
    usage = _ok(generate(tenants_stack.gateway, default, key=OTHER_KEY)).usage
    assert usage.visual_tokens_after < usage.visual_tokens_before  # "balanced" prunes
    usage = _ok(generate(tenants_stack.gateway, default)).usage
    assert usage.visual_tokens_after == usage.visual_tokens_before  # dev: [gateway] "none"


def test_no_cache_tenant_misses_every_repeat(tenants_stack: Stack) -> None:
    req = request("What is it?", media=(_png(4),), max_new_tokens=2)
    for key, hits in ((OTHER_KEY, [False, False]), (DEV_KEY, [False, True])):
        seen = [_ok(generate(tenants_stack.gateway, req, key=key)).cache[0].hit for _ in hits]
        assert seen == hits, key


def test_a_tenant_cache_ttl_reaches_the_core(tenants_stack: Stack) -> None:
    req = request("What is it?", media=(_png(5),), max_new_tokens=2)

    def hit(key: str) -> bool:
        return bool(_ok(generate(tenants_stack.gateway, req, key=key)).cache[0].hit)

    assert [hit(BRIEF_KEY), hit(BRIEF_KEY), hit(DEV_KEY)] == [False, True, False]
    time.sleep(1.3)
    assert not hit(BRIEF_KEY)  # past its 1 s TTL
    assert hit(DEV_KEY)  # the core's own 7 days for everyone else


def test_per_tenant_concurrency_and_rate(tenants_stack: Stack) -> None:
    gw = tenants_stack.gateway
    quick = request("Hi.", max_new_tokens=1)
    running = Stream(gw, SINGLE_KEY, 200)
    second = generate(gw, quick, key=SINGLE_KEY)
    assert (second.code, second.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED")
    assert "max_concurrent" in second.message
    _ok(generate(gw, quick))  # dev meanwhile: no cap of its own
    running.join()
    _ok(generate(gw, quick, key=SINGLE_KEY))  # its slot came back
    rated = [generate(gw, quick, key=RATED_KEY) for _ in range(3)]
    assert [o.reason for o in rated] == ["", "", "QUOTA_EXCEEDED"], rated
    assert "rate_per_s" in rated[2].message
    _ok(generate(gw, quick))


def test_sighup_rotates_a_key(restore: Stack) -> None:
    gw, quick = restore.gateway, request("Hi.", max_new_tokens=1)
    assert generate(gw, quick, key=NEW_KEY).reason == "UNAUTHENTICATED"
    line = reload(restore, config(dev_keys=(DEV_KEY, NEW_KEY)))
    assert line["num_tenants"] == 5
    for key in (DEV_KEY, NEW_KEY):  # the overlap: both keys are the dev tenant
        _ok(generate(gw, quick, key=key))
    reload(restore, config(dev_keys=(NEW_KEY,)))
    assert generate(gw, quick, key=DEV_KEY).reason == "UNAUTHENTICATED"
    _ok(generate(gw, quick, key=NEW_KEY))


def test_a_bad_file_is_refused_and_the_old_table_kept(restore: Stack) -> None:
    gw = restore.gateway
    two = request("Compare them.", media=(_png(6), _png(7)), max_new_tokens=2)
    broken = reload(restore, "[[tenants]\n", expect="tenants_reload_failed")
    assert "not valid TOML" in broken["config_error"]
    loose = reload(restore, config(b_limits="max_items = 9"), expect="tenants_reload_failed")
    assert "max_items = 9 loosens" in loose["config_error"] and "tenant_hash" in loose
    assert "tenant-b" not in json.dumps(loose)  # tenant ids reach logs only hashed
    _ok(generate(gw, request("Hi.", max_new_tokens=1)))  # the old keys still work
    assert generate(gw, two, key=OTHER_KEY).reason == "IMAGE_COUNT_LIMIT"  # and the old limits


def test_a_request_in_flight_finishes_under_the_policy_it_started_with(restore: Stack) -> None:
    running = Stream(restore.gateway, DEV_KEY, 4000)
    reload(restore, config(dev_limits="max_new_tokens = 16"))
    assert running.final is None  # still generating when the new table came in
    late = generate(restore.gateway, request("Tell a long story.", max_new_tokens=400))
    assert late.reason == "TOKEN_BUDGET" and "the cap (16)" in late.message
    final = running.join()
    assert final.usage.output_tokens == 4000 and final.finish_reason == "length"


def test_an_open_upload_keeps_the_tenant_it_authenticated_as(restore: Stack) -> None:
    """Authenticated and admitted when it opens, an upload finishes under that table although a
    reload meanwhile removed its key and cut its tenant's max_items to 1."""
    messages: queue.Queue[gateway_pb2.UploadMessage | None] = queue.Queue()

    def send() -> Iterator[gateway_pb2.UploadMessage]:
        while (message := messages.get(timeout=60)) is not None:
            yield message

    pngs = (_png(8), _png(9))
    header = request("Compare them.", media=(b"", b""), max_new_tokens=2)
    messages.put(gateway_pb2.UploadMessage(request=header))
    with grpc.insecure_channel(restore.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        call = stub.GenerateUpload(send(), metadata=[("authorization", f"Bearer {DEV_KEY}")])
        time.sleep(1.0)  # the gateway authenticates and admits it under the module's table
        reload(restore, config(dev_keys=(NEW_KEY,), dev_limits="max_items = 1"))
        for index, png in enumerate(pngs):
            chunk = gateway_pb2.MediaChunk(media_index=index, data=png)
            messages.put(gateway_pb2.UploadMessage(chunk=chunk))
        messages.put(None)
        events = list(call)
    assert events[-1].WhichOneof("kind") == "final" and len(events[-1].final.cache) == 2
    assert generate(restore.gateway, request("Hi."), key=DEV_KEY).reason == "UNAUTHENTICATED"
    two = request("Compare them.", media=pngs, max_new_tokens=2)
    assert generate(restore.gateway, two, key=NEW_KEY).reason == "IMAGE_COUNT_LIMIT"


def test_loosening_is_refused_at_start_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "visor.toml"
    env = {
        **os.environ,
        "VISOR_GATEWAY_LISTEN": f"127.0.0.1:{free_port()}",
        "VISOR_GATEWAY_METRICS_LISTEN": "",
        "VISOR_GATEWAY_MAX_CONCURRENT_PER_TENANT": "2",
        "VISOR_DEPLOYMENT_SECRET_FILE": str(tmp_path / "deployment.secret"),
    }
    for entry, key in (
        (_entry("acme", ["k"], policy="max_concurrent = 3"), "[tenants.policy] max_concurrent"),
        (_entry("acme", ["k"], limits="max_pixels = 40000000"), "[tenants.limits] max_pixels"),
    ):
        path.write_text(entry)
        cmd = [sys.executable, "-m", "visor.cli", "gateway", "--config", str(path)]
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert key in out.stderr and "loosens" in out.stderr and '"acme"' in out.stderr

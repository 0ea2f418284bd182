"""Redaction canaries: a core and a gateway at debug level, a tenant whose key, prompt, image
bytes (and their base64), EXIF GPS, file name, video metadata and a video's external URL each
carry a unique canary; no captured log line
of either service contains any of them, and a prompt cannot forge a log line.

The same stack runs with `worker_max_jobs = 2`, so the requests also exercise recycling.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import struct
import subprocess
import sys
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from PIL import Image

from shared import procs, secret
from shared.hashing import key_sha256
from tests.conftest import ROOT, Stack, free_port
from tests.gateway import videos
from tests.gateway.test_gateway_hostile import assert_workers_steady, gateway_children
from tests.helpers import generate, request

TAG = uuid.uuid4().hex[:10]
CANARY = {
    name: f"CANARY{name.upper()}{TAG}"
    for name in ("prompt", "key", "bytes", "gps", "filename", "badkey", "video", "url")
}


def _png_with_text(text: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, "PNG")
    data = buf.getvalue()
    body = b"Comment\x00" + text.encode()
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body
    chunk += struct.pack(">I", zlib.crc32(b"tEXt" + body))
    return data[:33] + chunk + data[33:]  # right after IHDR


def _jpeg_with_gps(text: str) -> bytes:
    exif = Image.Exif()
    gps = exif.get_ifd(0x8825)
    gps[0x0001] = "N"
    gps[0x001B] = text  # GPSProcessingMethod
    exif[0x010E] = text  # ImageDescription, for good measure
    buf = io.BytesIO()
    Image.new("RGB", (48, 32), (20, 30, 200)).save(buf, "JPEG", exif=exif.tobytes())
    return buf.getvalue()


def _video_with_title(text: str) -> bytes:
    import av

    data = videos.video("h264-mp4", seconds=1.0)
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(out, "w", format="mp4") as dst:
        dst.metadata["title"] = text
        dst.metadata["comment"] = text
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                dst.mux(packet)
    return out.getvalue()


@pytest.fixture(scope="module")
def debug_stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("redaction")
    core, gw = (f"127.0.0.1:{free_port()}" for _ in range(2))
    config = logs / "visor.toml"
    config.write_text(
        f'[[tenants]]\nid = "tenant-{TAG}"\nkey_sha256 = "{key_sha256(CANARY["key"])}"\n'
    )
    env = {
        "VISOR_CORE_LISTEN": core,
        "VISOR_CORE_MODEL": str(model_dir),
        "VISOR_CORE_METRICS_LISTEN": "",
        "VISOR_CACHE_PATH": str(logs / "cache"),
        "VISOR_DEPLOYMENT_SECRET_FILE": str(logs / "deployment.secret"),
        "VISOR_GATEWAY_LISTEN": gw,
        "VISOR_GATEWAY_CORES": core,
        "VISOR_GATEWAY_METRICS_LISTEN": "",
        "VISOR_GATEWAY_WORKER_MAX_JOBS": "2",
        "VISOR_LOG_LEVEL": "debug",
    }
    core_proc = procs.start("core", env, log_path=logs / "core.log")
    procs.wait_healthy(core, core_proc, timeout_s=120)
    gw_proc = procs.start("gateway", env, config=config, log_path=logs / "gateway.log")
    procs.wait_healthy(gw, gw_proc, timeout_s=60)
    stack = Stack(gw, core, "", env, logs, core_proc, gw_proc)
    yield stack
    for proc in (gw_proc, core_proc):
        procs.stop(proc)


def test_no_canary_reaches_any_log_line(debug_stack: Stack, tmp_path: Path) -> None:
    png = _png_with_text(CANARY["bytes"])
    jpeg = _jpeg_with_gps(CANARY["gps"])
    prompt = f"{CANARY['prompt']} describe"
    workers_before = {pid for pid, _ in gateway_children(debug_stack.gateway_proc.pid)}
    for media in ((png,), (jpeg,), (png, jpeg)):
        out = generate(debug_stack.gateway, request(prompt, media), key=CANARY["key"])
        assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
    clip = _video_with_title(CANARY["video"])
    assert CANARY["video"].encode() in clip
    out = generate(debug_stack.gateway, request(prompt, (clip,)), key=CANARY["key"])
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason, out.message)
    elsewhere = videos.mp4_with_external_ref(f"http://{CANARY['url']}.invalid/clip.mp4")
    out = generate(debug_stack.gateway, request(prompt, (elsewhere,)), key=CANARY["key"])
    assert out.reason == "UNSUPPORTED_FORMAT" and CANARY["url"] not in out.message
    refused = generate(debug_stack.gateway, request(prompt, (png,)), key=CANARY["badkey"])
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED
    named = tmp_path / f"{CANARY['filename']}.png"
    named.write_bytes(png)
    ask = [sys.executable, "-m", "visor.cli", "ask", str(named), "--prompt", prompt]
    ask += ["--key", CANARY["key"], "--target", debug_stack.gateway, "--json"]
    subprocess.run(ask, check=True, capture_output=True, timeout=60, cwd=ROOT)
    assert_workers_steady(debug_stack)  # 6 decode-bearing requests, each worker recycled
    assert workers_before - {pid for pid, _ in gateway_children(debug_stack.gateway_proc.pid)}

    procs.stop(debug_stack.gateway_proc)  # flushes every line before reading
    secrets = [*CANARY.values(), base64.b64encode(png).decode()[:24]]
    secrets += [base64.b64encode(jpeg).decode()[:24], f"tenant-{TAG}"]
    for name in ("gateway.log", "core.log"):
        text = (debug_stack.logs / name).read_text(errors="replace")
        assert text.strip(), f"{name} is empty"
        assert ("request_done" if name == "gateway.log" else "infer") in text  # lines were captured
        for canary in secrets:
            assert canary not in text, (name, canary)
    _assert_tenant_hashes_are_keyed(debug_stack)


def _assert_tenant_hashes_are_keyed(stack: Stack) -> None:
    """Both services hash the tenant with HMAC under the deployment's log key: their lines agree,
    and the unsalted SHA-256 of the name (what a guesser would compute) appears nowhere."""
    log_key = secret.load(
        secret.DeploymentConfig(stack.env["VISOR_DEPLOYMENT_SECRET_FILE"])
    ).log_key
    tenant = f"tenant-{TAG}".encode()
    keyed = hmac.new(log_key, tenant, hashlib.sha256).hexdigest()[:16]
    unsalted = hashlib.sha256(tenant).hexdigest()[:16]
    for name, event in (("gateway.log", "request_done"), ("core.log", "infer_done")):
        text = (stack.logs / name).read_text(errors="replace")
        records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        hashes = {r["tenant_hash"] for r in records if r.get("event") == event}
        assert hashes == {keyed}, (name, hashes)
        assert unsalted not in text, name


def test_a_prompt_cannot_forge_a_log_line(debug_stack: Stack) -> None:
    forged = '\n{"level":"error","event":"forged","tenant":"admin"}\n'
    if debug_stack.gateway_proc.poll() is not None:  # stopped by the test above
        debug_stack.gateway_proc = procs.start(
            "gateway",
            debug_stack.env,
            config=debug_stack.logs / "visor.toml",
            log_path=debug_stack.logs / "gateway.log",
        )
        procs.wait_healthy(debug_stack.gateway, debug_stack.gateway_proc, timeout_s=60)
    out = generate(debug_stack.gateway, request(forged), key=CANARY["key"])
    assert out.code == grpc.StatusCode.OK, (out.code, out.reason)
    procs.stop(debug_stack.gateway_proc)
    for name in ("gateway.log", "core.log"):
        for line in (debug_stack.logs / name).read_text().splitlines():
            if not line.startswith("{"):
                continue  # gRPC's own C-core lines (no user content either: checked above)
            assert json.loads(line).get("event") != "forged", (name, line)

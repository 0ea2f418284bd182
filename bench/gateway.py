"""`visor bench gateway --json`: images per second from a photo-like JPEG (1080p and 4K, quality
90) to the encoder's tile, one image at a time, through

- `sandboxed`: the full gateway path: sniff, then the probe and decode jobs on the real sandboxed
  worker pool (pipe in, shared memory out), as the pipeline runs them;
- `a_in_process`: the same sniff/probe/decode code in this process (no sandbox);
- `b_pillow_full`: plain Pillow, full-size decode, convert, LANCZOS resize;
- `c_djpeg`: libjpeg-turbo's `djpeg -scale` (process start included), the floor; skipped with a
  note when `djpeg` is not installed (Debian: libjpeg-turbo-progs).

Ratios (from medians; the overhead also from best-of-run times): sandbox overhead over (a),
speed-up of (a) and of the sandboxed path over (b), and time of (a) relative to (c).
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from gateway import decode, tiling
from gateway.config import GatewayConfig, LimitsConfig
from gateway.pool import DecodePool
from gateway.server import pillow_build, pool_settings
from gateway.sniff import sniff

SIZES = {"1080p": (1920, 1080), "4k": (3840, 2160)}
FILL = (122, 116, 104)  # CLIP's mean, as the demo model's geometry reports it
DEFAULT_TILE = 336


def photo_like(width: int, height: int, seed: int = 0) -> bytes:
    """Smooth gradients and soft blobs (sky, skin, walls), sensor-like noise, and hard edges
    (buildings, text): roughly the entropy of a photo, encoded at quality 90."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack(
        [
            120 + 80 * np.sin(x / width * 3.1 + c) * np.cos(y / height * 2.3 - c)
            for c in (0.0, 1.3, 2.6)
        ],
        axis=-1,
    )
    for _ in range(12):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(40, height / 3)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        img += blob * rng.uniform(-90, 90, 3)
    for _ in range(40):
        x0, y0 = int(rng.uniform(0, width - 50)), int(rng.uniform(0, height - 50))
        w, h = int(rng.uniform(10, width / 6)), int(rng.uniform(10, height / 6))
        img[y0 : y0 + h, x0 : x0 + w] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _spec(data: bytes, p: decode.Probe, tile: int) -> decode.Spec:
    grid = tiling.grid_for("auto", p.width, p.height, tiling.Budget(tile, 1))
    lim = LimitsConfig()
    return decode.Spec(
        sniff(data), tile, FILL, grid.rows, grid.cols, (0,), lim.max_pixels, lim.max_side
    )


def _in_process(data: bytes, tile: int) -> None:
    lim = LimitsConfig()
    fmt = sniff(data)
    p = decode.probe(data, fmt, lim.max_pixels, lim.max_side, lim.max_frames)
    decode.decode(data, _spec(data, p, tile))


def _pillow_full(data: bytes, tile: int) -> None:
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")  # full-size decode
    scale = tile / max(rgb.size)
    size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
    canvas = Image.new("RGB", (tile, tile), FILL)
    canvas.paste(rgb.resize(size, Image.Resampling.LANCZOS))
    np.asarray(canvas).transpose(2, 0, 1).copy()


def _djpeg_scale(width: int, height: int, tile: int) -> str:
    """The smallest M/8 whose output still covers the tile, as draft mode picks."""
    for m in (1, 2, 4, 8):
        if width * m / 8 >= tile and height * m / 8 >= tile * height / width:
            return f"{m}/8"
    return "8/8"


def _djpeg(data: bytes, scale: str) -> None:
    subprocess.run(["djpeg", "-scale", scale, "-ppm"], input=data, capture_output=True, check=True)


def _time_interleaved(paths: dict[str, Callable[[], object]], repeats: int) -> dict[str, Any]:
    """Runs the paths round-robin, one call each per round, so that a change in the machine's
    load during the run hits every path alike."""
    ms: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            ms[name].append((time.perf_counter() - t0) * 1000)
    out = {}
    for name, times in ms.items():
        p50 = statistics.median(times)
        out[name] = {
            "p50_ms": round(p50, 3),
            "min_ms": round(min(times), 3),
            "images_per_s": round(1000 / p50, 1),
        }
    return out


async def _through_pool(pool: DecodePool, data: bytes, tile: int) -> None:
    """What the pipeline asks of the workers for one still image: a probe, then a decode."""
    lim = LimitsConfig()
    fmt = sniff(data)
    args = {"fmt": fmt, "max_pixels": lim.max_pixels, "max_side": lim.max_side}
    reply = await pool.run("probe", {**args, "max_frames": lim.max_frames}, data)
    body = reply.body
    p = decode.Probe(int(body["width"]), int(body["height"]), int(body["num_frames"]))
    done = await pool.run("decode", _spec(data, p, tile).to_json(), data)
    assert done.arrays[0].shape == (1, 3, tile, tile)


def tile_size(model: Path) -> int:
    try:
        cfg = json.loads((model / "config.json").read_text())
        return int(cfg["vision_config"]["image_size"])
    except (OSError, KeyError, ValueError):
        return DEFAULT_TILE


def _one_size(
    runner: asyncio.Runner, pool: DecodePool, name: str, tile: int, repeats: int
) -> dict[str, Any]:
    width, height = SIZES[name]
    data = photo_like(width, height)
    row: dict[str, Any] = {"jpeg_bytes": len(data)}
    scale = _djpeg_scale(width, height, tile)
    paths: dict[str, Callable[[], object]] = {
        "sandboxed": lambda: runner.run(_through_pool(pool, data, tile)),
        "a_in_process": lambda: _in_process(data, tile),
        "b_pillow_full": lambda: _pillow_full(data, tile),
    }
    if shutil.which("djpeg"):
        paths["c_djpeg"] = lambda: _djpeg(data, scale)
    row.update(_time_interleaved(paths, repeats))
    if "c_djpeg" in row:
        row["c_djpeg"]["scale"] = scale
    else:
        row["c_djpeg"] = {"skipped": "djpeg not installed (Debian: libjpeg-turbo-progs)"}
    sb, a, b = (row[k]["p50_ms"] for k in ("sandboxed", "a_in_process", "b_pillow_full"))
    row["sandbox_overhead_vs_a"] = round(sb / a - 1, 3)
    # Best-of-run times: steadier than medians on a shared, loaded machine.
    row["sandbox_overhead_vs_a_min"] = round(
        row["sandboxed"]["min_ms"] / row["a_in_process"]["min_ms"] - 1, 3
    )
    row["speedup_a_vs_b"] = round(b / a, 2)
    row["speedup_sandboxed_vs_b"] = round(b / sb, 2)
    if "p50_ms" in row["c_djpeg"]:
        row["a_vs_c_time_ratio"] = round(a / row["c_djpeg"]["p50_ms"], 2)
    return row


def main(model: Path, repeats: int) -> int:
    tile = tile_size(model)
    cfg = GatewayConfig()
    pool = DecodePool(pool_settings(cfg, LimitsConfig()))
    runner = asyncio.Runner()
    report = runner.run(pool.start())
    try:
        out: dict[str, Any] = {"bench": "gateway", "tile": tile, "repeats": repeats}
        out["pillow"] = pillow_build()
        out["sandbox"] = report
        out["workers"] = cfg.decode_workers
        for name in SIZES:
            out[name] = _one_size(runner, pool, name, tile, repeats)
        out["targets"] = {"sandbox_overhead_vs_a": "<= 0.15", "speedup_a_vs_b_1080p": ">= 4"}
    finally:
        pool.close()
        runner.close()
    print(json.dumps(out))
    return 0

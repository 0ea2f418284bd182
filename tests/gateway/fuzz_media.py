"""Fuzz harness over the gateway's parsing path: sniff -> probe -> decode, in-process, with the
limits a worker applies. Any exception that is not a typed `VisorError` is a finding.

    python -m tests.gateway.fuzz_media --seconds 60 [--workdir DIR]

Seeds are written to the work directory at start: media generated here (every allowed format,
stills, animations, video) plus every file of ../shared/corpus when it is present (read there,
never copied into the repository). With atheris installed, libFuzzer drives the run (coverage of
the Python side guides it); without it, a plain mutation loop over the same seeds runs instead.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import resource
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

os.environ.setdefault("SVT_LOG", "1")

try:
    import atheris

    with atheris.instrument_imports(include=["gateway"]):
        from gateway import decode, sniff, tiling, video
except ImportError:
    atheris = None
    from gateway import decode, sniff, tiling, video

from shared.errors import VisorError

CORPUS = Path(
    os.environ.get("VISOR_TEST_CORPUS", Path(__file__).resolve().parents[3] / "shared" / "corpus")
)
MAX_PIXELS = 4096 * 4096  # smaller than the gateway default: more inputs per second
MAX_SIDE = 8192
MAX_FRAMES = 64
VIDEO_LIMITS = video.VideoLimits(30.0, 4, 600, 1.0, 4)
TILE = 32
WORKER_MEMORY = 2048 << 20  # [gateway] worker_memory_mb's default, in bytes


def one_input(data: bytes) -> None:
    """What a worker does with one item, at a small tile size; typed refusals are fine."""
    try:
        fmt = sniff.sniff(data, video=True)
        if fmt in sniff.VIDEO:
            p = video.probe(data, fmt, VIDEO_LIMITS, MAX_PIXELS, MAX_SIDE)
        else:
            p = decode.probe(data, fmt, MAX_PIXELS, MAX_SIDE, MAX_FRAMES)
        grid = tiling.grid_for("high", p.width, p.height, tiling.Budget(TILE, 4))
        frames = tiling.sample_frames(p.num_frames, 3)
        if fmt in sniff.VIDEO:
            frames = tuple(range(min(p.num_frames, VIDEO_LIMITS.max_samples)))
        spec = decode.Spec(fmt, TILE, (0, 0, 0), grid.rows, grid.cols, frames, MAX_PIXELS, MAX_SIDE)
        if fmt in sniff.VIDEO:
            out = video.decode_video(data, spec, VIDEO_LIMITS)
        else:
            out = decode.decode(data, spec)
    except VisorError:
        return
    expected = (spec.num_tiles, 3, TILE, TILE)
    if len(out.items) != len(frames) or any(a.shape != expected for a in out.items):
        raise AssertionError(f"decode returned the wrong geometry for {fmt}")


def _image(fmt: str, mode: str = "RGB", frames: int = 1, size: tuple[int, int] = (40, 24)) -> bytes:
    rng = np.random.default_rng(len(fmt) + frames)
    imgs = [
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)
        for _ in range(frames)
    ]
    buf = io.BytesIO()
    if frames > 1:
        imgs[0].save(buf, fmt, save_all=True, append_images=imgs[1:], duration=40)
    else:
        imgs[0].save(buf, fmt)
    return buf.getvalue()


def generated_seeds() -> dict[str, bytes]:
    seeds = {
        "rgb.jpg": _image("JPEG"),
        "progressive.jpg": _progressive(),
        "grey.png": _image("PNG", "L"),
        "rgba.png": _image("PNG", "RGBA"),
        "apng.png": _image("PNG", frames=3),
        "still.webp": _image("WEBP"),
        "anim.webp": _image("WEBP", frames=3),
        "anim.gif": _image("GIF", "P", frames=4),
    }
    if video.HAS_AV:
        seeds["h264.mp4"] = video.sample("libx264", "mp4", seconds=2.0, fps=4, size=(32, 24))
        seeds["vp9.webm"] = video.sample("libvpx-vp9", "webm", seconds=2.0, fps=4, size=(32, 24))
    return seeds


def _progressive() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (20, 90, 200)).save(buf, "JPEG", progressive=True)
    return buf.getvalue()


def write_seeds(workdir: Path) -> Path:
    seeds = workdir / "seeds"
    seeds.mkdir(parents=True, exist_ok=True)
    for name, data in generated_seeds().items():
        (seeds / f"gen-{name}").write_bytes(data)
    if (CORPUS / "MANIFEST.tsv").exists():
        for path in sorted(CORPUS.iterdir()):
            if path.is_file() and path.name not in ("MANIFEST.tsv", "README.md"):
                (seeds / f"corpus-{path.name}").write_bytes(path.read_bytes())
    return seeds


def _mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(4)
        if op == 0 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif op == 1 and out:
            del out[rng.randrange(len(out)) :]
        elif op == 2:
            other = rng.choice(pool)
            at = rng.randrange(len(other) + 1)
            out[rng.randrange(len(out) + 1) :] = other[at:]
        else:
            at = rng.randrange(len(out) + 1)
            out[at:at] = rng.randbytes(rng.randint(1, 16))
    return bytes(out)


def mutation_loop(seeds: Path, seconds: float, run: Callable[[bytes], None]) -> int:
    """The fallback without atheris: random byte edits, truncations and splices of the seeds."""
    pool = [p.read_bytes() for p in sorted(seeds.iterdir())]
    rng = random.Random(0)
    deadline, runs = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        run(_mutate(rng, rng.choice(pool), pool))
        runs += 1
    print(f"mutation loop: {runs} runs in {seconds:g} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--engine", choices=("auto", "atheris", "mutation"), default="auto")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="visor-fuzz-"))
    # Memory is bounded as a decode worker's is (its default worker_memory_mb): an input that
    # allocates past it fails with MemoryError, which the worker turns into a refusal.
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    decode.init_worker(MAX_PIXELS)
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    seeds = write_seeds(workdir)
    if args.engine == "mutation" or (args.engine == "auto" and atheris is None):
        return mutation_loop(seeds, args.seconds, one_input)
    if atheris is None:
        print("atheris is not installed", file=sys.stderr)
        return 2
    flags = [
        sys.argv[0],
        f"-max_total_time={max(1, round(args.seconds))}",
        "-timeout=20",
        # libFuzzer's RSS check reads ru_maxrss, which Linux carries over exec from the parent
        # (a test runner of several GiB would trip it before the first input): RLIMIT_AS bounds
        # memory instead.
        "-rss_limit_mb=0",
        "-max_len=262144",
        f"-artifact_prefix={workdir}/",
        str(seeds),
    ]
    atheris.Setup(flags, one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())

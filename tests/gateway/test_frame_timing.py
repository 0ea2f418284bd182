"""Frame timing from headers alone: the probe gives each frame's start time (GIF graphic control
delays, APNG frame controls, WebP ANMF chunks, a video's sample times), checked against Pillow's
own per-frame durations (read by decoding); a native plan turns the kept frames into a video of
the mean time between them."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pytest
from PIL import Image

from gateway import decode, video
from gateway.config import LimitsConfig
from gateway.pipeline import plan_media
from shared.preprocess import PreprocessRule
from tests.gateway import videos

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "corpus"
LIMITS = LimitsConfig()
NATIVE = PreprocessRule(
    "native", (0.5,) * 3, (0.5,) * 3, "bicubic", patch_size=14, merge_size=2,
    temporal_patch_size=2, min_pixels=3136, max_pixels=1003520,
)  # fmt: skip


def _animation(fmt: str, durations: list[int], **options: object) -> bytes:
    frames = [Image.new("RGB", (40, 30), (i * 50 % 256, 90, 200 - i * 30)) for i in durations]
    out = io.BytesIO()
    frames[0].save(out, fmt, save_all=True, append_images=frames[1:], duration=durations, **options)
    return out.getvalue()


def _pillow_starts(data: bytes, shown: object = None) -> tuple[float, ...]:
    """Each frame's start from Pillow's decoded durations (ms), `shown` mapping a delay to what
    a viewer shows."""
    with Image.open(io.BytesIO(data)) as img:
        durations = []
        for index in range(img.n_frames):
            img.seek(index)
            img.load()  # WebP reads a frame's duration as it decodes it
            ms = float(img.info.get("duration", 0))
            durations.append(shown(ms) if callable(shown) else ms)
    return tuple(s / 1000 for s in itertools.accumulate(durations[:-1], initial=0.0))


def _probe(data: bytes, fmt: str) -> decode.Probe:
    return decode.probe(data, fmt, LIMITS.max_pixels, LIMITS.max_side, LIMITS.max_frames)


def test_gif_delays_as_browsers_show_them() -> None:
    data = _animation("GIF", [100, 0, 250, 40, 70])
    got = _probe(data, "GIF").starts_s
    # 0 (and 1/100 s) show as 1/10 s; Pillow reports the stored delay.
    want = _pillow_starts(data, lambda ms: ms if ms > 10 else 100)
    assert got == pytest.approx(want) and len(got) == 5
    assert got == pytest.approx((0.0, 0.1, 0.2, 0.45, 0.49))


def test_apng_and_webp_delays_match_pillow() -> None:
    for fmt in ("PNG", "WEBP"):
        data = _animation(fmt, [120, 80, 300, 50])
        got = _probe(data, fmt).starts_s
        assert got == pytest.approx(_pillow_starts(data)), fmt
        assert got == pytest.approx((0.0, 0.12, 0.2, 0.5)), fmt


def test_corpus_apng_delays_match_pillow() -> None:
    path = CORPUS / "valid-apng-2-frames.png"
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared corpus is not mounted)")
    data = path.read_bytes()
    got = _probe(data, "PNG").starts_s
    assert got == pytest.approx(_pillow_starts(data)) and len(got) == 2


def test_a_still_image_has_no_timing() -> None:
    out = io.BytesIO()
    Image.new("RGB", (40, 30)).save(out, "PNG")
    assert _probe(out.getvalue(), "PNG").starts_s == ()


def test_video_starts_are_its_sample_times() -> None:
    lim = video.VideoLimits(10.0, 2, 100, 2.0, 8)
    data = videos.video("h264-mp4", seconds=2.0, fps=10)
    p = video.probe(data, "MP4", lim, 1 << 20, 1 << 10)
    assert p.num_frames == 4 and p.starts_s == video.sample_times(2.0, lim)
    plan = plan_media(0, p, True, "auto", NATIVE, LIMITS)
    assert plan.stacked and plan.frames == (0, 1, 2, 3)
    assert plan.interval_s == pytest.approx(0.5)  # 1 / video_sample_fps


def test_a_tiled_plan_stays_one_item_per_frame() -> None:
    tiles = PreprocessRule("tiles", (0.5,) * 3, (0.5,) * 3, "bicubic", 336, 576)
    p = decode.Probe(40, 30, 5, (0.0, 0.1, 0.2, 0.3, 0.4))
    plan = plan_media(0, p, False, "low", tiles, LIMITS)
    assert not plan.stacked and plan.interval_s == 0 and len(plan.items) == 5

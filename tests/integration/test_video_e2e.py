"""Qwen2.5-VL video served end to end: an H.264 video and a GIF animation go through a real
gateway (probed, sampled and resized in its sandboxed workers) to a real core serving a tiny
random-weight Qwen2.5-VL (tests/family_checkpoints.py), which shows each as one video of
temporal patch pairs. The answer is compared with transformers' greedy generation: the same 8
tokens and each logprob within 1e-3.

transformers' Qwen2-VL video processor needs torchvision, which is absent here, so the reference
is transformers' model fed the gateway's own frames (the worker's decode functions run in this
process on the plan the gateway makes: same sampled frames, same resize) through the video
processor's normalisation and patch order (`qwen_video_patches`, transcribed), with the
prompt transformers' template renders for a video and `second_per_grid_ts` = 2 x the sampling
interval (1 / video_sample_fps for the video; the mean frame delay for the animation). What is
compared is the core's side: video slots in the prompt, their expansion to t x h x w tokens,
the encoder on frame pairs, and the video's rope positions; a reference given other timing
answers otherwise, so the timing is seen."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from core.model.preprocessing import rule_for
from gateway import decode, video
from gateway.config import LimitsConfig
from gateway.pipeline import bounded_rule, decode_spec, plan_media
from gateway.sniff import VIDEO, sniff
from tests.conftest import Stack, start_stack, stop_stack
from tests.family_checkpoints import QwenCheckpoints, build_qwen, qwen_video_patches
from tests.integration.test_families_e2e import (
    PROMPT,
    QWEN_MAX_PIXELS,
    Answer,
    Reference,
    _ask,
    _check,
    _generate,
)

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")
SAMPLE_FPS = 4.0  # the gateway's video_sample_fps here: frames 0.25 s apart
LIMITS = LimitsConfig(video_sample_fps=SAMPLE_FPS)


def _scene(width: int, height: int, step: int) -> np.ndarray:
    """A gradient with a circle that moves right by `step`: frames differ, smoothly."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x + 2 * y) % 256], -1)
    image = Image.fromarray(base.astype(np.uint8))
    x0 = 10 + 12 * step
    ImageDraw.Draw(image).ellipse((x0, 30, x0 + 50, 80), fill=(240, 40, 20))
    return np.asarray(image)


def _video(seconds: float = 1.5, fps: int = 12, size: tuple[int, int] = (160, 120)) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "12"}
        for i in range(round(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(_scene(*size, i), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _gif(num_frames: int = 4, delay_ms: int = 250) -> bytes:
    frames = [Image.fromarray(_scene(150, 110, 2 * i)) for i in range(num_frames)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=delay_ms)
    return out.getvalue()


@dataclass
class Served:
    stack: Stack
    ck: QwenCheckpoints
    model: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("qwen-video")
    ck = build_qwen(root, size={"shortest_edge": 56 * 56, "longest_edge": QWEN_MAX_PIXELS})
    model = root / "t5"
    (root / "logs").mkdir()
    stack = start_stack(model, root / "logs", VISOR_LIMITS_VIDEO_SAMPLE_FPS=str(SAMPLE_FPS))
    yield Served(stack, ck, model)
    stop_stack(stack)


def _gateway_frames(data: bytes, model: Path) -> tuple[torch.Tensor, float]:
    """The frames the gateway's workers send for `data` (T, 3, H, W) uint8, and the interval
    the gateway declares: the plan and decode functions the gateway runs, run here."""
    fmt = sniff(data, True)
    rule = bounded_rule(rule_for(model, "qwen2_5_vl"), LIMITS)
    vlim = video.VideoLimits(
        LIMITS.max_video_duration_s,
        LIMITS.max_video_streams,
        LIMITS.max_video_frames,
        LIMITS.video_sample_fps,
        LIMITS.max_sampled_frames,
    )
    if fmt in VIDEO:
        probe = video.probe(data, fmt, vlim, LIMITS.max_pixels, LIMITS.max_side)
    else:
        probe = decode.probe(data, fmt, LIMITS.max_pixels, LIMITS.max_side, LIMITS.max_frames)
    plan = plan_media(0, probe, fmt in VIDEO, "high", rule, LIMITS)
    spec = decode_spec(fmt, plan.grid, plan.frames, rule, (0, 0, 0), LIMITS)
    done = video.decode_video(data, spec, vlim) if fmt in VIDEO else decode.decode(data, spec)
    frames = torch.from_numpy(np.concatenate(done.items))
    return frames, plan.interval_s


def _reference(served: Served, frames: torch.Tensor, seconds_per_patch: float) -> Reference:
    cfg = served.ck.hf.config
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(served.model)
    t, _, h, w = frames.shape
    content = [{"type": "video"}, {"type": "text", "text": PROMPT}]
    prompt = fast.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    tokens = t // 2 * (h // 28) * (w // 28)
    ids = [i for token in prompt for i in [token] * (tokens if token == cfg.video_token_id else 1)]
    input_ids = torch.tensor([ids])
    pre = served.ck.image_processor
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": 2 * (input_ids == cfg.video_token_id).int(),
        "pixel_values_videos": qwen_video_patches(frames, pre.image_mean, pre.image_std),
        "video_grid_thw": torch.tensor([[t // 2, h // 14, w // 14]]),
        "second_per_grid_ts": torch.tensor([seconds_per_patch]),
    }
    return _generate(served.ck.hf, fast, inputs)


def _served_as_video(served: Served, data: bytes, interval: float) -> Answer:
    frames, got_interval = _gateway_frames(data, served.model)
    assert got_interval == pytest.approx(interval)
    assert frames.shape[0] >= 4 and frames.shape[0] % 2 == 0  # at least 2 temporal patches
    ours = _ask(served.stack, [data])
    ref = _reference(served, frames, 2 * got_interval)
    _check(ours, ref, f"qwen video of {frames.shape[0]} frames, {got_interval:g} s apart")
    t, _, h, w = frames.shape
    assert ours.final.usage.visual_tokens_after == t // 2 * (h // 28) * (w // 28)
    # Other timing moves the video's rope positions: transformers then answers otherwise.
    other = _reference(served, frames, 4 * got_interval)
    gap = max(abs(a - b) for a, b in zip(ours.logprobs, other.logprobs, strict=True))
    assert gap > 1e-3, gap
    return ours


def test_a_video_matches_transformers_at_its_sampling_rate(served: Served) -> None:
    data = _video()
    first = _served_as_video(served, data, 1 / SAMPLE_FPS)
    again = _ask(served.stack, [data])
    assert not first.final.cache[0].hit and again.final.cache[0].hit
    assert again.text == first.text and again.logprobs == pytest.approx(first.logprobs, abs=1e-5)


def test_a_gif_animation_is_a_video_of_its_frame_delays(served: Served) -> None:
    _served_as_video(served, _gif(delay_ms=250), 0.25)

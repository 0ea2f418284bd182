"""Qwen3-VL's deepstack inputs in the runner on device "cuda", without a GPU: torch's
FakeTensorMode runs `ModelRunner.execute` for a prompt whose image the prefill splits (the first
chunk ends inside it, the second starts there) with the tiny checkpoint's shapes in bf16, and
the trace shows the second chunk's deepstack rows gathered on the device from the request's
table, their indices riding in the step's one input copy (no extra host-to-device transfer),
and nothing computed on the device coming back but the sampled id. The same child-process
harness as tests/core/test_llm_device.py (its `Tensor.__getitem__` stand-in cannot be undone)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from core import generate
from core.model import qwen3_vl
from core.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from core.runner import ModelRunner
from core.types import SamplingParams
from tests.core.test_encoder_device import _fake_on_cuda
from tests.core.test_llm_device import CUDA, _getitem, _Trace
from tests.family_checkpoints import build_qwen3
from tests.helpers import run_in_child

pytest.importorskip("transformers")
IMAGE = (5, 25)  # the image's [start, end) in the 35-token prompt: a 4 x 5 grid


def _step(chunk: ScheduledChunk, new: tuple[NewRequestData, ...] = ()) -> SchedulerOutput:
    return SchedulerOutput(new, (chunk,), chunk.num_tokens, (), ())


def deepstack_step_on_fake_cuda(model_dir: str) -> None:
    cfg = qwen3_vl.load_config(Path(model_dir))
    with torch.device("meta"):
        model = qwen3_vl.Qwen3VL(cfg)
    hidden, image = cfg.text.hidden_size, cfg.image_token_id
    ids = (100,) * IMAGE[0] + (image,) * (IMAGE[1] - IMAGE[0]) + (101,) * 10
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((IMAGE[1] - IMAGE[0], 3 * hidden)).astype(np.float32)
    params = SamplingParams(max_new_tokens=4)
    new = NewRequestData(0, ids, (feats,), params, 1, None, ((1, 4, 5),), (IMAGE,), (None,))
    downloads: list[tuple[int, ...]] = []

    def download(values: torch.Tensor) -> list[float]:
        downloads.append(tuple(values.cpu().shape))
        return [0.0] * values.numel()

    generate.download = download  # type: ignore[assignment]
    torch.Tensor.__getitem__ = _getitem  # type: ignore[method-assign,assignment]
    with FakeTensorMode(allow_non_fake_inputs=False), _Trace() as trace:
        _fake_on_cuda(model, torch.bfloat16)
        with torch.device(CUDA):
            model.reset_buffers()
        runner = ModelRunner(model, num_blocks=8, block_size=16, eos_ids={2})
        first = runner.execute(_step(ScheduledChunk(0, 0, 16, (0,), False), (new,)))
        assert not first.sampled and not first.errors, first
        trace.recording = True  # the chunk that starts inside the image
        out = runner.execute(_step(ScheduledChunk(0, 16, 19, (0, 1, 2), True)))
    assert out.sampled == {0: 0} and not out.errors
    ops = trace.ops
    gathers = [made for op, _, made in ops if op.startswith("aten.index_select")]
    # The chunk's 19 rows of both deepstack layers, gathered from its table on the device.
    assert [("cuda", torch.bfloat16, (19, 2 * hidden))] in gathers
    back = [op for op, ins, made in ops if "cuda" in ins and any(m[0] != "cuda" for m in made)]
    # The sampled id only (the first step sampled nothing: its copy is empty).
    assert len(back) == 1 and downloads == [(0,), (1,)], (back, downloads)
    sent = [op for op, ins, made in ops if ins == {"cpu"} and any(m[0] == "cuda" for m in made)]
    assert 1 <= len(sent) <= 2, sent  # the runner's inputs (rows included), the metadata
    print("deepstack step ok")


def test_a_chunk_inside_an_image_gathers_its_deepstack_rows_on_the_device(
    tmp_path: Path,
) -> None:
    """`deepstack_step_on_fake_cuda` with the tiny checkpoint's config, in a child process."""
    build_qwen3(tmp_path)
    out = run_in_child(
        "tests.core.test_qwen3_device.deepstack_step_on_fake_cuda", str(tmp_path / "t5")
    )
    assert "deepstack step ok" in out

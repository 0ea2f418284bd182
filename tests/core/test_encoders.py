"""Encoder backends agree; the vision queue batches; importance scores are attention."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from core import encoders
from core.model import llava
from core.vision_queue import VisionQueue

COSINE_MIN = 0.999  # stated tolerance: ONNX Runtime vs torch float32 features


@pytest.fixture(scope="module")
def model(model_dir: Path) -> llava.Llava:
    return llava.load(model_dir)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


def _pixels(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3, size, size), dtype=np.uint8)


def test_onnxruntime_matches_torch(model: llava.Llava, artifacts: Path) -> None:
    size = model.cfg.vision.image_size
    pixels = _pixels(5, size)  # the export used 2 tiles: the tile axis is dynamic
    ref_f, ref_s = encoders.TorchEncoder(model).encode(pixels)
    onnx = encoders.OnnxRuntimeEncoder(encoders.export_onnx(model, artifacts))
    got_f, got_s = onnx.encode(pixels)
    a, b = ref_f.reshape(-1, ref_f.shape[-1]), got_f.reshape(-1, got_f.shape[-1])
    cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    max_abs = float(np.abs(ref_f - got_f).max())
    print(f"onnxruntime vs torch: min cosine {cosine.min():.6f}, max abs {max_abs:.2e}")
    assert got_f.shape == ref_f.shape == (5, model.cfg.tokens_per_tile, model.cfg.text.hidden_size)
    assert cosine.min() >= COSINE_MIN
    assert np.abs(ref_s - got_s).max() < 1e-4
    assert encoders.export_onnx(model, artifacts) == next(artifacts.glob("*.onnx"))  # cached


def test_auto_picks_a_cpu_backend_here(model: llava.Llava, artifacts: Path) -> None:
    chosen = encoders.build("auto", model, artifacts)
    assert chosen.name in {"torch", "onnxruntime"}
    with pytest.raises(ValueError, match="unknown encoder backend"):
        encoders.build("cuda-magic", model, artifacts)


@pytest.mark.skipif(
    not encoders.tensorrt_available(), reason="TensorRT and a CUDA device are absent on this host"
)
def test_tensorrt_matches_torch(model: llava.Llava, artifacts: Path) -> None:
    from core.tensorrt_encoder import TensorRTEncoder

    size = model.cfg.vision.image_size
    pixels = _pixels(8, size)
    ref, _ = encoders.TorchEncoder(model).encode(pixels)
    got, _ = TensorRTEncoder(encoders.export_onnx(model, artifacts), artifacts, size).encode(pixels)
    a, b = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    assert cosine.min() >= 0.99  # FP16 engine vs FP32 torch


def test_importance_is_class_token_attention(model: llava.Llava) -> None:
    size = model.cfg.vision.image_size
    _, scores = encoders.TorchEncoder(model).encode(_pixels(2, size))
    assert scores.shape == (2, model.cfg.tokens_per_tile)
    assert (scores > 0).all()
    # The class token's attention sums to 1 over all tokens; the patches hold all but its own.
    assert ((scores.sum(-1) > 0.5) & (scores.sum(-1) < 1.0)).all()


def test_vision_queue_batches_by_tiles_and_splits_results(model: llava.Llava) -> None:
    torch_enc = encoders.TorchEncoder(model)
    size = model.cfg.vision.image_size
    calls: list[int] = []

    def encode(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        calls.append(pixels.shape[0])
        return torch_enc.encode(pixels)

    async def run_inline(fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def main() -> list[tuple[np.ndarray, np.ndarray]]:
        queue = VisionQueue(encode, run_inline, max_batch_tiles=4, max_wait_s=0.05)
        items = [_pixels(1, size, seed=i) for i in range(3)] + [_pixels(2, size, seed=9)]
        return await asyncio.gather(*(queue.encode(p) for p in items))

    results = asyncio.run(main())
    # 1+1+1 tiles wait; the 2-tile item makes 5 >= 4: the three singles go together (adding the
    # pair would pass the cap, and an item is never split), then the pair.
    assert calls == [3, 2]
    singles = [torch_enc.encode(_pixels(1, size, seed=i))[0] for i in range(3)]
    for got, want in zip(results[:3], singles, strict=True):
        assert np.allclose(got[0], want, atol=1e-5)
    assert results[3][0].shape[0] == 2

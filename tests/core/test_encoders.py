"""Encoder backends agree (torch float32 / bf16, ONNX Runtime on the fp32 and the fp16 export);
the TensorRT engine key; the vision queue batches, on the encoder's own thread; importance scores
are attention."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from core import encoders
from core.model import llava
from core.tensorrt_encoder import PROFILE, Profile, TensorRTUnavailable, engine_key, import_tensorrt
from core.vision_queue import EncoderThread, VisionQueue

COSINE_MIN = 0.999  # stated tolerance: every backend and precision vs torch float32 features
SCORES_ABS = 5e-3  # stated tolerance for importance scores in half precision (they sum to < 1)
CUDA = torch.device("cuda", 0)


def _tensorrt_missing() -> str:
    try:
        import_tensorrt(CUDA if torch.cuda.is_available() else torch.device("cpu"))
    except TensorRTUnavailable as exc:
        return exc.reason
    return ""


@pytest.fixture(scope="module")
def model(model_dir: Path) -> llava.Llava:
    return llava.load(model_dir)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


def _pixels(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3, size, size), dtype=np.uint8)


def _min_cosine(ref: np.ndarray, got: np.ndarray) -> float:
    a, b = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    return float(
        ((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min()
    )


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
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: auto tries TensorRT there")
    chosen = encoders.build("auto", model, artifacts)
    assert chosen.name in {"torch", "onnxruntime"}
    with pytest.raises(ValueError, match="unknown encoder backend"):
        encoders.build("cuda-magic", model, artifacts)


def test_torch_bf16_on_the_cpu_agrees_with_float32(model: llava.Llava, model_dir: Path) -> None:
    size = model.cfg.vision.image_size
    pixels = _pixels(6, size)
    ref_f, ref_s = encoders.TorchEncoder(model).encode(pixels)
    placed = llava.load(model_dir)  # the encoder moves its model's weights: a model of its own
    bf16 = encoders.TorchEncoder(placed, torch.device("cpu"), torch.bfloat16)
    got_f, got_s = bf16.encode(pixels)
    print(f"bf16 vs float32: min cosine {_min_cosine(ref_f, got_f):.6f}")
    assert placed.vision_tower.vision_model.post_layernorm.weight.dtype == torch.bfloat16
    assert placed.lm_head.weight.dtype == torch.float32  # the language model is not the encoder's
    assert got_f.dtype == got_s.dtype == np.float32 and got_f.shape == ref_f.shape
    assert _min_cosine(ref_f, got_f) >= COSINE_MIN
    assert np.abs(ref_s - got_s).max() < SCORES_ABS


def test_the_fp16_export_tensorrt_builds_from_runs_in_onnxruntime(
    model: llava.Llava, artifacts: Path
) -> None:
    """The export a strongly typed TensorRT network takes its precision from: fp16 weights, the
    float32 normalisation constants, uint8 in and float32 out; it agrees with torch float32."""
    path = encoders.export_onnx(model, artifacts, torch.float16)
    assert "-fp16" in path.name and model.lm_head.weight.dtype == torch.float32
    assert model.multi_modal_projector.linear_1.weight.dtype == torch.float32  # a copy was exported
    graph = onnx.load(str(path)).graph
    floats = [i.data_type for i in graph.initializer if i.data_type != onnx.TensorProto.INT64]
    assert floats.count(onnx.TensorProto.FLOAT) == 2  # pixel_scale, pixel_shift
    assert set(floats) == {onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT}
    assert [i.type.tensor_type.elem_type for i in graph.input] == [onnx.TensorProto.UINT8]
    assert {o.type.tensor_type.elem_type for o in graph.output} == {onnx.TensorProto.FLOAT}
    pixels = _pixels(3, model.cfg.vision.image_size)
    ref_f, ref_s = encoders.TorchEncoder(model).encode(pixels)
    got_f, got_s = encoders.OnnxRuntimeEncoder(path).encode(pixels)
    print(f"fp16 export vs torch float32: min cosine {_min_cosine(ref_f, got_f):.6f}")
    assert _min_cosine(ref_f, got_f) >= COSINE_MIN
    assert np.abs(ref_s - got_s).max() < SCORES_ABS


def test_the_engine_key_names_everything_an_engine_depends_on() -> None:
    base = {
        "digest": "ab" * 32,
        "precision": "fp16",
        "profile": PROFILE,
        "trt_version": "10.13.3.9",
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "capability": (9, 0),
    }
    changes = [
        {"digest": "cd" * 32},
        {"precision": "fp32"},
        {"profile": Profile(1, 8, 32)},
        {"profile": Profile(1, 16, 64)},
        {"trt_version": "11.1.0.4"},
        {"gpu_name": "NVIDIA A100-SXM4-80GB"},
        {"capability": (8, 0)},
    ]
    key = engine_key(**base)  # type: ignore[arg-type]
    others = [engine_key(**{**base, **change}) for change in changes]  # type: ignore[arg-type]
    assert key == engine_key(**base)  # type: ignore[arg-type]
    assert len({key, *others}) == 1 + len(changes)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", k) for k in (key, *others))  # a file name


@pytest.mark.skipif(bool(_tensorrt_missing()), reason=f"no TensorRT here: {_tensorrt_missing()}")
def test_tensorrt_matches_torch(model_dir: Path, artifacts: Path) -> None:
    model = llava.load(model_dir)
    pixels = _pixels(8, model.cfg.vision.image_size)
    ref, _ = encoders.TorchEncoder(model).encode(pixels)
    trt = encoders.build(
        "tensorrt", llava.load(model_dir), artifacts, device=CUDA, dtype=torch.float16
    )
    assert trt.name == "tensorrt"  # not the fallback
    got, _ = trt.encode(pixels)
    assert _min_cosine(ref, got) >= 0.99  # fp16 engine vs float32 torch
    again = encoders.build("tensorrt", llava.load(model_dir), artifacts, device=CUDA)
    assert np.array_equal(again.encode(pixels)[0], got)  # the cached engine, same key


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

        threads.add(threading.current_thread().name)
        return torch_enc.encode(pixels)

    async def main() -> list[tuple[np.ndarray, np.ndarray]]:
        queue = VisionQueue(encode, worker.run, max_batch_tiles=4, max_wait_s=0.05)
        items = [_pixels(1, size, seed=i) for i in range(3)] + [_pixels(2, size, seed=9)]
        return await asyncio.gather(*(queue.encode(p) for p in items))

    threads: set[str] = set()
    worker = EncoderThread()
    try:
        results = asyncio.run(main())
    finally:
        worker.close()
    assert len(threads) == 1 and threads.pop().startswith("visor-encoder")
    # 1+1+1 tiles wait; the 2-tile item makes 5 >= 4: the three singles go together (adding the
    # pair would pass the cap, and an item is never split), then the pair.
    assert calls == [3, 2]
    singles = [torch_enc.encode(_pixels(1, size, seed=i))[0] for i in range(3)]
    for got, want in zip(results[:3], singles, strict=True):
        assert np.allclose(got[0], want, atol=1e-5)
    assert results[3][0].shape[0] == 2


def _per_view_means(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An encoder whose rows are views: each view's channel means as its one token."""
    feats = pixels.astype(np.float32).mean(axis=(2, 3))[:, None, :]
    return feats, feats[..., 0]


def _whole_item(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An encoder of whole items (native): one row, a token per frame, that sees every frame."""
    feats = np.cumsum(pixels.astype(np.float32).mean(axis=(2, 3)), axis=0)[None]
    return feats, feats[..., 0]


@pytest.mark.parametrize("per_view", [True, False])
def test_vision_queue_batches_only_items_of_one_view_shape(per_view: bool) -> None:
    """Views of one shape share a batch (split back by views); another shape waits for its own
    batch; an encoder of whole items gets one item per call. Each item's answer is its own."""
    encode = _per_view_means if per_view else _whole_item
    calls: list[tuple[int, ...]] = []

    def counted(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        calls.append(pixels.shape)
        return encode(pixels)

    rng = np.random.default_rng(0)
    shapes = [(1, 3, 8, 8), (1, 3, 8, 12), (2, 3, 8, 8)]
    items = [rng.integers(0, 256, s, dtype=np.uint8) for s in shapes]

    async def main() -> list[tuple[np.ndarray, np.ndarray]]:
        queue = VisionQueue(counted, worker.run, 16, 0.02, per_view=per_view)
        return await asyncio.gather(*(queue.encode(p) for p in items))

    worker = EncoderThread()
    try:
        results = asyncio.run(main())
    finally:
        worker.close()
    if per_view:
        assert calls == [(3, 3, 8, 8), (1, 3, 8, 12)]
    else:
        assert calls == shapes
    for (feats, scores), pixels in zip(results, items, strict=True):
        want, want_scores = encode(pixels)
        assert np.array_equal(feats, want) and np.array_equal(scores, want_scores)

"""Vision encoder backends behind one interface: uint8 tiles in, projected features and
per-token importance scores out. All of them run the same computation; `onnxruntime` and
`tensorrt` run the one ONNX export of it (cached on disk by encoder digest).

`auto` picks TensorRT where TensorRT and a CUDA device exist; otherwise it times torch (float32)
and ONNX Runtime on a batch of 4 tiles at start and keeps the faster (the timings are logged).
`torch-bf16` (bf16 autocast, for CPUs with native bf16) is never picked by `auto`: it trades
precision for speed, which is the operator's call.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from core.model.llava import Llava
from shared import logs

BACKENDS = ("auto", "torch", "torch-bf16", "onnxruntime", "tensorrt")
INPUT, FEATURES, IMPORTANCE = "pixels", "features", "importance"
MAX_EXPORT_BATCH = 64
GRAPH_VERSION = 1  # bump when `_Graph` computes something else: old exports are then ignored
log = logs.get("core.encoders")


class Encoder(Protocol):
    name: str

    def encode(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tiles, 3, H, W) uint8 -> features (tiles, tokens, hidden) float32 and importance
        (tiles, tokens) float32."""
        ...


class _Graph(nn.Module):
    """The exported computation: normalisation fused ahead of the tower, then the projector."""

    def __init__(self, model: Llava) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.encode_with_importance(self.model.normalize(pixels))


class TorchEncoder:
    def __init__(self, model: Llava, bf16: bool = False) -> None:
        self.graph = _Graph(model).eval()
        self.bf16 = bf16
        self.name = "torch-bf16" if bf16 else "torch"

    @torch.inference_mode()
    def encode(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tensor = torch.from_numpy(np.array(pixels, copy=True))
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        )
        with autocast:
            feats, scores = self.graph(tensor)
        return feats.float().numpy(), scores.float().numpy()


def export_onnx(model: Llava, folder: Path) -> Path:
    """The ONNX export of `_Graph` with a dynamic tile axis, cached by encoder digest."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"encoder-{model.encoder_digest()[:16]}-g{GRAPH_VERSION}.onnx"
    if path.exists():
        return path
    size = model.cfg.vision.image_size
    example = torch.zeros((2, 3, size, size), dtype=torch.uint8)
    tiles = torch.export.Dim("tiles", min=1, max=MAX_EXPORT_BATCH)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(
            _Graph(model).eval(),
            (example,),
            str(tmp),
            input_names=[INPUT],
            output_names=[FEATURES, IMPORTANCE],
            dynamic_shapes=({0: tiles},),
            dynamo=True,
            verbose=False,
            external_data=False,
        )
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return path


class OnnxRuntimeEncoder:
    name = "onnxruntime"

    def __init__(self, onnx_path: Path, num_threads: int = 0) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if num_threads > 0:
            opts.intra_op_num_threads = num_threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(
            str(onnx_path), opts, providers=["CPUExecutionProvider"]
        )

    def encode(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feats, scores = self.session.run([FEATURES, IMPORTANCE], {INPUT: pixels})
        return np.asarray(feats, np.float32), np.asarray(scores, np.float32)


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _time(encoder: Encoder, pixels: np.ndarray, repeats: int = 3) -> float:
    encoder.encode(pixels)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        encoder.encode(pixels)
    return (time.perf_counter() - t0) * 1000 / repeats


def build(backend: str, model: Llava, artifacts: Path, num_threads: int = 0) -> Encoder:
    """Builds the named backend (see the module docstring for `auto`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown encoder backend {backend!r}; one of {BACKENDS}")
    if backend == "torch":
        return TorchEncoder(model)
    if backend == "torch-bf16":
        if not _cpu_has_bf16():
            raise ValueError("encoder backend torch-bf16 needs a CPU with native bf16")
        return TorchEncoder(model, bf16=True)
    if backend == "tensorrt" or (backend == "auto" and tensorrt_available()):
        from core.tensorrt_encoder import TensorRTEncoder

        return TensorRTEncoder(
            export_onnx(model, artifacts), artifacts, model.cfg.vision.image_size
        )
    onnx = OnnxRuntimeEncoder(export_onnx(model, artifacts), num_threads)
    if backend == "onnxruntime":
        return onnx
    size = model.cfg.vision.image_size
    probe = np.random.default_rng(0).integers(0, 256, (4, 3, size, size), dtype=np.uint8)
    candidates: list[Encoder] = [TorchEncoder(model), onnx]
    timings = {c.name: _time(c, probe) for c in candidates}
    best = min(candidates, key=lambda c: timings[c.name])
    log.info(
        "encoder_auto", backend=best.name, timings_ms={k: round(v, 2) for k, v in timings.items()}
    )
    return best


def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags

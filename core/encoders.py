"""Vision encoder backends behind one interface: uint8 tiles in, projected features and
per-token importance scores out (float32, on the host, for the cache). All of them run the same
computation, `_Graph`; `onnxruntime` and `tensorrt` run its ONNX export (cached on disk by
encoder digest, graph version and precision).

`torch` runs the graph on the core's device in the core's dtype (`core.device.resolve`).
`tensorrt` builds an engine from the fp16 export (fp32 when the core's dtype is float32); when it
cannot (TensorRT absent, no CUDA device, a failed build or load) it logs one `tensorrt_fallback`
line and serves `torch` instead of stopping the core. `auto` on a CUDA device tries TensorRT
the same way; on the CPU it times torch and ONNX Runtime on a batch of 4 tiles at start and keeps
the faster (the timings are logged).

Families other than LLaVA (Qwen2.5-VL, Gemma 3) bring their own encode of one item
(`ItemModel.encode_item`), run by `ItemEncoder` with torch on the core's device: no ONNX export
of their towers exists yet, so naming `onnxruntime` or `tensorrt` for them logs one
`encoder_backend_unavailable` warning and serves torch (`auto`: the same line at info level).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from core.model.llava import Llava, encode_with_importance
from shared import logs

BACKENDS = ("auto", "torch", "onnxruntime", "tensorrt")
INPUT, FEATURES, IMPORTANCE = "pixels", "features", "importance"
MAX_EXPORT_BATCH = 64
GRAPH_VERSION = 2  # bump when `_Graph` computes something else: old exports are then ignored
PRECISIONS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
CPU = torch.device("cpu")
log = logs.get("core.encoders")


class Encoder(Protocol):
    name: str
    # True: output rows are the input's views (tiles), so items of one view shape may share a
    # batch and be split back by views. False: one item per call, one row out (native items,
    # whose tokens come from attention over the whole item).
    per_view: bool

    def encode(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(views, 3, H, W) uint8 -> features (rows, tokens, hidden) float32 and importance
        (rows, tokens) float32; rows = views when `per_view`, else 1."""
        ...


class ItemModel(Protocol):
    """A family that encodes its own items (`core.model.qwen2_5_vl.QwenVL`, `gemma3.Gemma3`)."""

    def encode_item(self, pixels_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One item's uint8 (views or frames, 3, H, W), on the model's device -> features
        (tokens, hidden) and importance (tokens,), in prompt order."""
        ...


class _Stream:
    """On CUDA, a stream of the encoder's own, so its kernels overlap the language model's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None

    def __call__(self) -> contextlib.AbstractContextManager[object]:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        return torch.cuda.stream(self._stream)


class _Graph(nn.Module):
    """The computation every backend runs: uint8 pixels normalised in float32 (one affine step
    fused ahead of the tower), cast to the weights' dtype, vision tower + projector (+ importance),
    and the outputs cast to float32 on the device, so the host receives what the cache stores.
    It holds the model's encoder modules, not the model: placing it moves only those."""

    pixel_scale: torch.Tensor
    pixel_shift: torch.Tensor

    def __init__(self, model: Llava) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.tower = model.vision_tower
        self.projector = model.multi_modal_projector
        self.register_buffer("pixel_scale", model.pixel_scale, persistent=False)
        self.register_buffer("pixel_shift", model.pixel_shift, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.linear_1.weight.dtype

    def place(self, device: torch.device, dtype: torch.dtype) -> _Graph:
        """Moves the weights to `device` in `dtype`, in place (the model's own encoder modules
        then live there); the normalisation constants stay float32, on `device`. `Module.to` is
        skipped when nothing moves: it cannot run on the fake tensors the device tests use."""
        for module in (self.tower, self.projector):
            if any(p.device != device or p.dtype != dtype for p in module.parameters()):
                module.to(device, dtype)
        self.pixel_scale = self.pixel_scale.to(device)
        self.pixel_shift = self.pixel_shift.to(device)
        return self

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (pixels.float() * self.pixel_scale + self.pixel_shift).to(self.dtype)
        feats, scores = encode_with_importance(self.cfg, self.tower, self.projector, x)
        return feats.float(), scores.float()


class TorchEncoder:
    """The graph run eagerly on `device` in `dtype`: the weights move there once, here; each
    batch goes over as uint8 (a quarter of float32's bytes) and is normalised there. On CUDA it
    runs on a stream of its own, so its kernels overlap the language model's."""

    name = "torch"
    per_view = True

    def __init__(
        self, model: Llava, device: torch.device = CPU, dtype: torch.dtype = torch.float32
    ) -> None:
        self.graph = _Graph(model).place(device, dtype).eval()
        self.device, self.dtype = device, dtype
        self._on_stream = _Stream(device)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tiles, 3, H, W) uint8 -> float32 features and scores, on the device."""
        feats, scores = self.graph(pixels.to(self.device, non_blocking=True))
        return feats, scores

    def encode(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        host = torch.from_numpy(np.array(pixels, copy=True))
        with self._on_stream():
            feats, scores = self.forward(host)
            # .cpu() waits for this stream only, not for the language model's kernels
            return feats.cpu().numpy(), scores.cpu().numpy()


class ItemEncoder:
    """A family's `encode_item` run eagerly where its weights are (loaded on the core's device in
    its dtype), the uint8 item going over as it is. `per_view`: the family's tokens are per view
    (Gemma 3's fixed views), so rows come back split by view and items may share a batch."""

    name = "torch"

    def __init__(self, model: ItemModel, device: torch.device, per_view: bool) -> None:
        self.model, self.device, self.per_view = model, device, per_view
        self._on_stream = _Stream(device)

    def encode(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        host = torch.from_numpy(np.array(pixels, copy=True))
        rows = pixels.shape[0] if self.per_view else 1
        with self._on_stream(), torch.inference_mode():
            feats, scores = self.model.encode_item(host.to(self.device, non_blocking=True))
            # .cpu() waits for this stream only, not for the language model's kernels
            out = feats.float().cpu().numpy(), scores.float().cpu().numpy()
        return out[0].reshape(rows, -1, out[0].shape[-1]), out[1].reshape(rows, -1)


def export_onnx(model: Llava, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The ONNX export of `_Graph` with its weights in `dtype` and a dynamic tile axis, cached by
    encoder digest, graph version and precision. Export before the torch encoder places the
    model elsewhere: the digest (the file's name) is that of the weights as they are."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"encoder-{model.encoder_digest()[:16]}-g{GRAPH_VERSION}-{PRECISIONS[dtype]}.onnx"
    path = folder / name
    if path.exists():
        return path
    graph = _Graph(model)
    if graph.dtype != dtype or graph.pixel_scale.device != CPU:
        graph = copy.deepcopy(graph).place(CPU, dtype)  # a copy: the model stays as it is
    size = model.cfg.vision.image_size
    example = torch.zeros((2, 3, size, size), dtype=torch.uint8)
    tiles = torch.export.Dim("tiles", min=1, max=MAX_EXPORT_BATCH)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(
            graph.eval(),
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
    per_view = True

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


def tensorrt_precision(dtype: torch.dtype) -> torch.dtype:
    """The engine's precision for the core's dtype: fp16 for either half type (3 more mantissa
    bits than bf16, and the best-supported TensorRT kernels; CLIP towers are run in fp16 widely),
    fp32 when the operator asked for float32."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def _tensorrt_or_torch(
    model: Llava, artifacts: Path, device: torch.device, dtype: torch.dtype
) -> Encoder:
    """The TensorRT encoder, or, when it cannot be had, the torch encoder after one log line."""
    try:
        from core import tensorrt_encoder as trt

        trt.import_tensorrt(device)  # before the export: no TensorRT or no CUDA fails fast
        precision = tensorrt_precision(dtype)
        onnx = export_onnx(model, artifacts, precision)
        digest, size = model.encoder_digest(), model.cfg.vision.image_size
        return trt.load(onnx, artifacts, device, PRECISIONS[precision], digest, size)
    except Exception as exc:  # any failure to build or load: serve with torch, say why
        reason = getattr(exc, "reason", "TensorRT failed to build or load the engine")
        log.warning(
            "tensorrt_fallback",
            reason=reason,
            error_type=type(exc).__name__,
            where=logs.error_site(exc),
            backend="torch",
        )
        return TorchEncoder(model, device, dtype)


def _time(encoder: Encoder, pixels: np.ndarray, repeats: int = 3) -> float:
    encoder.encode(pixels)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        encoder.encode(pixels)
    return (time.perf_counter() - t0) * 1000 / repeats


def build(
    backend: str,
    model: Llava | ItemModel,
    artifacts: Path,
    num_threads: int = 0,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
    per_view: bool = True,
) -> Encoder:
    """Builds the named backend on `device` in `dtype` (see the module docstring for `auto`).
    ONNX Runtime runs on the CPU in float32 whatever the device. A family with its own
    `encode_item` is served by torch whatever the backend named; `per_view` says whether its
    tokens are per view."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown encoder backend {backend!r}; one of {BACKENDS}")
    if not isinstance(model, Llava):
        if backend != "torch":  # one line: a warning when the operator named the backend
            say = log.info if backend == "auto" else log.warning
            say(
                "encoder_backend_unavailable",
                reason=f"{backend} has no export of this family's encoder",
                model=type(model).__name__,
                backend="torch",
            )
        return ItemEncoder(model, device, per_view)
    if backend == "torch":
        return TorchEncoder(model, device, dtype)
    if backend == "tensorrt" or (backend == "auto" and device.type == "cuda"):
        return _tensorrt_or_torch(model, artifacts, device, dtype)
    onnx = OnnxRuntimeEncoder(export_onnx(model, artifacts), num_threads)
    if backend == "onnxruntime":
        return onnx
    size = model.cfg.vision.image_size
    probe = np.random.default_rng(0).integers(0, 256, (4, 3, size, size), dtype=np.uint8)
    candidates: list[Encoder] = [TorchEncoder(model, device, dtype), onnx]
    timings = {c.name: _time(c, probe) for c in candidates}
    best = min(candidates, key=lambda c: timings[c.name])
    log.info(
        "encoder_auto", backend=best.name, timings_ms={k: round(v, 2) for k, v in timings.items()}
    )
    return best

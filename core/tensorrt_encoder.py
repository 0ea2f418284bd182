"""The TensorRT encoder: a strongly typed engine built from the encoder's ONNX export (fp16 weights
and compute, float32 normalisation and outputs: the precision is the export's, not a builder
flag), with one optimisation profile, cached on disk under `engine_key`.

Supports TensorRT 10 and 11 (pyproject's `gpu` extra pins that range). 11 removed weak typing
(`BuilderFlag.FP16` and friends) and builds every network strongly typed; 10 needs the
`STRONGLY_TYPED` creation flag, which 11 accepts and ignores, so the flag is set when the
installed version has it. Only the name-based tensor API common to both is used.

TensorRT cannot be installed on the development machines: this module imports it lazily (the
key and the reasons are tested everywhere), and its engine path runs only on GPU hosts
(`bench/gpu_check.sh`; the parity test skips elsewhere).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from core.encoders import FEATURES, GRAPH_VERSION, IMPORTANCE, INPUT


@dataclass(frozen=True, slots=True)
class Profile:
    """The optimisation profile: tiles per batch the engine accepts, and the one it is tuned for."""

    min_batch: int  # smallest batch
    opt_batch: int  # the batch kernels are chosen for: the vision queue's default batch
    max_batch: int  # largest batch; bigger ones run in pieces


PROFILE = Profile(min_batch=1, opt_batch=16, max_batch=32)


class TensorRTUnavailable(Exception):
    """Why TensorRT cannot serve on this host; `reason` is ours, fit for a log line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def engine_key(
    digest: str,
    precision: str,
    profile: Profile,
    trt_version: str,
    gpu_name: str,
    capability: tuple[int, int],
) -> str:
    """The engine's file stem, naming everything a serialised engine depends on: the encoder
    weights, the precision, the profile, the TensorRT version (engines do not load across
    versions) and the GPU (kernels are chosen per model and compute capability)."""
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-")
    version = re.sub(r"[^A-Za-z0-9.]+", "-", trt_version)
    batches = f"b{profile.min_batch}-{profile.opt_batch}-{profile.max_batch}"
    major, minor = capability
    return (
        f"encoder-{digest[:16]}-g{GRAPH_VERSION}-{precision}-{batches}"
        f"-trt{version}-{gpu}-sm{major}{minor}"
    )


def import_tensorrt(device: torch.device) -> ModuleType:
    """TensorRT, when it can run here; else TensorRTUnavailable saying why."""
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as exc:
        raise TensorRTUnavailable("tensorrt is not installed (pip install '.[gpu]')") from exc
    if device.type != "cuda":
        raise TensorRTUnavailable("TensorRT needs a CUDA device; the core's device is the CPU")
    major = int(str(trt.__version__).split(".")[0])
    if major not in (10, 11):
        raise TensorRTUnavailable("TensorRT 10 or 11 is needed (the `gpu` extra's range)")
    return trt


def _network_flags(trt: Any) -> int:
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def build_engine(trt: Any, onnx_path: Path, profile: Profile, image_size: int) -> bytes:
    """Parses the export into a strongly typed network and builds the serialised engine."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        raise TensorRTUnavailable(
            f"TensorRT could not parse the ONNX export ({parser.num_errors} errors)"
        )
    config = builder.create_builder_config()
    shape = (3, image_size, image_size)
    opt = builder.create_optimization_profile()
    opt.set_shape(
        INPUT,
        (profile.min_batch, *shape),
        (profile.opt_batch, *shape),
        (profile.max_batch, *shape),
    )
    config.add_optimization_profile(opt)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TensorRTUnavailable("TensorRT failed to build the engine")
    return bytes(serialized)


def _deserialize(trt: Any, data: bytes) -> tuple[Any, Any]:
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(data)
    if engine is None:  # a stale or truncated file, or another TensorRT's engine
        raise TensorRTUnavailable("TensorRT could not deserialise the engine")
    return runtime, engine


def load(
    onnx_path: Path,
    folder: Path,
    device: torch.device,
    precision: str,
    digest: str,
    image_size: int,
) -> TensorRTEncoder:
    """The engine under its key from `folder`, built from `onnx_path` when absent or unreadable."""
    trt = import_tensorrt(device)
    with torch.cuda.device(device):
        name = torch.cuda.get_device_name(device)
        capability = torch.cuda.get_device_capability(device)
        key = engine_key(digest, precision, PROFILE, str(trt.__version__), name, capability)
        path = folder / f"{key}.engine"
        if path.exists():
            try:
                return TensorRTEncoder(trt, *_deserialize(trt, path.read_bytes()), device)
            except TensorRTUnavailable:
                path.unlink(missing_ok=True)  # rebuilt below, once
        data = build_engine(trt, onnx_path, PROFILE, image_size)
        encoder = TensorRTEncoder(trt, *_deserialize(trt, data), device)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: another core never reads half an engine
        return encoder


class TensorRTEncoder:
    name = "tensorrt"
    per_view = True

    def __init__(self, trt: Any, runtime: Any, engine: Any, device: torch.device) -> None:
        self.runtime, self.engine, self.device = runtime, engine, device  # the runtime outlives
        self.context = engine.create_execution_context()
        if self.context is None:
            raise TensorRTUnavailable("TensorRT could not create an execution context")
        self._dtypes = {trt.float32: torch.float32, trt.float16: torch.float16}
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def encode(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        outs = []
        for start in range(0, pixels.shape[0], PROFILE.max_batch):
            outs.append(self._run(pixels[start : start + PROFILE.max_batch]))
        return (np.concatenate([f for f, _ in outs]), np.concatenate([s for _, s in outs]))

    def _run(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            x = torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device)
            self.context.set_input_shape(INPUT, tuple(x.shape))
            self.context.set_tensor_address(INPUT, x.data_ptr())
            outputs = {}
            for name in (FEATURES, IMPORTANCE):
                shape = tuple(self.context.get_tensor_shape(name))
                dtype = self._dtypes[self.engine.get_tensor_dtype(name)]
                outputs[name] = torch.empty(shape, dtype=dtype, device=self.device)
                self.context.set_tensor_address(name, outputs[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
            feats, scores = (outputs[FEATURES].float().cpu(), outputs[IMPORTANCE].float().cpu())
        return feats.numpy(), scores.numpy()

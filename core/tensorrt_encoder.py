"""The TensorRT encoder: an FP16 engine built from the shared ONNX export, with an optimisation
profile for 1..MAX_BATCH tiles and a timing cache, both cached on disk by encoder digest +
TensorRT version + GPU name. Runs on torch CUDA tensors and a CUDA stream.

Written against the TensorRT 10 Python API; TensorRT cannot be installed on the development
machines, so this module is exercised only on GPU hosts (`bench/gpu_check.sh`).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tensorrt as trt
import torch

from core.encoders import FEATURES, IMPORTANCE, INPUT

MAX_BATCH = 32
OPT_BATCH = 8
_TORCH_DTYPE = {trt.float32: torch.float32, trt.float16: torch.float16}


def _engine_path(onnx_path: Path, folder: Path) -> Path:
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name())
    return folder / f"{onnx_path.stem}-trt{trt.__version__}-{gpu}.engine"


def build_engine(onnx_path: Path, folder: Path, image_size: int) -> bytes:
    """Builds (or reads from disk) the serialised engine."""
    path = _engine_path(onnx_path, folder)
    if path.exists():
        return path.read_bytes()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    shape = (3, image_size, image_size)
    profile = builder.create_optimization_profile()
    profile.set_shape(INPUT, (1, *shape), (OPT_BATCH, *shape), (MAX_BATCH, *shape))
    config.add_optimization_profile(profile)
    timing_path = folder / f"{path.stem}.timing"
    timing = config.create_timing_cache(timing_path.read_bytes() if timing_path.exists() else b"")
    config.set_timing_cache(timing, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT engine build failed")
    data = bytes(serialized)
    folder.mkdir(parents=True, exist_ok=True)
    timing_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return data


class TensorRTEncoder:
    name = "tensorrt"

    def __init__(self, onnx_path: Path, folder: Path, image_size: int) -> None:
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(
            build_engine(onnx_path, folder, image_size)
        )
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def encode(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        outs = []
        for start in range(0, pixels.shape[0], MAX_BATCH):
            outs.append(self._run(pixels[start : start + MAX_BATCH]))
        return (np.concatenate([f for f, _ in outs]), np.concatenate([s for _, s in outs]))

    def _run(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with torch.cuda.stream(self.stream):
            x = torch.from_numpy(np.ascontiguousarray(pixels)).cuda(non_blocking=True)
            self.context.set_input_shape(INPUT, tuple(x.shape))
            self.context.set_tensor_address(INPUT, x.data_ptr())
            outputs = {}
            for name in (FEATURES, IMPORTANCE):
                shape = tuple(self.context.get_tensor_shape(name))
                dtype = _TORCH_DTYPE[self.engine.get_tensor_dtype(name)]
                outputs[name] = torch.empty(shape, dtype=dtype, device="cuda")
                self.context.set_tensor_address(name, outputs[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
        self.stream.synchronize()
        return (outputs[FEATURES].float().cpu().numpy(), outputs[IMPORTANCE].float().cpu().numpy())

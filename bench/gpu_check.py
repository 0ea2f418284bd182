"""The encoder part of `bench/gpu_check.sh`: the torch encoder on the GPU in bf16 and fp16 and,
where TensorRT is installed, the TensorRT engine (build time, parity, timing), each against the
torch float32 encoder on the CPU, at batch 1, 8 and 32. Prints one JSON object."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core import encoders
from core.model import llava
from core.tensorrt_encoder import TensorRTUnavailable, import_tensorrt


def _time(fn: Callable[[], object], repeats: int = 20) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / repeats


def _parity(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    a, b = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return {"min_cosine": round(float(cosine.min()), 6), "max_abs": float(np.abs(a - b).max())}


def main(model_dir: Path) -> dict[str, Any]:
    cuda = torch.device("cuda", 0)
    size = llava.load(model_dir).cfg.vision.image_size
    pixels = {
        b: np.random.default_rng(b).integers(0, 256, (b, 3, size, size), dtype=np.uint8)
        for b in (1, 8, 32)
    }
    reference = encoders.TorchEncoder(llava.load(model_dir))  # float32 on the CPU
    ref = reference.encode(pixels[8])[0]
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(cuda)}
    candidates: dict[str, encoders.Encoder] = {
        "torch_bf16": encoders.TorchEncoder(llava.load(model_dir), cuda, torch.bfloat16),
        "torch_fp16": encoders.TorchEncoder(llava.load(model_dir), cuda, torch.float16),
    }
    try:
        trt = import_tensorrt(cuda)
        folder = Path(tempfile.mkdtemp(prefix="visor-trt-"))
        t0 = time.perf_counter()
        candidates["tensorrt"] = encoders.build(
            "tensorrt", llava.load(model_dir), folder, device=cuda, dtype=torch.float16
        )
        out["tensorrt"] = {"version": str(trt.__version__), "build_s": time.perf_counter() - t0}
        out["tensorrt"]["served_by"] = candidates["tensorrt"].name  # torch = it fell back
    except TensorRTUnavailable as exc:
        out["tensorrt"] = {"absent": exc.reason}
    for name, enc in candidates.items():
        row: dict[str, Any] = {"parity_vs_cpu_fp32": _parity(ref, enc.encode(pixels[8])[0])}
        for batch, px in pixels.items():
            row[f"batch{batch}_ms"] = round(_time(lambda e=enc, p=px: e.encode(p)), 3)
        out[name] = row
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))

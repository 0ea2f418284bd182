"""The body of `bench/gpu_check.sh`: TensorRT engine build, parity with torch FP32 (on the GPU),
and torch eager vs TensorRT timing at batch 1, 8 and 32."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from core.encoders import TorchEncoder, export_onnx
from core.model import llava
from core.tensorrt_encoder import TensorRTEncoder, build_engine


def _time(fn: object, repeats: int = 20) -> float:
    fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / repeats


def main(model_dir: Path) -> dict[str, object]:
    model = llava.load(model_dir)
    size = model.cfg.vision.image_size
    folder = Path(tempfile.mkdtemp(prefix="visor-trt-"))
    onnx = export_onnx(model, folder)
    t0 = time.perf_counter()
    build_engine(onnx, folder, size)
    build_s = time.perf_counter() - t0
    trt_enc = TensorRTEncoder(onnx, folder, size)
    gpu_model = llava.load(model_dir).cuda().eval()
    torch_enc = TorchEncoder(model)
    out: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "engine_build_s": round(build_s, 1),
    }
    pixels = np.random.default_rng(0).integers(0, 256, (8, 3, size, size), dtype=np.uint8)
    ref, _ = torch_enc.encode(pixels)
    got, _ = trt_enc.encode(pixels)
    a, b = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    out["parity"] = {"min_cosine": float(cosine.min()), "max_abs": float(np.abs(ref - got).max())}
    for batch in (1, 8, 32):
        px = np.random.default_rng(batch).integers(0, 256, (batch, 3, size, size), dtype=np.uint8)
        x = torch.from_numpy(px).cuda()

        @torch.inference_mode()
        def eager(x: torch.Tensor = x) -> None:
            gpu_model.encode_with_importance(gpu_model.normalize(x))

        eager_ms = _time(eager)
        trt_ms = _time(lambda px=px: trt_enc.encode(px))
        out[f"batch{batch}"] = {
            "torch_eager_ms": round(eager_ms, 3),
            "tensorrt_ms": round(trt_ms, 3),
            "speedup": round(eager_ms / trt_ms, 2),
        }
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))

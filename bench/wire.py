"""`visor bench wire`: the gateway -> core tensor path, uint8 with normalisation fused into the
encoder (what visor sends) against float32 pre-normalised pixels (what HF-style processors hand a
model), over a real gRPC stream on loopback.

Each path: chunk -> gRPC Infer-like stream -> assemble -> normalise -> vision encoder.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from core.engine import Engine
from core.model.llava import Llava
from shared.proto import core_pb2, core_pb2_grpc
from shared.wire import chunks


class _Sink(core_pb2_grpc.CoreServicer):
    """Receives tensor chunks, rebuilds the tensor and encodes it, as the core does."""

    def __init__(self, engine: Engine, tiles: int) -> None:
        self.engine, self.tiles = engine, tiles

    async def Infer(
        self, it: AsyncIterator[core_pb2.CoreMessage], context: Any
    ) -> AsyncIterator[core_pb2.CoreEvent]:
        header = None
        buf = bytearray()
        async for msg in it:
            if msg.WhichOneof("kind") == "header":
                header = msg.header
            else:
                buf += msg.tensor.data
        assert header is not None
        size = self.engine.info.image_size
        shape = (self.tiles, 3, size, size)
        model = self.engine.model
        assert isinstance(model, Llava)  # the demo model: the wire bench times LLaVA's tiles
        with torch.inference_mode():
            if header.items[0].dtype == "uint8":
                pixels = model.normalize(torch.frombuffer(buf, dtype=torch.uint8).view(shape))
            else:
                pixels = torch.frombuffer(buf, dtype=torch.float32).view(shape)
            model.encode_images(pixels)
        yield core_pb2.CoreEvent(final=core_pb2.CoreFinal(output_tokens=0))


async def _time_path(
    stub: core_pb2_grpc.CoreStub, array: np.ndarray, dtype: str, repeats: int
) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if dtype == "float32":  # the baseline normalises on the sender
            mean = np.array([0.48145466, 0.4578275, 0.40821073], np.float32).reshape(1, 3, 1, 1)
            std = np.array([0.26862954, 0.26130258, 0.27577711], np.float32).reshape(1, 3, 1, 1)
            payload = ((array.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)
        else:
            payload = array

        async def messages(p: np.ndarray = payload) -> AsyncIterator[core_pb2.CoreMessage]:
            header = core_pb2.InferHeader()
            header.items.add(dtype=dtype)
            yield core_pb2.CoreMessage(header=header)
            for piece in chunks(p):
                yield core_pb2.CoreMessage(tensor=core_pb2.TensorChunk(item_index=0, data=piece))

        async for _event in stub.Infer(messages()):
            pass
        times.append((time.perf_counter() - t0) * 1000)
    return times


async def _run(model: Path, tiles: int, repeats: int) -> dict[str, Any]:
    engine = Engine(model, "bench")
    size = engine.info.image_size
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4 << 20)])
    core_pb2_grpc.add_CoreServicer_to_server(_Sink(engine, tiles), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (tiles, 3, size, size), dtype=np.uint8)
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = core_pb2_grpc.CoreStub(channel)  # type: ignore[no-untyped-call]
        await _time_path(stub, array, "uint8", 3)  # warm-up
        for dtype, name in (("float32", "baseline_float32"), ("uint8", "optimised_uint8")):
            ms = await _time_path(stub, array, dtype, repeats)
            out[name] = {
                "wire_bytes": int(array.size * (4 if dtype == "float32" else 1)),
                "p50_ms": round(statistics.median(ms), 3),
                "min_ms": round(min(ms), 3),
            }
    await server.stop(0)
    engine.close()
    base, opt = out["baseline_float32"], out["optimised_uint8"]
    out["ratio_p50"] = round(base["p50_ms"] / opt["p50_ms"], 2)
    out["ratio_bytes"] = round(base["wire_bytes"] / opt["wire_bytes"], 2)
    out.update(tiles=tiles, image_size=size, repeats=repeats, torch_threads=torch.get_num_threads())
    return out


def main(model: Path, tiles: int, repeats: int) -> int:
    print(json.dumps({"bench": "wire", **asyncio.run(_run(model, tiles, repeats))}))
    return 0

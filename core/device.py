"""Where the core's torch work runs: `[core] device` and `dtype` resolved once, at start, into a
torch device and dtype that the encoder and the language model are placed on; the KV cache's
size on that device; and the language model's step crossing between host and device (one copy
each way per step)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from shared.config import ConfigError

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def resolve(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """`auto` device: the first CUDA device when there is one, else the CPU. `auto` dtype: bf16 on
    CUDA (the range of float32, the speed of half precision), float32 on the CPU (bf16 matmuls are
    slower than float32 on CPUs without native bf16). A CUDA device that is absent is refused here,
    at start, rather than at the first request."""
    if device != "auto" and not _DEVICE.fullmatch(device):
        raise ConfigError(f"[core] device must be one of {DEVICES}, not {device!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError(f"[core] dtype must be one of {('auto', *DTYPES)}, not {dtype!r}")
    if device == "auto":
        placed = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    else:
        placed = torch.device(device)
    if placed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = placed.index or 0
        if index >= count:
            raise ConfigError(
                f"[core] device = {device!r}, but this host has {count} CUDA device(s)"
            )
        placed = torch.device("cuda", index)
    if dtype == "auto":
        return placed, torch.bfloat16 if placed.type == "cuda" else torch.float32
    return placed, DTYPES[dtype]


def upload(parts: Sequence[Sequence[float]], device: torch.device) -> list[torch.Tensor]:
    """A step's host inputs (ids, counts, sampling controls) in one host-to-device copy, split
    back into one float64 tensor per part (float64 holds every id and count exactly; callers
    cast). On CUDA it goes from pinned memory without blocking: the copy is queued on the
    stream ahead of the kernels that read it."""
    host = torch.tensor([x for part in parts for x in part], dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory()
    return list(torch.split(host.to(device, non_blocking=True), [len(p) for p in parts]))


def download(values: torch.Tensor) -> list[float]:
    """The step's one device-to-host copy (it waits for the step's kernels), as Python numbers."""
    host: list[float] = values.cpu().tolist()
    return host


def kv_cache_bytes(device: torch.device, kv_cache_mb: int, gpu_memory_fraction: float) -> int:
    """Memory for the paged KV cache: `[scheduler] kv_cache_mb` on the CPU; on CUDA what the
    weights (already loaded) leave of `gpu_memory_fraction` of the device's memory, measured
    now, so the rest of the device stays free for activations and other processes."""
    if device.type != "cuda":
        return kv_cache_mb << 20
    torch.cuda.empty_cache()  # blocks the load freed count as free: the KV cache may have them
    free, total = torch.cuda.mem_get_info(device)
    return gpu_kv_budget(free, total, gpu_memory_fraction)


def gpu_kv_budget(free: int, total: int, fraction: float) -> int:
    """The bytes of `fraction` of `total` not yet in use (`total - free` is: the weights, and
    whatever else runs on the device); never negative."""
    return max(0, int(free - (1 - fraction) * total))

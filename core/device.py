"""Where the core's torch work runs: `[core] device` and `dtype` resolved once, at start, into a
torch device and dtype that the encoder (and the language model) are placed on."""

from __future__ import annotations

import re

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

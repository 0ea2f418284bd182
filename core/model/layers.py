"""Activations and the attention helper shared by the vision tower and the decoder."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported activation {name!r}")

"""Activations shared by the vision towers and decoders, and the image-feature merge every family's
embedding step uses."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def register_pixel_affine(
    module: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]
) -> None:
    """Registers `pixel_scale` and `pixel_shift` on `module` (float32, non-persistent): uint8
    pixels -> (x / 255 - mean) / std in one affine step, fused ahead of the patch embedding."""
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    module.register_buffer("pixel_scale", 1.0 / (255.0 * s), persistent=False)
    module.register_buffer("pixel_shift", -m / s, persistent=False)


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


def embed_with_images(
    embed_tokens: nn.Embedding,
    image_id: int,
    token_ids: list[int] | torch.Tensor,
    image_features: torch.Tensor | None,
) -> torch.Tensor:
    """Token embeddings (whatever scaling `embed_tokens` applies), on the weights' device, with
    image-token positions replaced by image feature rows, in order. The ids are counted on the
    host, without waiting for the device; image ids are embedded as id 0 first, since a
    checkpoint's image id may lie outside its vocabulary."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
    num_image = ids.count(image_id)
    host = torch.tensor([0 if i == image_id else i for i in ids])
    embeds = embed_tokens(host.to(embed_tokens.weight.device))
    if num_image:
        if image_features is None or image_features.shape[0] != num_image:
            have = 0 if image_features is None else image_features.shape[0]
            raise ValueError(f"{num_image} image tokens but {have} image feature rows")
        is_image = torch.tensor([i == image_id for i in ids]).to(embeds.device)
        rows = image_features.to(embeds.device, embeds.dtype)
        embeds = embeds.masked_scatter(is_image[:, None], rows)
    return embeds

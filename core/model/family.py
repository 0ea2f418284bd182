"""Model families: which module serves a checkpoint, chosen by its config.json `model_type`, and
the interface the engine codes against (`VisionLanguageModel`).

A family module exposes `MODEL_TYPES` (the `model_type` values it serves) and
`load(model_dir, device, dtype)`, and raises `ModelConfigError` for a checkpoint it cannot serve.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from core.model import gemma3, llava, llava_onevision, qwen2_5_vl, qwen3_vl
from core.model.config import ModelConfigError, TextConfig

# The paged engine's linear (batch-invariant aware) and attention, as a layer receives them.
Linear = Callable[[nn.Linear, torch.Tensor], torch.Tensor]


class Attend(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """q (heads, tokens, dim), k/v (kv_heads, tokens, dim), rotated -> (tokens, heads * dim),
        with the keys cached and the step's masks applied."""
        ...


class PagedLayer(Protocol):
    sliding_window: int | None  # keys a query sees back from itself (itself included); None = all

    def forward_paged(
        self,
        x: torch.Tensor,
        rope: object,
        attend: Attend,
        linear: Linear,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(tokens, hidden) -> (tokens, hidden): norms, projections, rotary, residuals, MLP;
        `extra` (None, or (tokens, hidden)) is added to the layer's output."""
        ...


class ModelConfig(Protocol):
    @property
    def text(self) -> TextConfig: ...

    @property
    def image_token_id(self) -> int: ...


class Decoder(Protocol):
    @property
    def layers(self) -> nn.ModuleList: ...  # of `PagedLayer`s

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor: ...

    def norm(self, x: torch.Tensor) -> torch.Tensor: ...


class VisionLanguageModel(Protocol):
    """What the engine uses of a loaded model (`core.model.llava.Llava` is one)."""

    bidirectional_images: bool  # a query inside an image also sees that image's later keys

    @property
    def cfg(self) -> ModelConfig: ...

    @property
    def lm_head(self) -> nn.Linear: ...

    @property
    def language_model(self) -> Decoder: ...

    def embed(
        self, token_ids: list[int] | torch.Tensor, image_features: torch.Tensor | None
    ) -> torch.Tensor: ...

    def rope(self, positions: torch.Tensor) -> object:
        """The step's rotary tables from its (tokens,) or (3, tokens) positions; opaque to the
        engine, handed to every layer."""
        ...

    def prompt_positions(
        self,
        ids: list[int],
        grids: list[tuple[int, int, int]],
        seconds: list[float] | None = None,
    ) -> tuple[torch.Tensor | None, int]:
        """The prompt's rope positions (None: 0..n-1) and the delta a generated token's sequence
        index gets added for its position. `seconds` (per video, seconds per temporal patch) is
        passed only to a model that serves video: one with a `video_token_id` attribute, the
        token its prompt repeats per visual token of a video (the others are shown images)."""
        ...

    def encoder_digest(self) -> str: ...


@runtime_checkable
class DeepstackModel(Protocol):
    """A model whose first decoder layers each add a visual input to their output at the visual
    tokens (Qwen3-VL's deepstack): the engine hands layer k the rows of its step as `extra`."""

    def deepstack_rows(
        self, token_ids: list[int] | torch.Tensor, image_features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each prompt token's row (host, long, -1 = none) in a (visual tokens, layers * hidden)
        table on the model's device, layer k's input in columns [k * hidden, (k + 1) * hidden);
        None when the prompt has none."""
        ...


def paged_layers(model: VisionLanguageModel) -> list[PagedLayer]:
    """The decoder's layers, as the paged engine runs them."""
    return [cast(PagedLayer, layer) for layer in model.language_model.layers]


def sliding_windows(model: VisionLanguageModel) -> set[int | None]:
    """The distinct sliding windows of the model's layers (None: a global layer)."""
    return {layer.sliding_window for layer in paged_layers(model)}


FAMILIES: tuple[ModuleType, ...] = (llava, qwen2_5_vl, qwen3_vl, gemma3, llava_onevision)
REGISTRY: dict[str, ModuleType] = {t: family for family in FAMILIES for t in family.MODEL_TYPES}


def model_type(model_dir: Path) -> str:
    """config.json's top-level `model_type`, or ModelConfigError naming what is wrong."""
    path = model_dir / "config.json"
    try:
        raw: Any = json.loads(path.read_text())
    except OSError as exc:
        raise ModelConfigError(f"{path}: cannot be read ({type(exc).__name__})") from None
    except ValueError as exc:
        raise ModelConfigError(f"{path}: not JSON ({exc})") from None
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in REGISTRY:
        supported = ", ".join(sorted(REGISTRY))
        raise ModelConfigError(f"{path}: model_type {kind!r} is not served; supported: {supported}")
    return kind


def load_model(
    model_dir: Path,
    device: torch.device = llava.CPU,
    dtype: torch.dtype = torch.float32,
) -> VisionLanguageModel:
    """The checkpoint in `model_dir`, loaded by the family its config.json names."""
    family = REGISTRY[model_type(model_dir)]
    try:
        model: VisionLanguageModel = family.load(model_dir, device, dtype)
    except ModelConfigError as exc:
        raise ModelConfigError(f"{model_dir / 'config.json'}: {exc}") from None
    return model

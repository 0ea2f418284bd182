"""Reading a checkpoint's safetensors into this package's module names, shared by the families:
one tensor at a time onto the device, projections fused, encoder weights hashed."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from core.model.config import ModelConfigError

# Decoder projections stored apart in checkpoints and run as one GEMM here, in output order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
ENCODER_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def read_state(
    model_dir: Path,
    canonical_name: Callable[[str], str | None],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's `*.safetensors` that `canonical_name` keeps, under that
    name, read straight onto `device` and cast to `dtype` there once (float32 on the CPU is
    exactly the checkpoint's values)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{model_dir.name}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    canonical = canonical_name(name)
                    if canonical is not None:
                        tensor = f.get_tensor(name)
                        floating = tensor.is_floating_point()
                        state[canonical] = tensor.to(dtype) if floating else tensor
        except (OSError, SafetensorError) as exc:
            raise ModelConfigError(
                f"{path.name} is not a readable safetensors file ({type(exc).__name__})"
            ) from None
    return state


def check_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """One line for the first tensor that is missing, unexpected or of the wrong shape."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelConfigError(
            f"the checkpoint lacks {len(missing)} tensor(s) the config implies, e.g. {missing[0]}"
        )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise ModelConfigError(
            f"the checkpoint has {len(extra)} tensor(s) this loader does not know, e.g. {extra[0]}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ModelConfigError(
                f"tensor {name} has shape {tuple(state[name].shape)}; the config implies {shape}"
            )


def fuse(state: dict[str, torch.Tensor], num_layers: int, prefix: str = "language_model") -> None:
    """Concatenates each layer's separately stored projections (`FUSED`) into one tensor."""
    for i in range(num_layers):
        layer = f"{prefix}.layers.{i}."
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{layer}{part}.{kind}" for part in parts]
                if all(name in state for name in names):
                    state[f"{layer}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])


def encoder_digest(model: nn.Module, prefixes: tuple[str, ...] = ENCODER_PREFIXES) -> str:
    """SHA-256 over the encoder's weights (the tensors under `prefixes`), in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if name.startswith(prefixes):
            digest.update(name.encode())
            # Raw bytes (numpy has no bfloat16): float32 weights hash as they always did.
            raw = tensor.detach().contiguous().cpu().view(torch.uint8)
            digest.update(raw.numpy().tobytes())
    return digest.hexdigest()

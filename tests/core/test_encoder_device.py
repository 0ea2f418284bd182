"""The torch encoder on a CUDA device, traced without a GPU: torch's FakeTensorMode runs the
forward of a LLaVA-1.5-7B-shaped encoder (CLIP ViT-L/14 at 336 px + the 4096-wide projector,
random weights that never exist) on device "cuda" in bf16, and every tensor any op makes is
checked: on the device (no host tensor sneaks in), and bf16 from the cast after normalisation to
the float32 outputs. The weights are placed by the test, as fake CUDA tensors: fake tensors cannot
be moved from the host to a CUDA device on a torch built without CUDA."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from core.encoders import TorchEncoder
from core.model.config import parse
from core.model.llava import Llava

CUDA = torch.device("cuda", 0)
LLAVA_15_7B = {  # the vision and projector fields of llava-hf/llava-1.5-7b-hf's config.json
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "image_size": 336,
        "patch_size": 14,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
    },
    "text_config": {"model_type": "llama", "hidden_size": 4096, "vocab_size": 32064},
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "projector_hidden_act": "gelu",
    "image_token_index": 32000,
}


class _Ops(TorchDispatchMode):
    """Records each op's name and the device and dtype of every tensor it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.device, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.device, t.dtype))
        return out


def _fake_on_cuda(module: nn.Module, dtype: torch.dtype) -> None:
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            weight = torch.empty(p.shape, device=CUDA, dtype=dtype).normal_(0, 0.02)
            sub.register_parameter(name, nn.Parameter(weight, requires_grad=False))


def test_the_encoder_forward_runs_on_cuda_in_bf16() -> None:
    cfg = parse(LLAVA_15_7B, {})
    with torch.device("meta"):
        model = Llava(cfg)  # no memory: the 7B decoder is never materialised
    with FakeTensorMode():
        _fake_on_cuda(model.vision_tower, torch.bfloat16)
        _fake_on_cuda(model.multi_modal_projector, torch.bfloat16)
        for name in ("pixel_scale", "pixel_shift"):
            model.register_buffer(name, torch.empty(1, 3, 1, 1, device=CUDA), persistent=False)
        encoder = TorchEncoder(model, CUDA, torch.bfloat16)
        pixels = torch.empty((2, 3, 336, 336), dtype=torch.uint8, device=CUDA)
        with _Ops() as ops:
            feats, scores = encoder.forward(pixels)
    assert feats.shape == (2, 576, 4096) and scores.shape == (2, 576)
    assert feats.device == scores.device == CUDA and feats.dtype == torch.float32
    assert len(ops.seen) > 24 * 10  # the whole tower ran through the recorder
    host = [(op, dev) for op, dev, _ in ops.seen if dev.type != "cuda"]
    assert not host, host[:5]
    dtypes = [dtype for _, _, dtype in ops.seen]
    first, last = dtypes.index(torch.bfloat16), len(dtypes) - 1 - dtypes[::-1].index(torch.bfloat16)
    # Before: the uint8 pixels' move, then float32 normalisation (to, mul, add). After: the two
    # float32 output casts. Between: bf16, apart from what attention kernels keep on the side
    # (float32 softmax statistics, integer RNG state), should the kernel chosen return them.
    assert dtypes[:first] == [torch.uint8] + [torch.float32] * 3
    assert dtypes[last + 1 :] == [torch.float32, torch.float32]
    odd = [(op, d) for op, _, d in ops.seen[first : last + 1] if d != torch.bfloat16]
    assert all("scaled_dot_product" in op for op, _ in odd), odd[:5]

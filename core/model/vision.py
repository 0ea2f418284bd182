"""The vision tower: a CLIP- or SigLIP-style ViT with llava-hf parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.model.config import VisionConfig
from core.model.layers import activation


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        h = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, h // self.num_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h))

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """Attention probabilities (batch, heads, queries, keys) for already-normed input."""
        b, n, h = x.shape
        d = h // self.num_heads
        q = self.q_proj(x).view(b, n, self.num_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_heads, d).transpose(1, 2)
        return torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5, dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_layers))


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.has_class = cfg.kind == "clip"
        self.patch_embedding = nn.Conv2d(
            3, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=not self.has_class
        )
        if self.has_class:
            self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.position_embedding = nn.Embedding(
            cfg.num_patches + int(self.has_class), cfg.hidden_size
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        if self.has_class:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        return x + self.position_embedding.weight.unsqueeze(0)


class VisionTransformer(nn.Module):
    """`vision_model` of a CLIPVisionModel / SiglipVisionModel."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        if cfg.kind == "clip":
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def importance(self, layer_input: torch.Tensor, layer: int) -> torch.Tensor:
        """Per-token importance at `layer`: the attention the class token pays each token (CLIP),
        or, without a class token (SigLIP), the mean attention each token receives."""
        block = self.encoder.layers[layer]
        assert isinstance(block, VisionLayer)
        probs = block.self_attn.probs(block.layer_norm1(layer_input)).mean(dim=1)
        # select, not [:, 0]: Python indexing cannot run on the fake CUDA tensors of the tests
        return probs.select(1, 0) if hasattr(self, "pre_layrnorm") else probs.mean(dim=1)

    def hidden_states(self, pixels: torch.Tensor, upto: int) -> list[torch.Tensor]:
        """Embedding output then every layer's output, stopping after layer `upto`."""
        x = self.embeddings(pixels)
        if hasattr(self, "pre_layrnorm"):
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers[:upto]:
            x = layer(x)
            states.append(x)
        return states


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.vision_model = VisionTransformer(cfg)

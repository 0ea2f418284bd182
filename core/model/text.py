"""The language model: a Llama- or Qwen2-style decoder with a contiguous per-sequence KV cache,
whose layers also run inside the paged engine's step (`DecoderLayer.forward_paged`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from core.model.config import TextConfig

if TYPE_CHECKING:
    from core.model.family import Attend, Linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.reset_buffers()

    def reset_buffers(self) -> None:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.register_buffer("inv_freq", 1.0 / (self.theta**steps), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache:
    """Keys and values of one sequence, per layer: (kv_heads, length, head_dim)."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else int(k.shape[1])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    """Self-attention with the query, key and value projections fused into one GEMM (the loader
    concatenates a checkpoint's `q_proj`, `k_proj`, `v_proj` into `qkv_proj`)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.qkv_proj = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=cfg.kind == "llama" and bias)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., tokens, qkv_proj out) -> queries (..., heads, tokens, dim), keys and values
        (..., kv_heads, tokens, dim)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv * self.head_dim
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
        lead = qkv.shape[:-1]
        return (
            q.reshape(*lead, self.num_heads, self.head_dim).transpose(-3, -2),
            k.reshape(*lead, self.num_kv, self.head_dim).transpose(-3, -2),
            v.reshape(*lead, self.num_kv, self.head_dim).transpose(-3, -2),
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.split(self.qkv_proj(x))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = cache.append(layer, k, v)
        past = k.shape[1] - n
        mask = None
        if n > 1:
            # Query i sits at position past+i and sees keys 0..past+i.
            mask = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            enable_gqa=self.num_kv != self.num_heads,
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    """SwiGLU with the gate and up projections fused into one GEMM (`gate_up_proj`)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    sliding_window: int | None = None  # every layer attends to the whole sequence

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_paged(
        self,
        x: torch.Tensor,
        rope: object,
        attend: Attend,
        linear: Linear,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer inside the paged engine's step: `rope` is `Llava.rope`'s (cos, sin),
        `attend` caches the rotated keys and applies the step's masks, `linear` is the engine's
        (batch-invariant when asked) GEMM, `extra` None or (tokens, hidden) added to the output
        (Qwen3-VL's deepstack features, zero outside visual rows)."""
        cos, sin = cast(tuple[torch.Tensor, torch.Tensor], rope)
        attn, mlp = self.self_attn, self.mlp
        q, k, v = attn.split(linear(attn.qkv_proj, self.input_layernorm(x)))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + linear(attn.o_proj, attend(q, k, v))
        gate_up = linear(mlp.gate_up_proj, self.post_attention_layernorm(x))
        x = x + linear(mlp.down_proj, mlp.act(gate_up))
        return x if extra is None else x + extra.to(x.dtype)


class Decoder(nn.Module):
    """`model` of a LlamaForCausalLM / Qwen2ForCausalLM (the lm_head lives beside it)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Runs (tokens, hidden) embeddings after what `cache` holds; returns normed states."""
        start = cache.length
        positions = torch.arange(start, start + embeds.shape[0])
        cos, sin = self.rotary(positions)
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i)
        return self.norm(x)

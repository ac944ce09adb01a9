"""A Llama-style decoder: RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention.

Separate q/k/v projections (k/v narrower than q when n_kv_head < n_head), no biases, untied
LM head by default. Plain PyTorch; autopar finds its structure from the graph, not its names.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class LlamaStyleConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    n_kv_head: int | None = None   # None: same as n_head (multi-head attention)
    ffn_hidden: int | None = None  # None: Llama's 2/3 · 4 · n_embd rounded up to multiple_of
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"LlamaStyleConfig: n_embd={self.n_embd} is not divisible by "
                             f"n_head={self.n_head}; pick n_embd = n_head · head_dim")
        if self.n_head % self.kv_heads:
            raise ValueError(f"LlamaStyleConfig: n_head={self.n_head} is not divisible by "
                             f"n_kv_head={self.kv_heads}; each kv head serves a whole group "
                             f"of query heads")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        f = int(2 * 4 * self.n_embd / 3)
        return self.multiple_of * ((f + self.multiple_of - 1) // self.multiple_of)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · weight (computed in fp32)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, nh, T, hd); cos/sin: (T, hd)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaStyleConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)     # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = self.n_head // self.n_kv_head
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)                              # (B, nh, T, hd)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hd)    # (B, T, C)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x))."""

    def __init__(self, config: LlamaStyleConfig):
        super().__init__()
        f = config.ffn
        self.gate_proj = nn.Linear(config.n_embd, f, bias=False)
        self.up_proj = nn.Linear(config.n_embd, f, bias=False)
        self.down_proj = nn.Linear(f, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaStyleConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaStyle(nn.Module):
    """forward(idx: (B, T) int64) -> logits (B, T, vocab_size)."""

    def __init__(self, config: LlamaStyleConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hd)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]                    # (T, hd)
        x = self.embed(idx)                                                 # (B, T, C)
        if cos.dtype != x.dtype:   # bf16 weights: rotate in the compute dtype (as transformers'
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)   # Llama), so q, k and v agree for SDPA
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))                                      # (B, T, V)


def _rope_tables(config: LlamaStyleConfig) -> tuple[torch.Tensor, torch.Tensor]:
    hd = config.n_embd // config.n_head
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    t = torch.arange(config.block_size, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)                                        # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                 # (T, hd)
    return emb.cos(), emb.sin()


def llama_tiny(**overrides: Any) -> LlamaStyleConfig:
    """A small GQA config for tests: 2 layers, 4 query heads, 2 kv heads."""
    config = LlamaStyleConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
                              n_embd=64, ffn_hidden=96)
    return replace(config, **overrides) if overrides else config

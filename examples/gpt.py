"""A nanoGPT-style GPT (fused qkv projection, tied embeddings) and the Megatron GPT presets.

Used by tests, benchmarks and the CLI: `GPT(gpt_preset("gpt3-175b"))` built under
`torch.device("meta")` is how a 175 B model is planned on a laptop. The model is plain PyTorch;
nothing in autopar relies on its attribute names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by "
                             f"n_head={self.n_head}; pick n_embd = n_head · head_dim")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with ONE fused qkv projection (c_attn: C -> 3C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)          # 3 × (B, T, C)
        hd = C // self.n_head
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)           # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)            # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx: (B, T) int64) -> logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self.init_weights)
            # GPT-2 paper: residual projections scaled by 1/sqrt(2·n_layer).
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        """nanoGPT's per-module init (for `apply`, and compile()'s `init=` of a meta model):
        linear and embedding weights N(0, 0.02), linear biases 0."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)                                             # (B, T, C)
        return self.lm_head(self.transformer.ln_f(x))                # (B, T, V)


def lm_cross_entropy(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits (..., V) against targets (...).

    `output` is a logits tensor or an object with a `.logits` attribute (transformers outputs).
    """
    if hasattr(output, "logits"):
        logits = output.logits
    elif isinstance(output, (tuple, list)):
        logits = output[0]
    else:
        logits = output
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


# Table 1 of 2104.04473 (and 1909.08053 for the 1.2 B V100 model): (layers, hidden, heads,
# seq, vocab).
_PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "gpt-1.2b-v100": (40, 1536, 16, 1024, 51200),
    "gpt-1.7b": (24, 2304, 24, 2048, 51200),
    "gpt-18b": (40, 6144, 48, 2048, 51200),
    "gpt-39b": (48, 8192, 64, 2048, 51200),
    "gpt-76b": (60, 10240, 80, 2048, 51200),
    "gpt-145b": (80, 12288, 96, 2048, 51200),
    "gpt-162b": (32, 20480, 128, 2048, 51200),
    "gpt3-175b": (96, 12288, 96, 2048, 51200),
    "gpt-310b": (96, 16384, 128, 2048, 51200),
    "gpt-530b": (105, 20480, 128, 2048, 51200),
    "megatron-1t": (128, 25600, 160, 2048, 51200),
}

GPT_PRESETS: tuple[str, ...] = tuple(_PRESETS)


def gpt_preset(name: str, **overrides: Any) -> GPTConfig:
    """GPTConfig of a Megatron-paper GPT; `overrides` replace fields (e.g. n_layer=2)."""
    if name not in _PRESETS:
        raise ValueError(f"gpt_preset: unknown preset {name!r}; known presets are "
                         f"{', '.join(_PRESETS)}")
    n_layer, n_embd, n_head, seq, vocab = _PRESETS[name]
    config = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head,
                       n_embd=n_embd)
    return replace(config, **overrides) if overrides else config

"""Model presets for the command line, built on the meta device so a 1T-parameter model plans on
a laptop: the GPT family of the Megatron-LM papers (the examples' GPT, `autopar.examples.gpt`,
with the published dimensions), Llama 3 405B (the unmodified `transformers`
LlamaForCausalLM with the published configuration) and the encoder-decoder T5-11B (the
unmodified T5ForConditionalGeneration). `file.py:factory` loads any user model
instead (the contract of autopar.factory: the model, or a dict with the model and optionally
example_inputs, loss_fn and example_targets).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from autopar.factory import UserModel, load_factory


@dataclass(frozen=True, kw_only=True)
class PresetDefaults:
    """Published training setup of a preset: global batch and GPU count (2104.04473 Table 1),
    and the sequence length when it is not the model's context (Llama 3: 8K pre-training)."""
    global_batch_size: int
    gpus: int
    seq_len: int | None = None


# Global batch and GPUs of 2104.04473 Table 1 (and 1909.08053 for the V100 model).
PRESET_DEFAULTS: dict[str, PresetDefaults] = {
    "gpt-1.7b": PresetDefaults(global_batch_size=512, gpus=32),
    "gpt-18b": PresetDefaults(global_batch_size=1024, gpus=256),
    "gpt-39b": PresetDefaults(global_batch_size=1536, gpus=512),
    "gpt-76b": PresetDefaults(global_batch_size=1792, gpus=1024),
    "gpt-145b": PresetDefaults(global_batch_size=2304, gpus=1536),
    "gpt-162b": PresetDefaults(global_batch_size=128, gpus=64),
    "gpt3-175b": PresetDefaults(global_batch_size=1536, gpus=1536),
    "gpt-310b": PresetDefaults(global_batch_size=2160, gpus=1920),
    "gpt-530b": PresetDefaults(global_batch_size=2520, gpus=2520),
    "megatron-1t": PresetDefaults(global_batch_size=3072, gpus=3072),
    "gpt-1.2b-v100": PresetDefaults(global_batch_size=512, gpus=64),
    # 2407.21783 §3.3 / Table 4: 16M tokens per step = 2,048 sequences of 8,192 on 16,384 H100
    "llama3-405b": PresetDefaults(global_batch_size=2048, gpus=16384, seq_len=8192),
    # 1910.10683 §3.7: the final models pre-train on batches of 2^11 sequences of 512 tokens
    # (they ran on TPU v3 slices; 64 GPUs is this project's planning case, issue 17)
    "t5-11b": PresetDefaults(global_batch_size=2048, gpus=64, seq_len=512),
}

# T5-11B (1910.10683 Table 14): d_model 1,024, d_ff 65,536, 128 heads of d_kv 128, 24 encoder
# and 24 decoder blocks, vocabulary 32,128 (the released checkpoint's), ReLU MLP.
T5_11B = dict(vocab_size=32128, d_model=1024, d_ff=65536, d_kv=128, num_heads=128,
              num_layers=24, num_decoder_layers=24)


def t5_11b(*, device: str = "meta") -> torch.nn.Module:
    """T5-11B as the unmodified transformers T5ForConditionalGeneration (on meta by default)."""
    from transformers import T5Config, T5ForConditionalGeneration
    with torch.device(device):
        return T5ForConditionalGeneration(T5Config(use_cache=False, decoder_start_token_id=0,
                                                   pad_token_id=0, **T5_11B))

# Llama 3 405B (2407.21783 Table 3): 126 layers, model dimension 16,384, FFN 53,248, 128
# attention heads, 8 key/value heads, vocabulary 128,256, RoPE base 500,000, untied head.
LLAMA3_405B = dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                   num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                   rope_theta=500000.0, tie_word_embeddings=False)


def llama3_405b(*, seq_len: int = 8192, device: str = "meta") -> torch.nn.Module:
    """Llama 3 405B as the unmodified transformers LlamaForCausalLM (on meta by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(max_position_embeddings=max(seq_len, 8192), use_cache=False,
                      **LLAMA3_405B)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def llama3_convention_flops(B: int, s: int) -> float:
    """FLOPs per step of Llama 3 405B (B sequences of s tokens) as published-results.md compares
    Llama 3: per token 6 × matmul parameters (attention and MLP projections, the LM head) +
    12·l·s·h for attention, counted in full."""
    h, f, l = LLAMA3_405B["hidden_size"], LLAMA3_405B["intermediate_size"], \
        LLAMA3_405B["num_hidden_layers"]
    kv = h * LLAMA3_405B["num_key_value_heads"] // LLAMA3_405B["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f
    matmul = l * per_layer + LLAMA3_405B["vocab_size"] * h
    return B * s * (6 * matmul + 12 * l * s * h)


def preset_names() -> list[str]:
    return sorted(PRESET_DEFAULTS)


def load_model(spec: str, *, seq_len: int | None = None,
               device: str = "meta") -> tuple[UserModel, PresetDefaults | None]:
    """Build the model named by `spec` (a preset name or `file.py:factory`).

    Returns the model with its example inputs (at `seq_len`, else the preset's or the model's
    context) and the preset's defaults (None for a factory).
    """
    if spec == "llama3-405b":
        defaults = PRESET_DEFAULTS[spec]
        seq = seq_len or defaults.seq_len
        model = llama3_405b(seq_len=seq, device=device)
        ids = torch.zeros(1, seq, dtype=torch.long, device=device)
        return UserModel(model=model, example_inputs=(ids,), name=spec), defaults
    if spec == "t5-11b":   # encoder-decoder: source ids, its mask, decoder ids
        defaults = PRESET_DEFAULTS[spec]
        ids = torch.zeros(1, seq_len or defaults.seq_len, dtype=torch.long, device=device)
        return UserModel(model=t5_11b(device=device), name=spec,
                         example_inputs=(ids, torch.ones_like(ids), ids)), defaults
    if spec in PRESET_DEFAULTS:
        from autopar.examples.gpt import GPT, gpt_preset
        cfg = gpt_preset(spec)
        seq = seq_len or cfg.block_size
        if seq > cfg.block_size:
            raise ValueError(f"--seq {seq} exceeds the preset {spec}'s context of "
                             f"{cfg.block_size} positions; pass --seq {cfg.block_size} or less")
        with torch.device(device):
            model = GPT(cfg)
        ids = torch.zeros(1, seq, dtype=torch.long, device=device)
        return UserModel(model=model, example_inputs=(ids,), name=spec), PRESET_DEFAULTS[spec]
    if ":" in spec:
        user = load_factory(spec, device=device)
        return replace(user, example_inputs=user.inputs(seq_len=seq_len, option="--seq")), None
    raise ValueError(f"unknown model {spec!r}: give a preset ({', '.join(preset_names())}) or "
                     f"'path/to/file.py:factory' where factory() returns the model (or a dict "
                     f"with 'model', see autopar.factory)")

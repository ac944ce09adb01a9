"""Shared fixtures: tiny models (hand-written and unmodified transformers), built from configs."""
from __future__ import annotations

import functools

import pytest
import torch

from autopar.testing import preload

# the spawned ranks of the numerics tests build these models: the fork server imports them once
# instead of every rank of every test (~5 s each)
preload(*(f"transformers.models.{m}.modeling_{m}" for m in (
    "gpt2", "llama", "bert", "gpt_neox", "falcon", "gptj", "bloom", "olmo2", "phi")),
    "torch.export", "autopar.examples.gpt", "autopar.examples.llama")

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 128, 16, 48, 4, 3
TINY_MODELS = ("gpt", "llama-style", "hf-gpt2", "hf-llama", "hf-bert")


def make_tiny(name: str, *, n_layer: int = LAYERS, dropout: float = 0.0) -> torch.nn.Module:
    """A tiny model by name (see TINY_MODELS), eval-free: dropout 0 unless asked, seeded."""
    torch.manual_seed(0)
    if name == "gpt":
        from autopar.examples.gpt import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=HEADS,
                             n_embd=HIDDEN, dropout=dropout))
    if name == "llama-style":
        from autopar.examples.llama import LlamaStyle, llama_tiny
        return LlamaStyle(llama_tiny(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer,
                                     n_embd=HIDDEN, n_head=HEADS, n_kv_head=2, ffn_hidden=80))
    import transformers as tf
    if name == "hf-gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=n_layer,
                            n_head=HEADS, use_cache=False, resid_pdrop=dropout,
                            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                            eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg)
    if name == "hf-llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=80,
                             num_hidden_layers=n_layer, num_attention_heads=HEADS,
                             num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)
        return tf.LlamaForCausalLM(cfg)
    if name == "hf-bert":
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=n_layer,
                            num_attention_heads=HEADS, intermediate_size=4 * HIDDEN,
                            max_position_embeddings=SEQ, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout)
        return tf.BertForMaskedLM(cfg)
    raise ValueError(f"make_tiny: unknown model {name!r}; known: {TINY_MODELS}")


def tiny_batch(batch: int = 2, seq: int = SEQ, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, targets), seeded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    tgt = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return ids.to(device), tgt.to(device)


@functools.lru_cache(maxsize=None)
def captured_tiny(name: str, repeat_limit: int | None = None):
    """(model, Captured) with loss, cached across tests (capture takes ~1 s)."""
    from autopar.examples.gpt import lm_cross_entropy
    from autopar.passes.capture import capture
    model = make_tiny(name)
    ids, tgt = tiny_batch()
    return model, capture(model, (ids,), lm_cross_entropy, tgt, repeat_limit=repeat_limit)


@pytest.fixture(params=TINY_MODELS)
def tiny_name(request) -> str:
    return request.param

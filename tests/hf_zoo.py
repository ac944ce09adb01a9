"""Tiny models (2 layers, hidden 32, 4 heads, vocab 64) of architectures beyond the examples'
and GPT-2 / Llama / BERT: unmodified `transformers` models built from configs (no downloads),
and a language model on PyTorch's own nn.TransformerEncoder. Module level: the spawned ranks of
the numerics tests import them by name."""
from __future__ import annotations

import torch

# the sizes every Llama-like config here shares (OLMo-2, Mistral, Qwen3, Gemma)
_LLAMA_LIKE = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                   max_position_embeddings=16, use_cache=False)


# More unmodified `transformers` architectures, each exercising a different way of writing
# attention: fused qkv interleaved per head (GPT-NeoX, partial rotary), fused qkv grouped per kv
# head with `x @ w.T`, index-select and broadcast_to (Falcon's new decoder), rotary through
# stack + flatten (GPT-J), ALiBi through baddbmm on (B·heads, T, d) (BLOOM), and an RMSNorm
# over all heads, i.e. over the split dim (OLMo-2's q/k norm).
def hf_neox(layers: int = 2, hidden_dropout: float = 0.0) -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16, use_cache=False,
        hidden_dropout=hidden_dropout,
        attention_dropout=0.0, rotary_pct=0.5))


def hf_falcon(layers: int = 2, hidden_dropout: float = 0.0) -> torch.nn.Module:
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, vocab_size=64, use_cache=False,
        hidden_dropout=hidden_dropout,
        attention_dropout=0.0))


def hf_gptj() -> torch.nn.Module:
    from transformers import GPTJConfig, GPTJForCausalLM
    return GPTJForCausalLM(GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4,
                                      vocab_size=64, n_positions=16, use_cache=False,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def hf_bloom(layers: int = 2) -> torch.nn.Module:
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(n_layer=layers, hidden_size=32, n_head=4, vocab_size=64,
                                        use_cache=False, hidden_dropout=0.0,
                                        attention_dropout=0.0))


def hf_olmo2() -> torch.nn.Module:
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return Olmo2ForCausalLM(Olmo2Config(**_LLAMA_LIKE))


def hf_mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**_LLAMA_LIKE))


def hf_qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**_LLAMA_LIKE, head_dim=8))


def hf_phi() -> torch.nn.Module:
    from transformers import PhiConfig, PhiForCausalLM
    return PhiForCausalLM(PhiConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16, use_cache=False, partial_rotary_factor=0.5,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))


def hf_opt() -> torch.nn.Module:
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64, vocab_size=64,
        max_position_embeddings=16, word_embed_proj_dim=32, use_cache=False, dropout=0.0,
        attention_dropout=0.0))


def hf_gemma() -> torch.nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(GemmaConfig(**_LLAMA_LIKE, head_dim=8))


def hf_bigcode() -> torch.nn.Module:
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
    return GPTBigCodeForCausalLM(GPTBigCodeConfig(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, use_cache=False,
        multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class TorchEncoderLM(torch.nn.Module):
    """A causal LM on nn.TransformerEncoder: MultiheadAttention's packed in_proj_weight (3E, E)
    is unflattened to (3, E) before q, k, v are picked (F.multi_head_attention_forward)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, seq: int = 16,
                 layers: int = 2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(hidden, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        return self.head(self.enc(self.emb(ids), mask=self.mask[:T, :T], is_causal=True))


def torch_encoder() -> torch.nn.Module:
    return TorchEncoderLM()

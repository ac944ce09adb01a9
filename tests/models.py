"""The tests' tiny models, in one place and under one naming scheme: the hand-written examples
(`gpt`, `llama_style`), unmodified `transformers` models built from configs (`hf_<arch>`; no
downloads) and a language model on PyTorch's own nn.TransformerEncoder (`torch_encoder`).

Every builder takes its sizes as keyword arguments, with the same names throughout — vocab,
seq (positions), layers, heads, kv_heads, hidden, ffn, dropout — and extra config fields as
**config. Defaults are the tensor-parallel tests' sizes: 2 layers, hidden 32, 4 heads (2 kv
heads), ffn 64, vocab 64, 16 positions (llama_style: 32, llama_tiny's block size), dropout 0,
no KV cache. Builders do not seed: `build(name, seed=..)` does, and so do the presets below,
which fix the sizes and seed that a family of tests shares (a changed size or seed is a
changed test):

    pass_model(name)        capture / layers / profile / planner tests: vocab 128, hidden 48,
                            4 heads, 3 layers, seed 0 (with pass_batch and captured)
    runtime_model(name, n)  the Runner against one device: vocab 64, hidden 32, GPT with
                            2 heads, seed 0

Module level: spawned ranks import it by name (the tests/ root is on their sys.path).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

Model = torch.nn.Module


# ---- hand-written examples ----------------------------------------------------------------

def gpt(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4, hidden: int = 32,
        dropout: float = 0.0, **config: Any) -> Model:
    """autopar.examples.gpt (nanoGPT); config: GPTConfig fields (tie_embeddings, bias)."""
    from autopar.examples.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads,
                         n_embd=hidden, dropout=dropout, **config))


def llama_style(*, vocab: int = 64, seq: int = 32, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """autopar.examples.llama: rotary, grouped-query attention, SwiGLU, RMSNorm."""
    from autopar.examples.llama import LlamaStyle, llama_tiny
    return LlamaStyle(llama_tiny(vocab_size=vocab, block_size=seq, n_layer=layers,
                                 n_head=heads, n_kv_head=kv_heads, n_embd=hidden,
                                 ffn_hidden=ffn, **config))


# ---- unmodified transformers models ------------------------------------------------------

def _no_cache(config: dict) -> dict:
    return {"use_cache": False, **config}


def hf_gpt2(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
            hidden: int = 32, dropout: float = 0.0, attn_dropout: float = 0.0,
            **config: Any) -> Model:
    """GPT-2: Conv1D projections; dropout is the residual and embedding one."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=attn_dropout, **_no_cache(config)))


def hf_llama(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
             kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
        **_no_cache(config)))


def _bert_config(vocab, seq, layers, heads, hidden, ffn, dropout, config):
    from transformers import BertConfig
    return BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=ffn, max_position_embeddings=seq,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **config)


def hf_bert(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
            hidden: int = 32, ffn: int = 64, dropout: float = 0.0, **config: Any) -> Model:
    """BERT masked LM: a bidirectional encoder with a dense transform before its head."""
    from transformers import BertForMaskedLM
    return BertForMaskedLM(_bert_config(vocab, seq, layers, heads, hidden, ffn, dropout, config))


# Each of these writes attention another way: fused qkv interleaved per head (GPT-NeoX,
# partial rotary), fused qkv grouped per kv head with `x @ w.T`, index-select and broadcast_to
# (Falcon's new decoder), rotary through stack + flatten (GPT-J), ALiBi through baddbmm on
# (B·heads, T, d) (BLOOM), an RMSNorm over all heads, i.e. over the split dim (OLMo-2's q/k
# norm), multi-query attention inside a fused c_attn (GPT-BigCode).
def hf_neox(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
            hidden: int = 32, ffn: int = 64, dropout: float = 0.0, **config: Any) -> Model:
    """GPT-NeoX; dropout is the hidden (per-branch) one."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=seq,
        hidden_dropout=dropout, attention_dropout=0.0, rotary_pct=0.5, **_no_cache(config)))


def hf_falcon(*, vocab: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
              hidden: int = 32, dropout: float = 0.0, **config: Any) -> Model:
    """Falcon's new decoder architecture; dropout is the hidden one (on the summed attention
    and MLP outputs)."""
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_kv_heads=kv_heads, new_decoder_architecture=True, vocab_size=vocab,
        hidden_dropout=dropout, attention_dropout=0.0, **_no_cache(config)))


def hf_falcon_mq(*, vocab: int = 64, layers: int = 2, heads: int = 4, hidden: int = 32,
                 **config: Any) -> Model:
    """Falcon-7B's architecture: multi-query attention in the fused projection viewed as
    (B, T, heads + 2, d) and cut by slicing and indexing (the one k and v head last)."""
    from transformers import FalconConfig, FalconForCausalLM
    return FalconForCausalLM(FalconConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        new_decoder_architecture=False, multi_query=True, vocab_size=vocab,
        hidden_dropout=0.0, attention_dropout=0.0, **_no_cache(config)))


def hf_gptj(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
            hidden: int = 32, **config: Any) -> Model:
    from transformers import GPTJConfig, GPTJForCausalLM
    return GPTJForCausalLM(GPTJConfig(
        n_layer=layers, n_embd=hidden, n_head=heads, rotary_dim=4, vocab_size=vocab,
        n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        **_no_cache(config)))


def hf_bloom(*, vocab: int = 64, layers: int = 2, heads: int = 4, hidden: int = 32,
             **config: Any) -> Model:
    """BLOOM: ALiBi (one bias tensor read by every layer), no position embeddings."""
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(
        n_layer=layers, hidden_size=hidden, n_head=heads, vocab_size=vocab,
        hidden_dropout=0.0, attention_dropout=0.0, **_no_cache(config)))


def _llama_like(config_cls, vocab, seq, layers, heads, kv_heads, hidden, ffn, config):
    return config_cls(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                      max_position_embeddings=seq, **_no_cache(config))


def hf_olmo2(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
             kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return Olmo2ForCausalLM(_llama_like(Olmo2Config, vocab, seq, layers, heads, kv_heads,
                                        hidden, ffn, config))


def hf_mistral(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(_llama_like(MistralConfig, vocab, seq, layers, heads, kv_heads,
                                          hidden, ffn, config))


def hf_qwen3(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
             kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(_llama_like(Qwen3Config, vocab, seq, layers, heads, kv_heads,
                                        hidden, ffn, {"head_dim": 8, **config}))


def hf_phi3(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
            kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """Phi-3: q, k and v in one fused projection, grouped-query (cut by slicing)."""
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(_llama_like(Phi3Config, vocab, seq, layers, heads, kv_heads,
                                       hidden, ffn, {"pad_token_id": 0, **config}))


def hf_gemma(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
             kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(_llama_like(GemmaConfig, vocab, seq, layers, heads, kv_heads,
                                        hidden, ffn, {"head_dim": 8, **config}))


def hf_apertus(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """Apertus: xIELU activation (its learned scalars, and torch.min(x, eps): a reduction's
    elementwise overload), q/k norms."""
    from transformers import ApertusConfig, ApertusForCausalLM
    return ApertusForCausalLM(_llama_like(ApertusConfig, vocab, seq, layers, heads, kv_heads,
                                          hidden, ffn, {"pad_token_id": 0, **config}))


def hf_nemotron(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """Nemotron: LayerNorm1P (`weight + 1` computed in the block before the norm reads the
    residual), squared-ReLU MLP, partial rotary."""
    from transformers import NemotronConfig, NemotronForCausalLM
    return NemotronForCausalLM(_llama_like(NemotronConfig, vocab, seq, layers, heads, kv_heads,
                                           hidden, ffn, {"pad_token_id": 0, "bos_token_id": 1,
                                                         "eos_token_id": 2, **config}))


def hf_diffllama(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """DiffLlama: differential attention (two softmax maps a head, their values the heads'
    halves side by side); with 2 kv heads its value projection's blocks cannot split t = 2."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM
    return DiffLlamaForCausalLM(_llama_like(DiffLlamaConfig, vocab, seq, layers, heads,
                                            kv_heads, hidden, ffn, config))


def hf_llama4(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """Llama 4 (text): a mixture of experts every layer with a shared expert, the routed
    experts' output added in place into the shared expert's (a row-parallel sum at t > 1)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    return Llama4ForCausalLM(_llama_like(
        Llama4TextConfig, vocab, seq, layers, heads, kv_heads, hidden, ffn,
        {"intermediate_size_mlp": ffn, "num_local_experts": 4, "num_experts_per_tok": 1,
         "head_dim": hidden // heads, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         **config}))


def hf_inkling(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """Inkling: 4 routed experts (grouped matmul, top-2) and 2 shared experts run as batched
    matmuls over every token, weighted per token by the router's gains."""
    from transformers import InklingForCausalLM, InklingTextConfig
    d = hidden // heads
    return InklingForCausalLM(InklingTextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
        swa_num_attention_heads=heads, swa_num_key_value_heads=kv_heads, swa_head_dim=d,
        sliding_window_size=8, intermediate_size=ffn, moe_intermediate_size=ffn // 4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
        max_position_embeddings=4 * seq, rel_extent=seq, **_no_cache(config)))


def hf_phi(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
           hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """Phi: parallel attention and MLP, partial rotary."""
    from transformers import PhiConfig, PhiForCausalLM
    return PhiForCausalLM(PhiConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=seq,
        partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        **_no_cache(config)))


def hf_opt(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
           hidden: int = 32, ffn: int = 64, dropout: float = 0.0, **config: Any) -> Model:
    """OPT; dropout is the residual one (after out_proj, and after fc2 on the (B·T, C) rows)."""
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_dim=ffn,
        vocab_size=vocab, max_position_embeddings=seq, word_embed_proj_dim=hidden,
        dropout=dropout, attention_dropout=0.0, **_no_cache(config)))


def hf_bigcode(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
               hidden: int = 32, **config: Any) -> Model:
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
    return GPTBigCodeForCausalLM(GPTBigCodeConfig(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq,
        multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        **_no_cache(config)))


# Mixture-of-experts: the experts of a layer are 3-D parameters (experts.gate_up_proj
# (E, 2F, H), experts.down_proj (E, H, F)) run through a grouped matmul on the tokens sorted by
# expert; a top-k router (replicated) picks `top_k` of `experts` per token.
def hf_mixtral(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, hidden: int = 32, ffn: int = 64, experts: int = 4,
               top_k: int = 2, **config: Any) -> Model:
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(_llama_like(
        MixtralConfig, vocab, seq, layers, heads, kv_heads, hidden, ffn,
        {"num_local_experts": experts, "num_experts_per_tok": top_k, **config}))


def hf_olmoe(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
             kv_heads: int = 2, hidden: int = 32, ffn: int = 64, experts: int = 4,
             top_k: int = 2, **config: Any) -> Model:
    """OLMoE: Mixtral-like experts, RMSNorm of q and k over all heads (the split dim)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return OlmoeForCausalLM(_llama_like(
        OlmoeConfig, vocab, seq, layers, heads, kv_heads, hidden, ffn,
        {"num_experts": experts, "num_experts_per_tok": top_k, **config}))


def hf_qwen2_moe(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2, hidden: int = 32, ffn: int = 32, experts: int = 4,
                 top_k: int = 2, **config: Any) -> Model:
    """Qwen2-MoE: routed experts plus a shared expert (a dense MLP) behind a one-wide
    sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(_llama_like(
        Qwen2MoeConfig, vocab, seq, layers, heads, kv_heads, hidden, 2 * ffn,
        {"moe_intermediate_size": ffn, "shared_expert_intermediate_size": 2 * ffn,
         "num_experts": experts, "num_experts_per_tok": top_k, **config}))


def hf_qwen3_moe(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2, hidden: int = 32, ffn: int = 64, experts: int = 4,
                 top_k: int = 2, dense: tuple[int, ...] = (0,), **config: Any) -> Model:
    """Qwen3-MoE with dense layers `dense` (mlp_only_layers; DeepSeek-V3's first_k_dense):
    blocks of two kinds in one stack (issue 31)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(_llama_like(
        Qwen3MoeConfig, vocab, seq, layers, heads, kv_heads, hidden, ffn,
        {"head_dim": 8, "moe_intermediate_size": ffn // 2, "num_experts": experts,
         "num_experts_per_tok": top_k, "mlp_only_layers": list(dense), **config}))


def hf_qwen3_moe_alternate(*, layers: int = 4, **sizes: Any) -> Model:
    """Qwen3-MoE with MoE every other layer (decoder_sparse_step=2: layers 1, 3, ... routed,
    0, 2, ... dense), the interleaved-MoE stacks of 2025-26 (issue 32)."""
    return hf_qwen3_moe(layers=layers, dense=(), decoder_sparse_step=2, **sizes)


def hf_smollm3(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, hidden: int = 32, ffn: int = 64,
               rope: tuple[int, ...] = (1, 0), **config: Any) -> Model:
    """SmolLM3: rotary in the layers where `rope` is 1, none (NoPE) in the others."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    return SmolLM3ForCausalLM(_llama_like(
        SmolLM3Config, vocab, seq, layers, heads, kv_heads, hidden, ffn,
        {"no_rope_layers": list(rope), "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         **config}))


def hf_cohere2(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, hidden: int = 32, ffn: int = 64,
               types: tuple[str, ...] = ("sliding_attention", "full_attention"),
               **config: Any) -> Model:
    """Cohere2: sliding-window layers with rotary, full-attention layers without: graphs
    differ by layer."""
    from transformers import Cohere2Config, Cohere2ForCausalLM
    return Cohere2ForCausalLM(_llama_like(
        Cohere2Config, vocab, seq, layers, heads, kv_heads, hidden, ffn,
        {"layer_types": list(types), "sliding_window": 4, "pad_token_id": 0, "bos_token_id": 1,
         "eos_token_id": 2, **config}))


def hf_gpt_oss(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, hidden: int = 32, ffn: int = 32, experts: int = 4,
               top_k: int = 2, **config: Any) -> Model:
    """GPT-OSS: attention sinks (one learned logit per head, concatenated to the scores),
    sliding-window and full-attention layers, biased MoE experts."""
    from transformers import GptOssConfig, GptOssForCausalLM
    return GptOssForCausalLM(_llama_like(
        GptOssConfig, vocab, seq, layers, heads, kv_heads, hidden, ffn,
        {"head_dim": 8, "num_local_experts": experts, "num_experts_per_tok": top_k,
         "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"][:layers]
         * max(1, layers // 2), **config}))


def hf_deepseek_v3(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
                   hidden: int = 32, ffn: int = 64, experts: int = 4, top_k: int = 2,
                   dense: int = 1, **config: Any) -> Model:
    """DeepSeek-V3: the first `dense` layers a dense MLP, then MoE layers of routed experts
    (sigmoid scores plus a score-correction bias, group-limited top-k: 2 groups, the best 1)
    and a shared expert; multi-head latent attention (low-rank q and kv projections with their
    own RMSNorm, each head's q/k split into a rotary and a no-rotary part, one rotary key
    shared by the heads)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(DeepseekV3Config(**_no_cache({
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn,
        "moe_intermediate_size": ffn // 4, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "n_shared_experts": 1,
        "n_routed_experts": experts, "num_experts_per_tok": top_k, "n_group": 2,
        "topk_group": 1, "first_k_dense_replace": dense, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
        "max_position_embeddings": seq, **config})))


def hf_vit(*, layers: int = 2, heads: int = 4, hidden: int = 32, ffn: int = 64,
           image: int = 16, patch: int = 4, labels: int = 10, **config: Any) -> Model:
    """ViT image classification: pixels in, no vocabulary; (image/patch)² + 1 tokens."""
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=ffn, image_size=image, patch_size=patch, num_channels=3,
        num_labels=labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **config))


# Encoder-decoder: two stacks of different blocks (the decoder's cross-attend to the encoder's
# output); inputs (input_ids, attention_mask, decoder_input_ids), the models' own positional
# order, and the targets are the decoder's next tokens.
def hf_swin(*, layers: int = 2, heads: int = 2, hidden: int = 16, labels: int = 10,
            **config: Any) -> Model:
    """Swin: two stages of `layers` blocks (widths hidden, 2·hidden; the second block of a
    stage shifts its windows with a roll), a patch-merging step between them; 16×16 pixels."""
    from transformers import SwinConfig, SwinForImageClassification
    return SwinForImageClassification(SwinConfig(
        image_size=16, patch_size=2, embed_dim=hidden, depths=[layers, layers],
        num_heads=[heads, 2 * heads], window_size=2, num_labels=labels, drop_path_rate=0.0,
        **config))


def hf_t5(*, vocab: int = 64, layers: int = 2, heads: int = 4, hidden: int = 32, ffn: int = 64,
          **config: Any) -> Model:
    """T5: relative position bias computed by the first block of each stack and handed on,
    RMSNorm, no biases, tied embeddings (scaled before the LM head)."""
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(
        vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=ffn, num_layers=layers,
        num_heads=heads, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        relative_attention_num_buckets=8, **_no_cache(config)))


def _bart_like(config_cls, vocab, seq, layers, heads, hidden, ffn, config):
    return config_cls(
        vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn, max_position_embeddings=seq, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, **_no_cache(config))


def hf_bart(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
            hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """BART: learned positions, post-norm blocks with biases, tied embeddings."""
    from transformers import BartConfig, BartForConditionalGeneration
    return BartForConditionalGeneration(_bart_like(BartConfig, vocab, seq, layers, heads,
                                                   hidden, ffn, config))


def hf_mbart(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
             hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """mBART: BART with pre-norm blocks and a final norm after each stack."""
    from transformers import MBartConfig, MBartForConditionalGeneration
    return MBartForConditionalGeneration(_bart_like(MBartConfig, vocab, seq, layers, heads,
                                                    hidden, ffn, config))


def hf_umt5(*, vocab: int = 64, layers: int = 2, heads: int = 4, hidden: int = 32,
            ffn: int = 64, **config: Any) -> Model:
    """UMT5: T5 with a relative position bias in every block (no bias handed on)."""
    from transformers import UMT5Config, UMT5ForConditionalGeneration
    return UMT5ForConditionalGeneration(UMT5Config(
        vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=ffn, num_layers=layers,
        num_heads=heads, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        relative_attention_num_buckets=8, **_no_cache(config)))


def hf_whisper(*, vocab: int = 64, layers: int = 2, heads: int = 4, hidden: int = 32,
               ffn: int = 64, mels: int = 8, frames: int = 16, **config: Any) -> Model:
    """Whisper: log-mel features (B, mels, frames) through two convolutions (stride 2) into
    the encoder, token ids into the decoder."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn, num_mel_bins=mels, max_source_positions=frames // 2,
        max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, decoder_start_token_id=0, bos_token_id=0, eos_token_id=0,
        suppress_tokens=[], begin_suppress_tokens=[], **_no_cache(config)))


def hf_bert2bert(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
                 hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """transformers' EncoderDecoderModel of two BERTs: the decoder's layers are the encoder's
    class (BertLayer) with cross-attention added; its own embeddings and LM head."""
    from transformers import EncoderDecoderConfig, EncoderDecoderModel
    enc = _bert_config(vocab, seq, layers, heads, hidden, ffn, 0.0, config)
    dec = _bert_config(vocab, seq, layers, heads, hidden, ffn, 0.0,
                       {"is_decoder": True, "add_cross_attention": True, **config})
    model = EncoderDecoderModel(config=EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec))
    model.config.decoder_start_token_id = model.config.pad_token_id = 0
    return model


def seq2seq_batches(vocab: int, shape: tuple[int, int], steps: int, *, seed: int,
                    features: tuple[int, int] | None = None) -> list:
    """`steps` ((input_ids, attention_mask, decoder_input_ids), targets) of random tokens drawn
    from one generator seeded `seed`; the mask hides a random tail of each source sequence.
    features=(mels, frames): the source is log-mel features (B, mels, frames) instead (Whisper),
    its mask (B, frames) all ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if features is None:
            ids = torch.randint(1, vocab, shape, generator=g)
            keep = torch.randint(shape[1] // 2, shape[1] + 1, (shape[0], 1), generator=g)
            mask = (torch.arange(shape[1]) < keep).long()
        else:
            ids = torch.randn(shape[0], *features, generator=g)
            mask = torch.ones(shape[0], features[1], dtype=torch.long)
        dec = torch.randint(1, vocab, shape, generator=g)
        out.append(((ids, mask, dec), torch.randint(1, vocab, shape, generator=g)))
    return out


def classification_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a classification head's logits (B, labels) against labels (B,)."""
    logits = output.logits if hasattr(output, "logits") else output
    return torch.nn.functional.cross_entropy(logits, labels)


# ---- PyTorch's own encoder -----------------------------------------------------------------

class TorchEncoderLM(torch.nn.Module):
    """A causal LM on nn.TransformerEncoder: MultiheadAttention's packed in_proj_weight (3E, E)
    is unflattened to (3, E) before q, k, v are picked (F.multi_head_attention_forward)."""

    def __init__(self, vocab: int, hidden: int, heads: int, seq: int, layers: int):
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


def torch_encoder(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
                  hidden: int = 32) -> Model:
    return TorchEncoderLM(vocab=vocab, hidden=hidden, heads=heads, seq=seq, layers=layers)


# ---- weight sharing across depth, and no repeated container (issue 31 items 2, 5) -----------

def hf_albert(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
              hidden: int = 32, ffn: int = 64, groups: int = 1, **config: Any) -> Model:
    """ALBERT masked LM, num_hidden_groups=1: one AlbertLayerGroup called at every depth (one
    set of block weights; `groups` of them: each called by layers/groups consecutive layers),
    a factorised embedding (16 wide, projected to hidden), the MLM decoder tied to the word
    embedding."""
    from transformers import AlbertConfig, AlbertForMaskedLM
    return AlbertForMaskedLM(AlbertConfig(
        vocab_size=vocab, embedding_size=16, hidden_size=hidden, num_hidden_layers=layers,
        num_hidden_groups=groups, num_attention_heads=heads, intermediate_size=ffn,
        max_position_embeddings=seq, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0, **config))


class SharedBlockLM(torch.nn.Module):
    """A hand-written decoder that calls one GPT block `layers` times (weights shared across
    depth, as a Universal Transformer), untied head. The block has no biases: a key bias has
    true gradient zero, and its float noise, summed over the calls, AdamW makes steps of."""

    def __init__(self, vocab: int, hidden: int, heads: int, seq: int, layers: int):
        super().__init__()
        from autopar.examples.gpt import Block, GPTConfig
        self.wte = torch.nn.Embedding(vocab, hidden)
        self.wpe = torch.nn.Embedding(seq, hidden)
        self.block = Block(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=1, n_head=heads,
                                     n_embd=hidden, dropout=0.0, bias=False))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.depth = layers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for _ in range(self.depth):
            x = self.block(x)
        return self.head(self.ln_f(x))


def hf_modernbert(*, vocab: int = 64, seq: int = 16, layers: int = 3, heads: int = 4,
                  hidden: int = 32, ffn: int = 64, **config: Any) -> Model:
    """ModernBERT masked LM: its first layer's attention norm is an identity (the others a
    LayerNorm), and global attention every 3rd layer with a sliding window (4 tokens) between:
    layer 0 global without the norm, layers 1-2 local (issue 31's first-layer pattern)."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM
    return ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=seq, global_attn_every_n_layers=3,
        local_attention=4, pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2,
        sep_token_id=1, attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0,
        **config))


def shared_block(*, vocab: int = 64, seq: int = 16, layers: int = 2, heads: int = 4,
                 hidden: int = 32) -> Model:
    return SharedBlockLM(vocab=vocab, hidden=hidden, heads=heads, seq=seq, layers=layers)


class NoListLM(torch.nn.Module):
    """A hand-written decoder layer of distinct named submodules, no ModuleList: an attention
    and an MLP (each a GPT module), their norms, embeddings and the head; the only repeated
    siblings are side by side (the two embeddings) or inside one module (c_fc, c_proj). No
    biases in the attention and MLP (a key bias's gradient is zero: AdamW steps on its noise)."""

    def __init__(self, vocab: int, hidden: int, heads: int, seq: int):
        super().__init__()
        from autopar.examples.gpt import MLP, CausalSelfAttention, GPTConfig
        cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=1, n_head=heads,
                        n_embd=hidden, dropout=0.0, bias=False)
        self.wte = torch.nn.Embedding(vocab, hidden)
        self.wpe = torch.nn.Embedding(seq, hidden)
        self.ln_attn = torch.nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = torch.nn.LayerNorm(hidden)
        self.mlp = MLP(cfg)
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        x = x + self.attn(self.ln_attn(x))
        x = x + self.mlp(self.ln_mlp(x))
        return self.head(self.ln_f(x))


def no_list(*, vocab: int = 64, seq: int = 16, heads: int = 4, hidden: int = 32) -> Model:
    return NoListLM(vocab=vocab, hidden=hidden, heads=heads, seq=seq)


BUILDERS = {f.__name__: f for f in (
    gpt, llama_style, hf_gpt2, hf_llama, hf_bert, hf_neox, hf_falcon, hf_falcon_mq, hf_gptj,
    hf_bloom, hf_olmo2, hf_mistral, hf_qwen3, hf_phi3, hf_gemma, hf_phi, hf_opt, hf_bigcode,
    hf_mixtral, hf_olmoe, hf_qwen2_moe, hf_vit, hf_t5, hf_bart, hf_mbart, hf_umt5, hf_whisper,
    hf_bert2bert, torch_encoder, hf_qwen3_moe, hf_qwen3_moe_alternate, hf_smollm3, hf_cohere2,
    hf_gpt_oss, hf_swin, hf_deepseek_v3, hf_albert, hf_modernbert, shared_block, no_list,
    hf_apertus, hf_nemotron, hf_diffllama, hf_llama4, hf_inkling)}


def build(name: str, *, seed: int, **sizes: Any) -> Model:
    """BUILDERS[name](**sizes) after torch.manual_seed(seed)."""
    if name not in BUILDERS:
        raise ValueError(f"models.build: unknown model {name!r}; known: {sorted(BUILDERS)}")
    torch.manual_seed(seed)
    return BUILDERS[name](**sizes)


def token_batches(vocab: int, shape: tuple[int, ...], steps: int, *,
                  seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` (input_ids, targets) pairs of uniform random tokens of `shape`, drawn in that
    order from one generator seeded `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, shape, generator=g),
             torch.randint(0, vocab, shape, generator=g)) for _ in range(steps)]


# ---- preset: the pass tests' sizes -----------------------------------------------------------

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 128, 16, 48, 4, 3
PASS_MODELS = ("gpt", "llama_style", "hf_gpt2", "hf_llama", "hf_bert")


def pass_model(name: str, *, layers: int = LAYERS, dropout: float = 0.0) -> Model:
    """One of PASS_MODELS at vocab 128, hidden 48, 4 heads, `layers` layers, seed 0; dropout
    (GPT, GPT-2, BERT) 0 unless asked."""
    sizes = dict(vocab=VOCAB, seq=SEQ, hidden=HIDDEN, heads=HEADS, layers=layers)
    torch.manual_seed(0)
    if name == "gpt":
        return gpt(**sizes, dropout=dropout)
    if name == "llama_style":
        return llama_style(**sizes, kv_heads=2, ffn=80)
    if name == "hf_gpt2":
        return hf_gpt2(**sizes, dropout=dropout, attn_dropout=dropout, bos_token_id=0,
                       eos_token_id=0)
    if name == "hf_llama":
        return hf_llama(**sizes, kv_heads=2, ffn=80)
    if name == "hf_bert":
        return hf_bert(**sizes, ffn=4 * HIDDEN, dropout=dropout)
    raise ValueError(f"pass_model: unknown model {name!r}; known: {PASS_MODELS}")


def pass_batch(batch: int = 2, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, targets) for pass_model, seeded."""
    return token_batches(VOCAB, (batch, seq), 1, seed=1)[0]


@functools.lru_cache(maxsize=None)
def captured(name: str, repeat_limit: int | None = None):
    """(pass_model(name), its Captured graph with the loss), cached across tests (~1 s)."""
    from autopar.examples.gpt import lm_cross_entropy
    from autopar.passes.capture import capture
    model = pass_model(name)
    ids, tgt = pass_batch()
    return model, capture(model, (ids,), lm_cross_entropy, tgt, repeat_limit=repeat_limit)


# ---- preset: the runtime numerics' sizes ---------------------------------------------------

RUNTIME_VOCAB = 64
RUNTIME_MODELS = ("gpt", "gpt_untied", "llama_style", "hf_gpt2", "hf_llama", "hf_falcon",
                  "hf_bloom", "hf_mistral", "hf_neox", "hf_mixtral", "hf_qwen3",
                  "hf_gemma", "hf_olmo2")
# the other decoder architectures at their builders' default sizes (hidden 32, 4 heads)
DECODERS = ("hf_falcon_mq", "hf_gptj", "hf_phi3", "hf_phi", "hf_opt", "hf_bigcode",
            "torch_encoder", "hf_olmoe", "hf_qwen2_moe")


def runtime_model(name: str, layers: int) -> Model:
    """One of RUNTIME_MODELS, DECODERS or hf_deepseek_v3 at vocab 64, hidden 32, 16
    positions, seed 0: the same model in every process (GPT: 2 heads; the transformers ones
    keep their default KV cache setting)."""
    torch.manual_seed(0)
    if name in ("gpt", "gpt_untied"):
        return gpt(layers=layers, heads=2, tie_embeddings=name == "gpt")
    if name == "llama_style":
        return llama_style(layers=layers, seq=16, ffn=48)
    if name == "hf_gpt2":
        return hf_gpt2(layers=layers, heads=2, use_cache=True)
    if name == "hf_llama":
        return hf_llama(layers=layers, ffn=48, use_cache=True)
    if name == "hf_falcon":    # fused qkv grouped per kv head (new decoder architecture)
        return hf_falcon(layers=layers)
    if name == "hf_bloom":     # ALiBi: one bias tensor read by every layer
        return hf_bloom(layers=layers)
    if name == "hf_mistral":   # a sliding window (4) shorter than the runtime sequence (8)
        return hf_mistral(layers=layers, ffn=48, sliding_window=4)
    if name == "hf_neox":      # partial rotary (rotary_pct 0.5), parallel attention + MLP
        return hf_neox(layers=layers, ffn=48)
    if name == "hf_mixtral":   # 4 experts per layer, top-2
        return hf_mixtral(layers=layers)
    if name == "hf_qwen3":     # RMSNorm of q and k per head, each upcast to fp32
        return hf_qwen3(layers=layers, ffn=48)
    if name == "hf_gemma":     # RMSNorm scaled by (1 + weight) in fp32, embedding × sqrt(C)
        return hf_gemma(layers=layers, ffn=48)
    if name == "hf_olmo2":     # RMSNorm of q and k over all heads (the split dim), upcast
        return hf_olmo2(layers=layers, ffn=48)
    if name in DECODERS:
        return BUILDERS[name](layers=layers)
    if name == "hf_deepseek_v3":   # latent attention, group-limited routing (not in DECODERS)
        return hf_deepseek_v3(layers=layers)
    raise ValueError(f"runtime_model: unknown model {name!r}; known: "
                     f"{RUNTIME_MODELS + DECODERS + ('hf_deepseek_v3',)}")

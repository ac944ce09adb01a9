"""Planning unmodified `transformers` architectures beyond decoder-only LMs (issue 17): models
without a vocabulary (ViT), mixture-of-experts, encoder-decoder (T5); single process, nothing
spawned."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.model import padded_vocab, vocab_pad_ratio

import models


def _vit_batch(batch: int = 4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)


def test_vocab_pad_ratio_is_one_without_a_vocabulary():
    assert vocab_pad_ratio(0, 8) == 1.0
    assert vocab_pad_ratio(50257, 8) == padded_vocab(50257, 8) / 50257


def test_vit_plans_without_a_vocabulary():
    """ViT: no vocabulary (the cost model used to divide by zero), pixels in; the profile's
    sequence is the tokens the blocks see (16 patches + the class token), not the channels;
    no sequence parallelism (no token ids to split)."""
    px, labels = _vit_batch()
    prog = autopar.parallelize(models.build("hf_vit", seed=0), 8, example_inputs=(px,),
                               loss_fn=models.classification_loss, example_targets=labels,
                               global_batch_size=16, t=2)
    assert prog.profile.vocab == 0 and prog.profile.seq_len == 17
    assert prog.plan.t == 2 and not prog.plan.sequence_parallel
    assert prog.plan.predicted.step_time_s > 0
    assert "tensor parallel t=2" in prog.plan.explain()


def test_default_targets_of_pixels_ask_for_example_targets():
    px, _ = _vit_batch()
    with pytest.raises(ValueError, match="pass example_targets=") as e:
        autopar.parallelize(models.build("hf_vit", seed=0), 2, example_inputs=(px,),
                            loss_fn=models.classification_loss)
    assert "\n" not in str(e.value)


def _moe_profile(top_k: int):
    from autopar.examples.gpt import lm_cross_entropy
    from autopar.passes.capture import capture
    from autopar.passes.layers import find_layers
    from autopar.passes.graph_profile import profile_from_graph
    model = models.build("hf_mixtral", seed=0, experts=4, top_k=top_k)
    ids = torch.randint(0, 64, (2, 8))
    captured = capture(model, (ids,), lm_cross_entropy, ids)
    return profile_from_graph(captured, find_layers(captured.gm))


def test_moe_profile_prices_the_chosen_experts_and_holds_all_of_them():
    """The experts' grouped matmuls cost the FLOPs of the k experts a token is routed to (rows
    = tokens · k), not of all E; their weights (all E experts) are split parameters; the
    router is a replicated GEMM."""
    one, two = _moe_profile(1), _moe_profile(2)
    experts = {k: [g for g in p.block.gemms if g.name == "mlp.experts"] for k, p in
               ((1, one), (2, two))}
    assert [g.tp_split for g in experts[2]] == ["n", "k"]
    assert [g.m for g in experts[1]] == [8, 8] and [g.m for g in experts[2]] == [16, 16]
    assert sum(g.fwd_flops for g in experts[2]) == 2 * sum(g.fwd_flops for g in experts[1])
    router = [g for g in two.block.gemms if g.name == "mlp.gate"]
    assert [g.tp_split for g in router] == [None]
    # every expert's weights: E·(2F·H + H·F) = 4·(128·32 + 32·64), all split
    assert two.block.params_split_elems >= 4 * (128 * 32 + 32 * 64)
    assert two.block.params_split_elems == one.block.params_split_elems


def test_mixtral_8x7b_like_plans_from_the_meta_device_with_its_experts_split():
    """Mixtral-8x7B's shapes (transformers' MixtralConfig defaults: 32 layers, hidden 4096,
    8 experts of FFN 14336, top-2) on the meta device, 64 A100-80GB, t = 8 pinned: feasible (it
    used to fit under no plan at t = 8, its experts replicated), the experts split."""
    from transformers import MixtralConfig, MixtralForCausalLM
    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(use_cache=False, max_position_embeddings=4096))
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    prog = autopar.parallelize(model, 64, example_inputs=(ids,), loss_fn=autopar.cross_entropy,
                               global_batch_size=512, cluster="dgx-a100-80gb", t=8)
    assert prog.plan.t == 8
    assert prog.plan.predicted.memory_bytes_per_gpu <= 80e9
    experts = [g for g in prog.profile.block.gemms if g.name == "mlp.experts"]
    assert [g.tp_split for g in experts] == ["n", "k"]
    report = prog.plan.explain()
    assert "replicated:" not in report


def test_mixtral_8x7b_like_plans_expert_parallelism_and_explains_it():
    """The same model, nothing pinned: the solver weighs ep (experts over the data-parallel
    ranks) with the other degrees and the ZeRO level (every level runs with ep > 1): the plan
    runs and fits with its experts split; pinning ep=8 gives a plan with 8 experts' ranks,
    priced (the all-to-alls in the terms), printed and explained, that compile accepts."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from autopar.compile import check_program
    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(use_cache=False, max_position_embeddings=4096))
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    kw = dict(example_inputs=(ids,), loss_fn=autopar.cross_entropy, global_batch_size=512,
              cluster="dgx-a100-80gb")
    free = autopar.parallelize(model, 64, **kw).plan
    assert free.t <= 8 and free.predicted.memory_bytes_per_gpu <= 80e9
    assert free.t > 1 or free.ep > 1                 # the experts are split one way or both
    check_program(free)                              # a free plan runs
    pinned = autopar.parallelize(model, 64, ep=8, **kw).plan
    assert pinned.ep == 8 and (pinned.c * pinned.d) % 8 == 0 and pinned.t <= 8
    assert pinned.predicted.memory_bytes_per_gpu <= 80e9 and pinned.predicted.ep_comm_s > 0
    assert "ep=8 (experts over 8" in str(pinned) and "expert-parallel comm" in str(pinned)
    assert "Expert parallelism ep=8: " in pinned.explain()
    check_program(pinned)


def test_vit_h_like_plans_from_the_meta_device():
    """ViT-H/14's shapes (32 layers, hidden 1280, 16 heads, FFN 5120, 224² pixels in 14²
    patches: 257 tokens) on the meta device, 64 A100-80GB: a plan, explained."""
    from transformers import ViTConfig, ViTForImageClassification
    with torch.device("meta"):
        model = ViTForImageClassification(ViTConfig(
            hidden_size=1280, num_hidden_layers=32, num_attention_heads=16,
            intermediate_size=5120, image_size=224, patch_size=14, num_labels=1000))
    px = torch.zeros(1, 3, 224, 224, device="meta")
    labels = torch.zeros(1, dtype=torch.long, device="meta")
    prog = autopar.parallelize(model, 64, example_inputs=(px,), loss_fn=models.classification_loss,
                               example_targets=labels, global_batch_size=4096, t=2)
    assert prog.profile.seq_len == 257 and prog.profile.vocab == 0
    assert "replicated:" not in prog.plan.explain()


def _t5_11b_like():
    """T5-11B's shapes (d_model 1024, d_ff 65536, 128 heads of 128, 24 + 24 layers, vocab
    32128) on the meta device, with 512-token sources and targets."""
    from transformers import T5Config, T5ForConditionalGeneration
    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(
            vocab_size=32128, d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_heads=128,
            use_cache=False, decoder_start_token_id=0, pad_token_id=0))
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")
    return model, (ids, torch.ones_like(ids), ids)


def _check_layers_placed(plan, encoder: int, decoder: int) -> None:
    """The stages cover the encoder's then the decoder's layers, each exactly once."""
    assert plan.num_layers == encoder + decoder
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].last_layer == encoder + decoder
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert a.last_layer == b.first_layer


def test_t5_11b_like_plans_from_the_meta_device_with_both_stacks_placed():
    """64 A100-80GB: a feasible plan whose stages hold all 48 layers; explain() says which
    layers are the encoder's and which the decoder's, and how they were priced."""
    model, inputs = _t5_11b_like()
    prog = autopar.parallelize(model, 64, example_inputs=inputs, loss_fn=autopar.cross_entropy,
                               global_batch_size=512, cluster="dgx-a100-80gb")
    plan = prog.plan
    assert plan.predicted.memory_bytes_per_gpu <= 80e9 and plan.predicted.step_time_s > 0
    _check_layers_placed(plan, 24, 24)
    assert [k.num_layers for k in prog.profile.layer_kinds] == [24, 24]
    enc, dec = prog.profile.layer_kinds
    assert dec.fwd_flops > enc.fwd_flops    # the decoder's cross-attention
    report = plan.explain()
    assert "layers [0, 24): encoder.block" in report and "layers [24, 48): decoder.block" in report
    assert "tensor parallel" in report or plan.t == 1


def test_t5_11b_like_pipeline_cuts_balance_the_heavier_decoder_layers():
    """p = 4 pinned: the cuts fall inside the stacks, and a stage of encoder layers holds
    more of them than a stage of the heavier decoder layers."""
    model, inputs = _t5_11b_like()
    prog = autopar.parallelize(model, 64, example_inputs=inputs, loss_fn=autopar.cross_entropy,
                               global_batch_size=512, cluster="dgx-a100-80gb", p=4, v=1)
    plan = prog.plan
    _check_layers_placed(plan, 24, 24)
    counts = [st.num_layers for st in plan.stages]
    assert len(counts) == 4 and all(counts), counts
    assert any(0 < st.first_layer < 24 or 24 < st.first_layer < 48 for st in plan.stages[1:])
    assert counts[1] > counts[2], counts   # stage 1: encoder layers; stage 2: decoder layers


def test_encoder_decoder_of_unequal_depths_is_refused_in_one_line():
    """The planner prices units of one layer of each stack: stacks of different depths are
    refused, naming both and the fix (a hand-made plan compiles)."""
    model = models.build("hf_t5", seed=0, num_decoder_layers=3)
    (ids, mask, dec), tgt = models.seq2seq_batches(64, (2, 8), 1, seed=0)[0]
    with pytest.raises(ValueError, match="different depths") as e:
        autopar.parallelize(model, 2, example_inputs=(ids, mask, dec),
                            loss_fn=autopar.cross_entropy, example_targets=tgt)
    assert "\n" not in str(e.value) and "plan=" in str(e.value)


def test_encoder_decoder_profile_prices_each_stack_at_its_own_length():
    """Whisper: 8 encoder frames (16 features through a stride-2 convolution), 12 decoder
    tokens. The unit's tensor-parallel all-reduces are each row-parallel GEMM's output at its
    stack's length: the encoder's attention output and fc2 at 8 tokens, the decoder's self-
    and cross-attention outputs and fc2 at 12; the kinds' FLOPs put the decoder heavier."""
    from autopar.passes.capture import capture
    from autopar.passes.layers import find_layers
    from autopar.passes.graph_profile import profile_from_graph
    (x, mask, dec), y = models.seq2seq_batches(64, (2, 12), 1, seed=0, features=(8, 16))[0]
    cap = capture(models.build("hf_whisper", seed=0), (x, mask, dec), autopar.cross_entropy,
                  y, repeat_limit=2)
    prof = profile_from_graph(cap, find_layers(cap))
    assert prof.num_layers == 2 and [k.num_layers for k in prof.layer_kinds] == [2, 2]
    assert prof.block.tp_allreduce_elems == 32 * (2 * 8 + 3 * 12)
    assert prof.layer_kinds[1].fwd_flops > prof.layer_kinds[0].fwd_flops


def test_t5_position_bias_table_splits_by_heads():
    """T5's relative position bias is an embedding of bucket ids computed from positions whose
    columns are the heads, added to the attention mask: at t = 2 its table splits by columns
    (each rank looks up its own heads, no reduction), not by rows as a vocabulary would, and
    nothing stays replicated."""
    from autopar.passes import meta as K
    from autopar.passes.capture import capture
    from autopar.passes.tensor_parallel import param_splits, propagate_sharding
    (ids, mask, dec), y = models.seq2seq_batches(64, (2, 8), 1, seed=0)[0]
    cap = capture(models.build("hf_t5", seed=0), (ids, mask, dec), autopar.cross_entropy, y)
    gm = propagate_sharding(cap.gm, 2, strict=False)
    bias = {k: split for k, (split, _) in param_splits(gm).items() if "relative_attention" in k}
    assert len(bias) == 2 and all(s.dim == 1 for s in bias.values()), bias
    assert not gm.meta[K.TP_INFO].fallbacks


def test_multi_query_plan_explains_no_replicated_attention():
    """GPT-BigCode planned at t = 2: the explanation reports nothing kept replicated (its
    multi-query c_attn split in part), and the plan prices its whole k/v rows."""
    ids = torch.randint(0, 64, (2, 16))
    prog = autopar.parallelize(models.build("hf_bigcode", seed=0), 2, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=4, t=2,
                               cluster="local-cpu")
    assert prog.plan.t == 2
    report = prog.plan.explain()
    assert "tensor parallel t=2" in report and "replicated:" not in report
    c = prog.profile.tp_correction(2, prog.plan.sequence_parallel)
    assert c is not None and c.block.params_elems > 0 and c.block.whole_columns

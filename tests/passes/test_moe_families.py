"""Planning the MoE families of issue 32 item 2 from the captured model: DeepSeek-V3's
multi-head latent attention (a fused k/v up-projection whose k and v head dims differ, the
rotary part of k from the low-rank projection) reads as 4 heads of 4, not a grouping, and at
t = 2 the plan says which latent projections propagation held whole and why."""
from __future__ import annotations

import torch

import autopar

import models


def test_deepseek_v3_plans_at_t2_and_explains_its_latent_projections():
    model = models.build("hf_deepseek_v3", seed=0)
    ids = torch.zeros(2, 8, dtype=torch.long)
    prog = autopar.parallelize(model, 2, example_inputs=(ids,), loss_fn=autopar.cross_entropy,
                               global_batch_size=2, t=2, cluster="dgx-a100-80gb")
    assert (prog.profile.heads, prog.profile.kv_heads) == (4, 4)
    assert prog.plan.t == 2
    notes = prog.plan.explain()
    assert "tensor parallel t=2:" in notes
    # the low-rank projections' RMSNorm over their whole width holds them whole, named
    assert "a mean over the split dim" in notes and "modeling_deepseek_v3.py" in notes


def test_a_model_whose_sizes_depend_on_the_data_is_refused_in_one_line():
    """JetMoE splits each layer's tokens into one linear per expert by the router's counts
    (`inputs.split(expert_size)`): rows an unbacked size (u0) that no price can count. The
    layer finder reads it as a name; planning refuses it in one line naming the node and the
    user's line, not a GuardOnDataDependentSymNode traceback."""
    import pytest
    from transformers import JetMoeConfig, JetMoeForCausalLM
    torch.manual_seed(0)
    model = JetMoeForCausalLM(JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, use_cache=False))
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^planning: node split_with_sizes .* depends on the "
                                         r"data \(\[u\d+, 32\]\) .*modeling_jetmoe.py"):
        autopar.parallelize(model, 2, example_inputs=(ids,), loss_fn=autopar.cross_entropy,
                            global_batch_size=4, cluster="dgx-a100-80gb")

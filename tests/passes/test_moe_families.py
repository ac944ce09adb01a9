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

"""The context-parallel pass under plan.cp_attention == "ring": scaled-dot-product attention
becomes context_ring_attention on the rank's local q, k, v (no K/V all-gather), the mask's
query rows selected, the kv heads of a grouped-query repeat found by replaying the repeat; a
ring attention with dropout is refused in one line, and parallelize falls back to the
all-gather (or refuses a pinned ring) for it."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.passes.capture import capture
from autopar.passes.context_parallel import apply_context_parallel
from autopar.runtime.context_shard import context_causal_attention, context_gather, context_select
from autopar.runtime.ring_attention import context_ring_attention
from models import gpt, hf_llama, llama_style

SEQ = 16


def _ring(model):
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    gm = capture(model, (ids,), autopar.cross_entropy, ids.clone()).gm
    return apply_context_parallel(copy.deepcopy(gm), 2, SEQ, "ring")


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


@pytest.mark.parametrize("builder, group, masked", [(gpt, 1, False), (llama_style, 2, False),
                                                    (hf_llama, 2, True)])
def test_attention_becomes_the_ring_op_on_local_tokens(builder, group, masked):
    """GPT: is_causal, multi-head. Llama-style: repeat_interleave of 2 kv heads to 4; HF
    Llama: repeat_kv's expand + reshape and an explicit mask (its rows the rank's)."""
    kw = dict(seq=SEQ) if builder is not hf_llama else {}
    gm = _ring(builder(**kw, kv_heads=2) if builder is not gpt else builder(**kw))
    rings = _calls(gm, context_ring_attention)
    assert len(rings) == 2
    assert not _calls(gm, context_gather) and not _calls(gm, context_causal_attention)
    for n in rings:
        q, k, v, cp, mask, causal, _scale, _gqa, kv_group = n.args
        assert kv_group == group
        assert q.meta["val"].shape[2] == k.meta["val"].shape[2] == SEQ // 2   # local tokens
        assert causal is not masked
        if masked:
            assert mask.target is context_select                # the rank's query rows
            assert mask.meta["val"].shape[-2:] == (SEQ // 2, SEQ)


def test_ring_with_attention_dropout_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"context parallelism: node .* ring attention with "
                                         r"attention dropout 0.1 .*cp_attention='all-gather'") \
            as err:
        _ring(gpt(seq=SEQ, dropout=0.1))
    assert "\n" not in str(err.value)


def test_parallelize_pins_ring_refuses_dropout_and_falls_back_when_free():
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    kw = dict(gpus=2, example_inputs=(ids,), loss_fn=autopar.cross_entropy,
              global_batch_size=2, cluster="local-cpu", c=2)
    plan = autopar.parallelize(gpt(seq=SEQ), cp_attention="ring", **kw).plan
    assert (plan.c, plan.cp_attention) == (2, "ring")
    with pytest.raises(ValueError, match=r"^parallelize: cp_attention='ring': context "
                                         r"parallelism: node .*attention dropout"):
        autopar.parallelize(gpt(seq=SEQ, dropout=0.1), cp_attention="ring", **kw)
    free = autopar.parallelize(gpt(seq=SEQ, dropout=0.1), **kw).plan
    assert free.cp_attention == "all-gather"
    assert any(n.startswith("ring attention not offered") for n in free.notes)
    with pytest.raises(ValueError, match=r"^parallelize: cp_attention='rings': must be one of"):
        autopar.parallelize(gpt(seq=SEQ), cp_attention="rings", **kw)


def test_cli_pins_ring(capsys):
    import json

    from autopar.cli import main
    assert main(["plan", "gpt-1.7b", "--gpus", "32", "--c", "2", "--cp-attention", "ring",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["c"], plan["cp_attention"]) == (2, "ring")


def _meta_llama(seq: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=kv_heads,
                      max_position_embeddings=seq, use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("seq, kv_heads, gpus, c, want", [
    (131072, 32, 32, 4, "ring"),        # multi-head, 131K tokens, the context group over 4 nodes
    (4096, 8, 16, 2, "all-gather"),     # grouped-query (1 kv head per tensor rank), in a node
])
def test_parallelize_picks_ring_or_all_gather_by_cost_and_explains(seq, kv_heads, gpus, c, want):
    """The unmodified transformers Llama on the meta device, planned through parallelize (its
    profile from the graph) with t=8 and c pinned: the solver weighs both methods."""
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    plan = autopar.parallelize(_meta_llama(seq, kv_heads), gpus=gpus, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=gpus // 16,
                               cluster="dgx-h100-80gb", t=8, c=c).plan
    assert plan.cp_attention == want
    other = "all-gather" if want == "ring" else "ring"
    line = next(x for x in plan.explain().splitlines() if x.startswith("Context attention"))
    assert line.startswith(f"Context attention {want}:") and f"with {other}" in line

"""The context-parallel pass under plan.cp_attention == "all-to-all": scaled-dot-product
attention becomes context_alltoall_attention on the rank's local q, k, v (no K/V all-gather),
its mask read whole (every query row: after the exchange the rank holds the whole sequence),
the kv heads of a grouped-query repeat found by replaying the repeat; heads that c does not
divide are refused in one line; the CLI pins the method."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.passes.capture import capture
from autopar.passes.context_parallel import apply_context_parallel
from autopar.runtime.context_shard import (context_causal_attention, context_gather,
                                           context_select)
from autopar.runtime.ulysses import context_alltoall_attention
from models import gpt, hf_llama, llama_style

SEQ = 16


def _a2a(model, c: int = 2):
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    gm = capture(model, (ids,), autopar.cross_entropy, ids.clone()).gm
    return apply_context_parallel(copy.deepcopy(gm), c, SEQ, "all-to-all")


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


@pytest.mark.parametrize("builder, group, masked", [(gpt, 1, False), (llama_style, 2, False),
                                                    (hf_llama, 2, True)])
def test_attention_becomes_the_alltoall_op_on_local_tokens(builder, group, masked):
    kw = dict(seq=SEQ) if builder is not hf_llama else {}
    gm = _a2a(builder(**kw, kv_heads=2) if builder is not gpt else builder(**kw))
    ops = _calls(gm, context_alltoall_attention)
    assert len(ops) == 2
    assert not _calls(gm, context_gather) and not _calls(gm, context_causal_attention)
    for n in ops:
        q, k, v, cp, mask, causal, _scale, _gqa, kv_group = n.args[:9]
        assert kv_group == group
        assert q.meta["val"].shape[2] == k.meta["val"].shape[2] == SEQ // 2   # local tokens
        assert n.meta["val"].shape == q.meta["val"].shape
        assert causal is not masked
        if masked:     # whole: the exchange gives the rank every query row
            assert mask.target is not context_select
            assert mask.meta["val"].shape[-2:] == (SEQ, SEQ)


def test_heads_not_divisible_by_c_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"context parallelism: node .*all-to-all attention "
                                         r"with 4 heads .* over c=8 .*cp_attention='all-gather'"
                       ) as err:
        _a2a(gpt(seq=SEQ), c=8)
    assert "\n" not in str(err.value)


def test_cli_pins_alltoall(capsys):
    import json

    from autopar.cli import main
    assert main(["plan", "gpt-1.7b", "--gpus", "32", "--c", "2", "--cp-attention",
                 "all-to-all", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["c"], plan["cp_attention"]) == (2, "all-to-all")


@pytest.mark.parametrize("method", ["all-to-all", "ring"])
def test_attention_written_out_is_refused_under_another_method_than_the_all_gather(method):
    """BLOOM writes its attention out (ALiBi scores by baddbmm, softmax, bmm): only the K/V
    all-gather splits it. The solver never offers another method there; a hand-made plan that
    names one is refused in one line naming the scores node and the user's source line (it
    ran the all-gather without saying so before)."""
    import models
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    gm = capture(models.build("hf_bloom", seed=0), (ids,), autopar.cross_entropy,
                 ids.clone()).gm
    with pytest.raises(ValueError, match=rf"baddbmm.*modeling_bloom.py.*cp_attention='{method}'"
                                         r".*only the all-gather splits; plan "
                                         r"cp_attention='all-gather'"):
        apply_context_parallel(copy.deepcopy(gm), 2, SEQ, method)
    apply_context_parallel(copy.deepcopy(gm), 2, SEQ, "all-gather")   # the all-gather splits it

"""The context-parallel pass on captured graphs (issue 15): what it rewrites, found through
propagation, and the one-line refusals (the node and the user's source line)."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.passes import meta as K
from autopar.passes.capture import capture
from autopar.passes.context_parallel import apply_context_parallel
from autopar.runtime.context_shard import (context_causal_attention, context_gather,
                                           context_loss_mean, context_select)
from models import gpt, llama_style

SEQ = 16


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.cumsum(self.proj(x), dim=1)   # a running sum over the sequence


class RunningSum(torch.nn.Module):
    """Token mixing the pass has no rule for: a cumulative sum along the sequence."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _captured(model):
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    return capture(model, (ids,), autopar.cross_entropy, ids.clone()).gm


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("builder", [gpt, llama_style])
def test_keys_values_gathered_positions_selected_shapes_local(builder):
    gm = apply_context_parallel(copy.deepcopy(_captured(builder(seq=SEQ))), 2, SEQ)
    targets = _targets(gm)
    layers = 2
    assert targets.count(context_gather) == 2 * layers          # k and v of every attention
    assert targets.count(context_causal_attention) == layers    # is_causal: chunk by chunk
    # GPT: the position embedding of arange(T); Llama: the rotary cos/sin slices (q and k)
    assert targets.count(context_select) >= 1
    # the token-mean loss: a sum over the rank's tokens over the count on every context rank
    (mean,) = [n for n in gm.graph.nodes if n.target is context_loss_mean]
    assert mean.args[0].args[3] == 2 and mean.args[3] == -100
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            assert tuple(n.meta[K.VAL].shape) == (2, SEQ // 2)
    # the views that name the sequence take the rank's sizes, as reshapes: a view valid on
    # the whole sequence's strides need not be on the rank's part (torch 2.11's export of
    # nn.MultiheadAttention viewed a permuted (T, B, E), and c = 2 failed there)
    aten = torch.ops.aten
    resized = [n for n in gm.graph.nodes if K.CP_SEQ_DIM in n.meta
               and n.target in (aten.view.default, aten.reshape.default)
               and -1 not in n.args[1]]            # the loss's flattening names no length
    assert resized and all(n.target is aten.reshape.default for n in resized)
    assert all(SEQ not in n.args[1] and SEQ // 2 in n.args[1] for n in resized)


def test_causal_attention_of_the_rank_chunks_equals_the_whole_sequence_rows():
    import torch.nn.functional as F
    from autopar.runtime.context_shard import ContextShard
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for r in range(4):
        cp = ContextShard(group=None, c=4, cp_rank=r, seq_len=16)
        local_q = q.index_select(2, cp.positions)
        got = context_causal_attention(local_q, k, v, cp)
        torch.testing.assert_close(got, whole.index_select(2, cp.positions))


def test_rank_positions_and_selection_of_whole_values():
    from autopar.runtime.context_shard import ContextShard
    cp = ContextShard(group=None, c=2, cp_rank=0, seq_len=8)
    assert cp.positions.tolist() == [0, 1, 6, 7]
    x = torch.arange(8.0)
    assert context_select(x, cp, 0).tolist() == [0.0, 1.0, 6.0, 7.0]
    m = torch.arange(64.0).reshape(8, 8)     # a (T, T) mask: the rank's query rows
    assert context_select(m, cp, 0)[:, 0].tolist() == [0.0, 8.0, 48.0, 56.0]


def test_refusal_names_the_node_and_the_source_line():
    with pytest.raises(ValueError) as err:
        apply_context_parallel(copy.deepcopy(_captured(RunningSum())), 2, SEQ)
    msg = str(err.value)
    assert "\n" not in msg
    assert "cumsum" in msg and "test_context_pass.py" in msg and "torch.cumsum" in msg
    assert "c=1" in msg


def test_parallelize_pinned_c_refuses_and_free_c_falls_back():
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    kw = dict(gpus=2, example_inputs=(ids,), loss_fn=autopar.cross_entropy,
              global_batch_size=2, cluster="local-cpu")
    with pytest.raises(ValueError, match=r"parallelize: c=2: context parallelism: node cumsum"):
        autopar.parallelize(RunningSum(), c=2, **kw)
    plan = autopar.parallelize(RunningSum(), **kw).plan
    assert plan.c == 1
    assert any("context parallelism not offered" in n for n in plan.notes)


def test_mixture_of_experts_routes_each_rank_s_tokens():
    """Mixtral's experts sort the (token, choice) rows by expert: on a context rank the sort
    orders the rank's own rows (Rows), the tokens are gathered by the sort's positions, the
    grouped matmuls read the rank's counts (Counts) as offsets, and the inverse permutation
    (index_put_ of arange by the sort's positions) puts the rows back in sequence order; the
    rewrite makes arange the rank's row count, and parallelize may offer c. The router's
    load-balancing loss reads its counts and its probabilities summed over the tokens: both
    summed over the context ranks (context_sum)."""
    import functools
    from autopar.api import context_offer
    from autopar.passes.sharding import Shard, context_layouts
    from autopar.passes.sharding.context import Counts, Rows
    from autopar.request import Pins
    from autopar.runtime.context_shard import context_sum
    from models import hf_mixtral
    torch.manual_seed(0)
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    gm = capture(hf_mixtral(seq=SEQ, layers=1, output_router_logits=True), (ids,),
                 functools.partial(autopar.cross_entropy, aux_loss_coef=0.5), ids.clone()).gm
    engine = context_layouts(gm, 2, SEQ)
    by_op = {}
    for n in gm.graph.nodes:
        by_op.setdefault(getattr(n.target, "__name__", str(n.target)).split(".")[0],
                         []).append(engine.layout.get(n))
    rows = 2 * SEQ * 2                                       # B·T tokens × top-2 choices
    assert by_op["sort"] == [(Rows(0, (rows // 2,) * 2, perm="sort"),) * 2]
    assert by_op["histc"] == [Counts(), Counts()]         # routing's, the statistic's
    (put,) = by_op["index_put_"]
    assert isinstance(put, Shard) and not isinstance(put, Rows)    # sequence order again
    mms = [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert len(mms) == 2 and all(isinstance(engine.layout[n], Rows)
                                 and engine.layout[n.args[2]] == Counts() for n in mms)
    rewritten = apply_context_parallel(copy.deepcopy(gm), 2, SEQ)
    (arange,) = [n for n in rewritten.graph.nodes if n.target is torch.ops.aten.arange.default
                 and n.meta.get(K.CP_SEQ_DIM) == 0]
    assert arange.args == (rows // 2,)                       # the rank's rows, not the batch's
    assert {n.meta[K.VAL].shape[0] for n in rewritten.graph.nodes
            if "grouped_mm" in str(n.target)} == {rows // 2}
    summed = [n.args[0].target for n in rewritten.graph.nodes if n.target is context_sum]
    assert summed == [torch.ops.aten.histc.default, torch.ops.aten.sum.dim_IntList]
    assert context_offer(gm, SEQ, Pins()).c is None          # free: the solver may pick c > 1


class SortMix(torch.nn.Module):
    """Tokens sorted along the sequence and added to the unsorted ones: the rank's sorted
    rows have no global positions to meet."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x + torch.sort(x, dim=1).values)


@pytest.mark.parametrize("kw, match", [
    (dict(c=3), r"c=3 with sequence length 16: .*2c = 6"),
    (dict(c=2, t=1, p=1, d=2),
     r"pins t=1·c=2·p=1·d=2 multiply to 4, which does not divide gpus=2; t·c·p·d must"),
    (dict(c=0), r"^parallelize: c=0: must be a positive integer; pass c=1 or more"),
])
def test_bad_c_one_line_errors(kw, match):
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    with pytest.raises(ValueError, match=match) as err:
        autopar.parallelize(gpt(seq=SEQ), gpus=2 if kw.get("c") != 3 else 3,
                            example_inputs=(ids,), loss_fn=autopar.cross_entropy,
                            global_batch_size=2, cluster="local-cpu", **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("builder", ["llama_style", "hf_llama"])
def test_grouped_query_keys_values_gathered_before_the_head_repeat(builder):
    """4 query heads, 2 key/value heads: the all-gather moves the 2 heads (repeat_interleave
    in the example, transformers' repeat_kv unsqueeze → expand → reshape), and the repeat runs
    on the gathered whole sequence, so attention still reads 4 heads of SEQ keys."""
    import models
    model = getattr(models, builder)(seq=SEQ, heads=4, kv_heads=2)
    gm = apply_context_parallel(copy.deepcopy(_captured(model)), 2, SEQ)
    gathers = [n for n in gm.graph.nodes if n.target is context_gather]
    assert len(gathers) == 4
    for g in gathers:
        assert g.meta[K.VAL].numel() == 2 * SEQ * 2 * 8    # (B, 2 kv heads, T, 8) or (B, T, 16)
        assert tuple(g.args[0].meta[K.VAL].shape)[g.args[2]] == SEQ // 2
    attention = [n for n in gm.graph.nodes if n.target in (
        context_causal_attention, torch.ops.aten.scaled_dot_product_attention.default)]
    for n in attention:
        for kv in n.args[1:3]:
            assert tuple(kv.meta[K.VAL].shape) == (2, 4, SEQ, 8)


def test_dropout_draws_from_the_context_rank_streams():
    """Attention dropout (is_causal, chunk by chunk) and the residual / embedding dropouts on
    the rank's tokens draw from the program's DropoutStreams (`tp_rng`), the stream the rank's
    tensor ranks share, not from the default generator every context rank advances alike."""
    from autopar.runtime.shard import tp_dropout
    gm = apply_context_parallel(copy.deepcopy(_captured(gpt(seq=SEQ, dropout=0.1))), 2, SEQ)
    attention = [n for n in gm.graph.nodes if n.target is context_causal_attention]
    assert len(attention) == 2
    for n in attention:
        assert n.args[6] == 0.1 and n.args[7].op == "get_attr" and n.args[9] is False
    drops = [n for n in gm.graph.nodes if n.target is tp_dropout]
    assert drops and all(n.kwargs == {"per_tensor_rank": False} for n in drops)
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default]


def test_context_attention_dropout_is_unbiased_and_per_rank():
    """The rank's rows of causal attention with dropout 0.5, averaged over 4,000 draws, are the
    rows without dropout (within 5 standard errors); the stream is the context rank's: shared
    by its tensor ranks, another on the other context rank, replayable."""
    from autopar.runtime.context_shard import ContextShard
    from autopar.runtime.shard import DropoutStreams
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 8, 4) for _ in range(3))
    cp = ContextShard(group=None, c=2, cp_rank=1, seq_len=8)
    local_q = q.index_select(2, cp.positions)
    want = context_causal_attention(local_q, k, v, cp)
    streams = DropoutStreams(tp_rank=0, cp_rank=1)
    draws = torch.stack([context_causal_attention(local_q, k, v, cp, dropout_p=0.5,
                                                  streams=streams) for _ in range(4000)])
    err = (draws.mean(0) - want).abs()
    assert (err <= 5 * draws.std(0) / 4000 ** 0.5 + 1e-6).all(), err.max()
    assert (draws.std(0) > 0).any()
    same = [DropoutStreams(t, 1).generator(0, per_tensor_rank=False).initial_seed()
            for t in (0, 1)]
    other = DropoutStreams(0, 0).generator(0, per_tensor_rank=False).initial_seed()
    assert same[0] == same[1] != other
    # the per-tensor-rank streams of context rank 0 are the tensor-parallel ones of c = 1
    assert DropoutStreams(1, 0).generator(0).initial_seed() == 2718 + 1_000_003
    a, b = DropoutStreams(0, 1), DropoutStreams(0, 1)
    torch.testing.assert_close(
        context_causal_attention(local_q, k, v, cp, dropout_p=0.5, streams=a),
        context_causal_attention(local_q, k, v, cp, dropout_p=0.5, streams=b))


def test_masked_attention_dropout_draws_from_the_context_rank_stream():
    """transformers' Llama (a mask, not is_causal) with attention dropout: sdpa becomes tp_sdpa
    on the stream the rank's tensor ranks share, its mask's query rows the rank's."""
    from autopar.runtime.shard import tp_sdpa
    from models import hf_llama
    model = hf_llama(layers=1, seq=SEQ, attention_dropout=0.1)
    gm = apply_context_parallel(copy.deepcopy(_captured(model)), 2, SEQ)
    (n,) = [n for n in gm.graph.nodes if n.target is tp_sdpa]
    assert n.args[3].op == "get_attr" and n.args[6] == 0.1
    assert n.args[5].target is context_select and n.kwargs["per_tensor_rank"] is False


ENGINE_MODELS = ("gpt", "llama_style", "hf_llama", "hf_mistral", "hf_neox", "hf_gpt2",
                 "hf_falcon", "hf_falcon_mq", "hf_gptj", "hf_bloom", "hf_olmo2", "hf_qwen3",
                 "hf_phi3", "hf_gemma", "hf_phi", "hf_opt", "hf_bigcode", "torch_encoder",
                 "hf_mixtral", "hf_smollm3", "hf_qwen3_moe", "no_list")
# with these, every decoder of tests/models.py is held at c = 2 here or by a numerics test
# (SmolLM3's layers without rotary, Qwen3-MoE's dense first layer and a stack with no repeated
# container by none); DeepSeek-V3 in test_layer_kinds_numerics.py (its capture is the slowest)


def _architecture(name):
    from models import BUILDERS
    torch.manual_seed(0)
    sizes = dict(seq=SEQ) if name in ("gpt", "llama_style") else {}
    return _captured(BUILDERS[name](**sizes) if name == "no_list"
                     else BUILDERS[name](layers=2, **sizes))


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_rewrite_applies_the_engine_layouts(name):
    """The sharding engine in its context mode (passes/sharding/context.py `context_layouts`: the
    inputs' tokens seeded as a sequence Shard over t := c, no column candidates) decides; the
    pass rewrites exactly that: every value's sequence dim, a selection at the rank's
    positions on each edge the engine marked, a gather for each key / value attention reads."""
    from autopar.passes.sharding import Shard, context_layouts
    gm = _architecture(name)
    engine = context_layouts(gm, 2, SEQ)
    rewritten = apply_context_parallel(copy.deepcopy(gm), 2, SEQ)
    seq_dim = {n.name: n.meta.get(K.CP_SEQ_DIM) for n in rewritten.graph.nodes}
    for n in gm.graph.nodes:
        lay = engine.layout.get(n)
        if n.op == "call_function" and n.name in seq_dim and not isinstance(lay, tuple):
            assert (lay.dim if isinstance(lay, Shard) else None) == seq_dim[n.name], n.name
    selected = {u.name for s in rewritten.graph.nodes if s.target is context_select
                for u in s.users}
    assert selected == {c.name for c, edges in engine.convert.items()
                        for lay in edges.values() if isinstance(lay, Shard)}
    gathers = [n for n in rewritten.graph.nodes if n.target is context_gather]
    assert len(gathers) == sum(len(v) for v in engine.gathered.values()) > 0


@pytest.mark.parametrize("model", [RunningSum, SortMix])
def test_refused_by_the_engine_before_the_graph_changes(model):
    """A cumulative op along the tokens, sorted tokens meeting unsorted ones: the engine
    refuses (one line, the node and its source line) while recording, before the tensor
    split, and the graph is left as it was (no gather, no fallback)."""
    from autopar.passes.context_parallel import record_context_layouts
    gm = _captured(model())
    before = [(n.name, n.target, n.args) for n in gm.graph.nodes]
    with pytest.raises(ValueError, match=r"^context parallelism: node (cumsum|add) .* at File "
                                         r".*test_context_pass\.py.*(cumulative|sorted and "
                                         r"in sequence order)") as err:
        record_context_layouts(gm, 2, SEQ)
    assert "\n" not in str(err.value)
    assert [(n.name, n.target, n.args) for n in gm.graph.nodes] == before


@pytest.mark.parametrize("name", ["llama_style", "hf_gpt2"])
def test_layouts_recorded_before_the_tensor_split_reach_its_new_nodes(name):
    """c = 2 with t = 2 and sequence parallelism, as autopar/build.py orders it: the engine's
    layouts recorded on the captured graph, the tensor-parallel pass copying them onto the
    sequence-parallel scatters / gathers (and GPT-2's per-row blocks) it makes, the rewrite
    reading them: every such node holds the rank's tokens with T/(c·t) or T/c of them, and the
    per-row blocks name T/c."""
    from autopar.passes.context_parallel import record_context_layouts
    from autopar.passes.tensor_parallel import apply_tensor_parallel
    from autopar.runtime import collectives as coll
    from autopar.runtime import shard as shard_rt
    gm = record_context_layouts(_architecture(name), 2, SEQ)
    gm = apply_tensor_parallel(gm, 2, 0, None, sequence_parallel=True)
    gm = apply_context_parallel(gm, 2, SEQ)
    sp = {coll.scatter_to_sp, coll.gather_from_sp, coll.reduce_scatter_to_sp, coll.all_gather_sp}
    made = [n for n in gm.graph.nodes if n.target in sp]
    assert made
    for n in made:
        d = n.meta[K.CP_SEQ_DIM]
        assert n.meta[K.VAL].shape[d] in (SEQ // 4, SEQ // 2) or (
            n.meta[K.VAL].shape[d] % (SEQ // 2) == 0 and d == 0), n.name   # (B·T/c, C) rows
    for n in gm.graph.nodes:
        if n.target in (shard_rt.local_blocks, shard_rt.unshuffle_blocks) \
                and K.CP_SEQ_DIM in n.args[0].meta \
                and n.args[2] % n.args[0].meta[K.VAL].dim() == n.args[0].meta[K.CP_SEQ_DIM]:
            assert set(n.args[3]) == {SEQ // 2}, n.name


class GatherByIds(torch.nn.Module):
    """Rows of the (B·T, C) tokens picked by the token ids: an index into the rank's tokens by
    values that are not positions among them."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids).flatten(0, 1)
        return self.head(x + x[ids.flatten() % x.shape[0]]).view(ids.shape[0], ids.shape[1], 64)


class WriteIntoWhole(torch.nn.Module):
    """The rank's tokens added in place into a whole buffer of the sequence's length: the
    buffer would be selected at the rank's positions, a copy, and the write lost."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids)
        buf = torch.zeros(x.shape[0], SEQ, 16) + 1.0
        buf.add_(x)
        return self.head(buf)


def _sum_loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


def _weighted_loss(logits, y):
    weight = torch.ones(logits.shape[-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), weight=weight)


@pytest.mark.parametrize("model, loss, c, method, refused", [
    (RunningSum, None, 2, "all-gather", "cumsum"),                  # the engine's op rules
    (GatherByIds, None, 2, "all-gather", "not positions among them"),   # an index's values
    (WriteIntoWhole, None, 2, "all-gather", "writes add in place but reads it converted"),
    (lambda: gpt(seq=SEQ, dropout=0.1), None, 2, "ring", "attention dropout 0.1"),
    (lambda: gpt(seq=SEQ), None, 8, "all-to-all", "with 4 heads"),   # heads over c
    (lambda: gpt(seq=SEQ), _sum_loss, 2, "all-gather", "not reduced by its mean"),
    (lambda: gpt(seq=SEQ), _weighted_loss, 2, "all-gather", "class-weighted"),
    (lambda: gpt(seq=SEQ), None, 2, "ring", None),                   # builds
])
def test_the_engine_s_verdict_is_the_pass_s(model, loss, c, method, refused):
    """Per refusal family, the feasibility query (`context_verdict`, the engine alone) and the
    pass (record + rewrite) say the same: the same one-line refusal, or both build."""
    from autopar.passes.sharding import context_verdict
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    gm = capture(model(), (ids,), loss or autopar.cross_entropy, ids.clone()).gm
    said = context_verdict(gm, c, SEQ).refusal(method)
    if refused is None:
        apply_context_parallel(copy.deepcopy(gm), c, SEQ, method)
        assert said is None
        return
    with pytest.raises(ValueError) as err:
        apply_context_parallel(copy.deepcopy(gm), c, SEQ, method)
    assert refused in str(err.value) and said == str(err.value)
    assert context_verdict(gm, c, SEQ).refusal("all-gather") == (
        None if method != "all-gather" else said)


def test_the_feasibility_query_does_not_run_the_pass(monkeypatch):
    """parallelize's context offer asks the engine alone: the pass is never called, the graph
    neither copied nor changed (no node, argument or meta key added)."""
    import autopar.api as api
    import autopar.passes.context_parallel as cp
    from autopar.request import Pins

    def never(*args, **kwargs):
        raise AssertionError("the context-parallel pass ran, or the graph was copied")
    gm = _captured(gpt(seq=SEQ, dropout=0.1))
    for name in ("apply_context_parallel", "record_context_layouts", "_record", "_rewrite"):
        monkeypatch.setattr(cp, name, never)
    monkeypatch.setattr(copy, "deepcopy", never)
    before = [(n.name, n.target, n.args, n.kwargs, dict(n.meta)) for n in gm.graph.nodes]
    offer = api.context_offer(gm, SEQ, Pins())
    assert offer.methods == ("all-gather", "all-to-all", "hybrid")   # ring refused: dropout
    assert "attention dropout 0.1" in offer.refused["ring"]
    with pytest.raises(ValueError, match=r"^parallelize: cp_attention='hybrid-ring': .*"
                                         r"hybrid-ring attention with attention dropout 0\.1"):
        api.context_offer(gm, SEQ, Pins(c=4, cp_attention="hybrid-ring"))   # pin-only, refused
    assert [(n.name, n.target, n.args, n.kwargs, dict(n.meta)) for n in gm.graph.nodes] == before


class LatentKeys(torch.nn.Module):
    """Keys assembled as transformers' DeepSeek-V3 `expand_kv` does: a new_empty buffer shaped
    like the per-head projection, its head dim written by two slice copies (a per-head part and
    one rotary-like part shared by the heads, broadcast over them), then attention; and a whole
    buffer (new_zeros of another rank) added to the output."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(8, 64)
        self.q, self.kv, self.rot = (torch.nn.Linear(16, n) for n in (16, 16, 4))

    def forward(self, ids):
        x = self.emb(ids)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 2, 8).transpose(1, 2)              # (B, 2, T, 8)
        kv = self.kv(x).view(b, t, 2, 8).transpose(1, 2)            # (B, 2, T, 4 + 4)
        k_nope, v = torch.split(kv, [4, 4], dim=-1)
        k_rot = self.rot(x).view(b, 1, t, 4).expand(-1, 2, -1, -1)  # one key part for 2 heads
        k = kv.new_empty(*kv.shape[:-1], 8)
        k[..., :4].copy_(k_nope)
        k[..., 4:].copy_(k_rot)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(b, t, 8)
        return self.head(o + x.new_zeros(8))


@pytest.mark.parametrize("method", ["all-gather", "all-to-all"])
def test_a_buffer_made_from_the_rank_s_tokens_is_the_rank_s(method):
    """x.new_empty(sizes) with x's sequence dim (its sizes taken from x) holds the rank's
    tokens (sizes T/c there); the slice copies into it keep it (no conversion of the buffer
    they write: a selection or gather there would write into a copy) and their sources are
    read as they are (the shared part broadcast over the heads); attention reads the filled
    buffer, gathered after both copies (all-gather) or exchanged whole (all-to-all). A
    new_zeros of another rank stays whole. The engine's verdict is the pass's: it builds."""
    from autopar.passes.sharding import R, Shard, context_layouts, context_verdict
    from autopar.runtime.ulysses import context_alltoall_attention
    gm = _captured(LatentKeys())
    assert context_verdict(gm, 2, SEQ).refusal(method) is None
    engine = context_layouts(gm, 2, SEQ, method)
    by_name = {n.name: n for n in gm.graph.nodes}
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 2 and engine.layout[by_name["new_empty"]] == Shard(2, (SEQ,),
                                                                             seq=True)
    assert all(engine.layout[n] == engine.layout[n.args[0]] == Shard(2, (SEQ,), seq=True)
               and n.args[0] not in engine.convert.get(n, {}) for n in copies)
    assert engine.layout[by_name["new_zeros"]] == R
    gm = apply_context_parallel(copy.deepcopy(gm), 2, SEQ, method)
    nodes = list(gm.graph.nodes)
    (buf,) = [n for n in nodes if n.target is torch.ops.aten.new_empty.default]
    assert buf.args[1] == [2, 2, SEQ // 2, 8] and buf.meta[K.CP_SEQ_DIM] == 2
    assert tuple(buf.meta[K.VAL].shape) == (2, 2, SEQ // 2, 8)
    (zeros,) = [n for n in nodes if n.target is torch.ops.aten.new_zeros.default]
    assert zeros.args[1] == [8] and K.CP_SEQ_DIM not in zeros.meta
    writes = [n for n in nodes if n.target is torch.ops.aten.copy_.default]
    assert [w.args[0].args[0] for w in writes] == [buf, buf]      # the buffer itself, no copy
    (attn,) = [n for n in nodes if n.target in (context_causal_attention,
                                                context_alltoall_attention)]
    key = attn.args[1]
    if method == "all-gather":
        assert key.target is context_gather and key.args[0] is buf
        assert nodes.index(key) > max(nodes.index(w) for w in writes)
    else:
        assert key is buf

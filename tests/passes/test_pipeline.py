"""Stage cutting (passes/pipeline.py): chunks compose to the full graph, values crossing cuts
become inputs/outputs, parameters live where they are used, bad stage layouts are rejected."""
from __future__ import annotations

import pytest
import torch

from autopar.build import build_program
from autopar.passes import meta as K
from autopar.passes.pipeline import split_chunks

from programs import SEQ, make_plan, make_program


def _run_chunks(chunks, x, y):
    """Compose the chunk GraphModules by hand: the pipeline's dataflow on one process."""
    carried: tuple = ()
    inputs = (x, y)
    for gm in chunks:
        spec = gm.meta[K.CHUNK]
        out = gm(*carried, *(inputs[k] for k in spec.model_inputs))
        carried = out if not spec.returns_loss else ()
    return out


@pytest.mark.parametrize("name,layers,p,v,split", [
    ("gpt", 2, 2, 1, None),
    ("gpt", 3, 2, 1, [2, 1]),          # uneven
    ("gpt", 5, 2, 2, [2, 1, 1, 1]),    # interleaved, layer count not divisible by p·v
    ("llama_style", 4, 4, 1, None),
])
def test_chunks_compose_to_the_full_model(name, layers, p, v, split):
    plan = make_plan(p=p, v=v, m=max(p, 2), layers=layers, split=split,
                     schedule="interleaved-1f1b" if v > 1 else "1f1b")
    prog, vocab = make_program(name, plan)
    x = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    built = build_program(prog)
    chunks = built.chunks(0)
    assert len(chunks) == p * v
    torch.testing.assert_close(_run_chunks(chunks, x, y), prog.loss_fn(prog.model(x), y),
                               rtol=1e-5, atol=1e-6)
    for c, gm in enumerate(chunks):
        spec = gm.meta[K.CHUNK]
        st = plan.stages[c]
        assert (spec.chunk, spec.rank, spec.first_layer, spec.last_layer) == \
            (c, c % p, st.first_layer, st.last_layer)
        assert f"chunk {c}" in type(gm).__doc__ and f"pipeline rank {c % p}" in type(gm).__doc__
        # the sends of chunk c are exactly the receives of chunk c+1
        if c + 1 < len(chunks):
            assert spec.send == chunks[c + 1].meta[K.CHUNK].recv
            assert spec.send, "a cut must carry at least the residual stream"
    first, last = chunks[0].meta[K.CHUNK], chunks[-1].meta[K.CHUNK]
    assert first.model_inputs == (0,)      # token ids go to the first chunk only
    assert last.model_inputs == (1,)       # targets straight to the last chunk
    assert last.returns_loss and not last.send


def test_parameters_live_where_used_and_tied_embedding_is_in_both_ends():
    plan = make_plan(p=2, m=2, layers=2)
    prog, _ = make_program("gpt", plan)
    chunks = build_program(prog).chunks(0)
    names = [set(gm.meta[K.CHUNK].params.values()) for gm in chunks]
    assert "transformer.h.0.attn.c_attn.weight" in names[0]
    assert "transformer.h.0.attn.c_attn.weight" not in names[1]
    assert "transformer.h.1.mlp.c_fc.weight" in names[1]
    assert "transformer.ln_f.weight" in names[1] and "transformer.wpe.weight" in names[0]
    tied = names[0] & names[1]
    assert tied == {"lm_head.weight"}  # the tied wte/lm_head tensor (graph name) in both


def test_rotary_tables_are_recomputed_not_sent():
    plan = make_plan(p=2, m=2, layers=2)
    prog, _ = make_program("llama_style", plan)
    chunks = build_program(prog).chunks(0)
    recv = chunks[1].meta[K.CHUNK].recv
    assert len(recv) == 1 and recv[0].shape == (2, SEQ, 32) and recv[0].requires_grad
    assert set(chunks[1].meta[K.CHUNK].buffers.values()) >= {"rope_cos", "rope_sin"}


def test_more_chunks_than_layers_and_edges_is_rejected():
    """The solver's bound: a chunk per layer plus an embedding-only and a head-only chunk."""
    edges = make_plan(p=2, v=2, m=2, schedule="interleaved-1f1b", layers=2, split=[0, 1, 1, 0])
    prog, _ = make_program("gpt", edges)
    assert len(build_program(prog).chunks()) == 4
    plan = make_plan(p=2, v=3, m=2, schedule="interleaved-1f1b", layers=2,
                     split=[0, 1, 1, 0, 0, 0])
    prog, _ = make_program("gpt", plan)
    with pytest.raises(ValueError, match=r"p·v = 2·3 = 6 chunks but the model has only 2 layers"):
        build_program(prog)


def test_only_edge_chunks_may_have_no_layers():
    """The first chunk has the embedding and the last the head + loss to run without layers;
    an empty middle chunk would only relay."""
    ok = make_plan(p=2, v=2, m=2, schedule="interleaved-1f1b", layers=4, split=[0, 2, 2, 0])
    prog, _ = make_program("gpt", ok)
    specs = [c.meta[K.CHUNK] for c in build_program(prog).chunks()]
    assert [s.describe() for s in specs] == ["embedding", "layers [0, 2)", "layers [2, 4)",
                                             "head+loss"]
    bad = make_plan(p=2, v=2, m=2, schedule="interleaved-1f1b", layers=4, split=[2, 0, 1, 1])
    prog, _ = make_program("gpt", bad)
    with pytest.raises(ValueError, match=r"chunk 1 has no layers .*first \(embedding\)"):
        build_program(prog)


def test_stages_not_covering_the_model_are_rejected():
    plan = make_plan(p=2, m=2, layers=2)
    prog, _ = make_program("gpt", plan)
    built = build_program(prog)
    bad = make_plan(p=2, m=2, layers=3)
    with pytest.raises(ValueError, match=r"cover layers \[0, 3\) but the graph has 2 layers"):
        split_chunks(built.gm, bad)


@pytest.mark.parametrize("ignore_index, reduction, want", [
    (-100, "mean", -100), (0, "mean", 0), (-100, "sum", None)])
def test_last_chunk_names_a_token_mean_loss_ignore_index(ignore_index, reduction, want):
    """The runtime weighs micro-batches by their counted tokens only for a token-mean loss of
    the targets (found in the graph: cross-entropy with reduction mean), with its ignore_index;
    a summed loss keeps the plain average (None)."""
    from autopar.api import ParallelProgram
    from models import runtime_model

    def loss(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                                                 ignore_index=ignore_index, reduction=reduction)
    plan = make_plan(p=2, m=2, layers=2)
    ex = torch.zeros(2, SEQ, dtype=torch.long)
    prog = ParallelProgram(model=runtime_model("gpt", 2), plan=plan, profile=None,
                           example_inputs=(ex,), loss_fn=loss, example_targets=ex, cluster=None)
    first, last = (gm.meta[K.CHUNK] for gm in build_program(prog).chunks(0))
    assert first.loss_ignore_index is None and last.loss_ignore_index == want

"""Activation recomputation (passes/recompute.py) on one process: the same losses and gradients
as without it (dropout replayed identically), fewer bytes kept for backward (full < selective <
none), the checkpoint calls visible in the generated source. Runs on gloo ranks through the
runtime: tests/numerics/test_recompute_numerics.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.api import ParallelProgram
from autopar.build import build_program
from autopar.codegen import load_chunk_module, render_chunk
from autopar.passes import meta as K
from autopar.passes.recompute import apply_recompute

import models
from programs import loss_fn, make_plan

SEQ_LEN = 8
B = 2


def _program(name: str, mode: str, *, p: int = 2, layers: int = 2, split=None,
             dropout: float = 0.0, eager: bool = False) -> ParallelProgram:
    plan = dataclasses.replace(make_plan(p=p, m=p, b=B, layers=layers, split=split),
                               recompute=mode)
    model = models.pass_model(name, layers=layers, dropout=dropout)
    if eager:  # transformers' unfused attention: matmul → softmax → dropout → matmul
        model.config._attn_implementation = "eager"
    model.train()
    ex = torch.zeros(B, SEQ_LEN, dtype=torch.long)
    return ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(ex,),
                           loss_fn=loss_fn, example_targets=ex.clone(), cluster=None)


def _loss_and_grads(chunks, x, y, seed: int = 7):
    """Compose the chunks on one process (the pipeline's dataflow), backprop, collect grads by
    the user's parameter names."""
    torch.manual_seed(seed)
    carried: tuple = ()
    for gm in chunks:
        spec = gm.meta[K.CHUNK]
        out = gm(*carried, *((x, y)[k] for k in spec.model_inputs))
        carried = out if not spec.returns_loss else ()
    out.backward()
    grads = {}
    for gm in chunks:
        for attr, qual in gm.meta[K.CHUNK].params.items():
            g = getattr(gm, attr).grad
            grads[qual] = grads.get(qual, 0) + g
    return out.detach(), grads


def _data(vocab: int = 128):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (B, SEQ_LEN), generator=g),
            torch.randint(0, vocab, (B, SEQ_LEN), generator=g))


@pytest.mark.parametrize("name,dropout,eager", [
    ("gpt", 0.1, False),            # fused sdpa with attention dropout, residual dropout
    ("llama_style", 0.0, False),    # rotary, GQA, SwiGLU, RMSNorm
    ("hf_gpt2", 0.1, True),         # unfused attention core, Conv1D
])
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_numerics_equal_to_no_recompute(name, dropout, eager, mode):
    x, y = _data()
    ref_loss, ref_grads = _loss_and_grads(
        build_program(_program(name, "none", dropout=dropout, eager=eager)).chunks(0), x, y)
    chunks = build_program(_program(name, mode, dropout=dropout, eager=eager)).chunks(0)
    regions = [r for gm in chunks for r in gm.meta[K.RECOMPUTE]["regions"]]
    assert len(regions) == 2, regions   # one per block (full, op) / attention core (selective)
    loss, grads = _loss_and_grads(chunks, x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-6, atol=1e-7, msg=k)
    if dropout:  # the check above would be vacuous if dropout did nothing
        x2_loss, _ = _loss_and_grads(chunks, x, y, seed=8)
        assert x2_loss != loss


def _saved_bytes(gm: torch.fx.GraphModule, args) -> int:
    """Bytes of the distinct storages autograd keeps for backward across one forward of `gm`
    (parameters and buffers excluded: the module keeps them anyway). Non-reentrant checkpoint saves its inputs
    through the same hooks, so its kept block inputs are counted."""
    params = {p.untyped_storage().data_ptr()
              for p in [*gm.parameters(), *gm.buffers()]}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gm(*args)
    del out
    return sum(storages.values())


@pytest.mark.parametrize("name", ["gpt", "llama_style"])
def test_memory_full_below_selective_below_none(name):
    # p=3 over 6 layers: chunk 1 is blocks 2-3 only, its input is the residual stream (B, T, C)
    sizes = {}
    for mode in ("none", "selective", "full"):
        prog = _program(name, mode, p=3, layers=6)
        chunk = build_program(prog).chunks(0)[1]
        spec = chunk.meta[K.CHUNK]
        assert (spec.first_layer, spec.last_layer) == (2, 4)
        args = [torch.randn(b.shape, requires_grad=b.requires_grad) for b in spec.recv]
        sizes[mode] = _saved_bytes(chunk, args)
    hidden = spec.recv[0].shape
    block_input = torch.Size(hidden).numel() * 4
    assert sizes["full"] < sizes["selective"] < sizes["none"], sizes
    # full keeps the two block inputs (the residual stream entering blocks 2 and 3) only
    assert sizes["full"] == 2 * block_input, (sizes, block_input)


def test_generated_source_shows_checkpoint_and_runs():
    prog = _program("gpt", "full")
    gm = build_program(prog).chunks(0)[0]
    src = render_chunk(gm, prog.plan)
    assert "torch.utils.checkpoint.checkpoint(recompute_block_0" in src
    assert "use_reentrant = False" in src and "class Chunk00_recompute_block_0" in src
    mod = load_chunk_module(src)
    net = mod.CHUNK_CLASS()
    for attr in mod.PARAMETERS:
        setattr(net, attr, getattr(gm, attr))
    for attr in mod.BUFFERS:
        setattr(net, attr, getattr(gm, attr))
    for attr in mod.OBJECTS:           # as compile binds them: on the chunk and its submodules
        for sub in net.modules():
            setattr(sub, attr, getattr(gm, attr))
    x, _ = _data()
    torch.testing.assert_close(net(x), gm(x))


def test_none_is_identity_and_bad_mode_is_rejected():
    prog = _program("gpt", "none")
    gm = build_program(prog).chunks(0)[0]
    before = gm.code
    assert apply_recompute(gm, "none").code == before
    with pytest.raises(ValueError, match="mode='everything'.*'full'"):
        apply_recompute(gm, "everything")


class _GemmCount(torch.utils._python_dispatch.TorchDispatchMode):
    """The 2-D GEMMs (mm / addmm) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["gpt", "llama_style"])
def test_op_mode_recomputes_every_other_gemm_and_keeps_the_others(name, monkeypatch):
    """'op' (torchtitan's per-op selective checkpointing): the policy keeps the 1st, 3rd, ...
    GEMM's output and the attention kernel's, and the backward reruns the others — but it
    neither keeps nor reruns a block's last GEMM: its output feeds the residual add, which
    saves nothing, so the recomputation stops before it (checkpoint's early stop), in full
    recompute too (Llama's 7th GEMM, kept by torchtitan's policy, is not kept)."""
    import autopar.passes.recompute as R
    decisions, policy_of = [], R.op_policy

    def recording(seen, *last):
        inner = policy_of(seen, *last)

        def policy(ctx, func, *args, **kwargs):
            out = inner(ctx, func, *args, **kwargs)
            if not getattr(ctx, "is_recompute", False):   # torch 2.11 asks again then
                decisions.append((func, out.name))
            return out
        return policy
    monkeypatch.setattr(R, "op_policy", recording)
    x, y = _data()
    counts = {}
    for mode in ("none", "full", "op"):
        chunk = build_program(_program(name, mode, p=1, layers=2)).chunks(0)[0]
        torch.manual_seed(0)
        fwd, bwd = _GemmCount(), _GemmCount()
        with fwd:
            loss = chunk(x, y)
        with bwd:
            loss.backward()
        counts[mode] = (fwd.n, bwd.n)
    (f_none, b_none), (f_full, b_full), (f_op, b_op) = counts["none"], counts["full"], counts["op"]
    assert f_none == f_full == f_op
    per_block = (f_none - 1) // 2                # 2 blocks and the head's GEMM
    assert per_block >= 4, counts
    assert b_full - b_none == 2 * (per_block - 1), counts
    assert b_op - b_none == 2 * ((per_block - 1) // 2), counts
    gemms = [d for f, d in decisions if f in (torch.ops.aten.mm.default,
                                              torch.ops.aten.addmm.default)]
    block = (["MUST_SAVE", "PREFER_RECOMPUTE"] * per_block)[:per_block - 1]
    assert gemms == (block + ["PREFER_RECOMPUTE"]) * 2, gemms
    attention = [d for f, d in decisions if f in R._ATTENTION_KERNELS]
    assert attention == ["MUST_SAVE"] * 2, decisions


def test_op_policy_keeps_its_outputs_where_the_policy_runs_before_the_op(monkeypatch):
    """torch 2.11's selective checkpoint (the GPU image's, 2026-11-27) calls the policy before
    the op runs, with no op_output: the first forward failed with an AttributeError. The
    policy then marks its decision and `_RecordKept`, entered under the checkpoint's forward
    mode, records the kept op's outputs once it has run — so a collective writing in place
    into a kept GEMM output (the row-parallel all-reduce) is still kept, and one writing into
    anything else is still rerun. 2.11 also asks again for every op it recomputes: those
    calls get the forward's decisions back in order."""
    import autopar.passes.recompute as R
    monkeypatch.setattr(R, "POLICY_SEES_OUTPUT", False)
    kept = R.KeptStorages()
    policy = R.op_policy([0], None, kept)

    class Context:                      # 2.11's context: no op_output
        def __init__(self, is_recompute=False):
            self.is_recompute = is_recompute

    def run(func, *args):
        decision = policy(Context(), func, *args).name
        with R._RecordKept(kept):
            return decision, func(*args)
    mm = torch.ops.aten.mm.default
    x, w1, w2, w3 = torch.randn(4, 8), torch.randn(8, 6), torch.randn(6, 8), torch.randn(8, 8)
    first, y = run(mm, x, w1)
    second, z = run(mm, y, w2)
    assert (first, second) == ("MUST_SAVE", "PREFER_RECOMPUTE")
    assert R._storage(y) in kept and R._storage(z) not in kept and not kept.pending
    allreduce = torch.ops.c10d.allreduce_.default     # decided on its arguments: not run here
    assert policy(Context(), allreduce, [y]).name == "MUST_SAVE"
    assert policy(Context(), allreduce, [z]).name == "PREFER_RECOMPUTE"
    # the recomputation asks again, with other GEMMs' weights in its arguments: the answers
    # are the forward's, in order (counted afresh, its first GEMM would be the 3rd: kept)
    again = [policy(Context(is_recompute=True), mm, x, w3).name for _ in range(2)]
    assert again == ["MUST_SAVE", "PREFER_RECOMPUTE"]


def test_op_mode_is_refused_in_one_line_where_torch_cannot_mutate_kept_outputs(monkeypatch):
    """op needs create_selective_checkpoint_contexts(..., allow_cache_entry_mutation=True) (a
    kept row-parallel piece is reduced in place): a torch without it gets one line from
    compile, naming the torch, the rule and the fix, before anything is built; calibrate
    measures no checkpoint_op_s there."""
    import time

    import autopar.passes.recompute as R
    from autopar.cost.calibrate_compute import measure_checkpoint_op
    assert R.op_mode_refusal() is None

    def older(policy_fn_or_list):
        raise AssertionError("not reached: compile refuses first")
    monkeypatch.setattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts", older)
    why = R.op_mode_refusal()
    assert torch.__version__ in why and "allow_cache_entry_mutation" in why and "\n" not in why
    with pytest.raises(ValueError, match=r"recompute='op' on torch .*'full' or 'selective'"):
        _program("gpt", "op", p=1).compile()
    assert measure_checkpoint_op(torch.float32, torch.device("cpu"), time.perf_counter) == 0.0

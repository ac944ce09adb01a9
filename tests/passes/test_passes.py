"""The pass pipeline (passes/manager.py), the meta-key registry (passes/meta.py), and passes run
on small FX graphs built by hand with torch.fx.Graph (no capture)."""
from __future__ import annotations

import ast
import operator
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from autopar.passes import meta as K
from autopar.passes.manager import Pass, PassError, run_passes
from autopar.passes.overlap import OVERLAP_PASS, overlap_tp_backward
from autopar.runtime import collectives as C

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]   # the repository (tests/passes/this file)


def _relu_graph() -> fx.GraphModule:
    """forward(x) = relu(x) + 1, built by hand."""
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.relu, (x,))
    g.output(g.call_function(operator.add, (r, 1.0)))
    return fx.GraphModule(torch.nn.Module(), g)


# ----- the runner --------------------------------------------------------------------------------

def _to_sigmoid(gm: fx.GraphModule) -> fx.GraphModule:
    for n in gm.graph.nodes:
        if n.target is torch.relu:
            n.target = torch.sigmoid
    return gm     # no recompile here: run_passes does it


def _use_before_definition(gm: fx.GraphModule) -> fx.GraphModule:
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        gm.graph.call_function(torch.neg, (add,))    # reads `add` before it is computed
    return gm


def test_passes_run_in_order_and_the_graph_is_recompiled_after_each():
    seen = []

    def record(gm):
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        assert "sigmoid" in gm.code        # the previous pass's graph, already recompiled
        return gm

    gm = run_passes(_relu_graph(), [Pass("to_sigmoid", _to_sigmoid), Pass("record", record)])
    assert seen and "sigmoid" in seen[0][0]
    x = torch.tensor([-1.0, 0.0, 2.0])
    torch.testing.assert_close(gm(x), torch.sigmoid(x) + 1)


def test_the_pass_that_breaks_the_graph_is_named():
    passes = [Pass("to_sigmoid", _to_sigmoid), Pass("use_before_definition",
                                                    _use_before_definition)]
    with pytest.raises(PassError, match=r"pass 'use_before_definition': the graph it returned "
                                        r"does not lint: .*used before it has been defined") as e:
        run_passes(_relu_graph(), passes)
    assert e.value.pass_name == "use_before_definition"
    assert isinstance(e.value.__cause__, RuntimeError)    # lint's own error, chained


def test_a_broken_input_graph_is_not_blamed_on_the_first_pass():
    gm = _use_before_definition(_relu_graph())
    with pytest.raises(PassError, match=r"pass '\(input graph\)'"):
        run_passes(gm, [Pass("to_sigmoid", _to_sigmoid)])


def test_a_declared_graph_meta_write_must_happen():
    with pytest.raises(PassError, match=r"pass 'forgets': declares it writes gm.meta "
                                        r"\['autopar_overlap'\]"):
        run_passes(_relu_graph(), [Pass("forgets", lambda gm: gm, writes=(K.OVERLAP,))])


def test_a_pass_must_return_a_graph_module():
    with pytest.raises(PassError, match=r"pass 'returns_none': returned a NoneType"):
        run_passes(_relu_graph(), [Pass("returns_none", lambda gm: None)])


def test_pass_keys_must_be_declared():
    with pytest.raises(ValueError, match=r"meta key 'autopar_typo' is not declared"):
        Pass("typo", lambda gm: gm, reads=("autopar_typo",))


# ----- the registry ------------------------------------------------------------------------------

def test_registry_has_one_entry_per_key_and_one_naming_scheme():
    names = [k.name for k in K.KEYS]
    assert len(names) == len(set(names))
    torch_keys = {K.VAL, K.NN_MODULE_STACK, K.STACK_TRACE}
    assert all(n.startswith("autopar_") for n in set(names) - torch_keys)
    assert all(K.declared(n).writer and K.declared(n).meaning for n in names)


def test_no_module_spells_a_declared_key_by_its_string():
    """Every key is written as its constant of passes/meta.py."""
    keys = {k.name for k in K.KEYS} - {K.VAL, K.NN_MODULE_STACK, K.STACK_TRACE}
    files = [p for d in ("passes", "autopar", "tests") for p in (ROOT / d).rglob("*.py")
             if p.name != "meta.py"]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in keys:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


# ----- overlap on a hand-built graph ------------------------------------------------------------

B, T, C_IN, N1, N2 = 2, 3, 8, 6, 4


def _column_entry_graph(extra_user: bool = False) -> fx.GraphModule:
    """f = copy_to_tp(x, group) feeding two projections, as the tensor-parallel rewrite
    leaves it; the group is None, a group of one, so nothing needs a process group:

        y1 = linear(f, w1, b1)            (B, T, N1)
        y2 = matmul(f, w2t)               (B, T, N2), w2t (C, N2) as Falcon's x @ w.T
        out = sum(y1) + sum(y2) [+ sum(f) when extra_user: f then has a non-projection user]
    """
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.w1 = torch.nn.Parameter(torch.randn(N1, C_IN))
    root.b1 = torch.nn.Parameter(torch.randn(N1))
    root.w2t = torch.nn.Parameter(torch.randn(C_IN, N2))
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[K.VAL] = torch.empty(B, T, C_IN, device="meta")
    attrs = {}
    for name in ("w1", "b1", "w2t"):
        attrs[name] = g.get_attr(name)
        attrs[name].meta[K.VAL] = torch.empty_like(getattr(root, name), device="meta")
    f = g.call_function(C.copy_to_tp, (x, None))
    y1 = g.call_function(aten.linear.default, (f, attrs["w1"], attrs["b1"]))
    y2 = g.call_function(aten.matmul.default, (f, attrs["w2t"]))
    for node, width, block in ((f, C_IN, 0), (y1, N1, 0), (y2, N2, 1)):
        node.meta[K.VAL] = torch.empty(B, T, width, device="meta")
        node.meta[K.REGION] = ("block", block)
    total = g.call_function(aten.add.Tensor, (g.call_function(aten.sum.default, (y1,)),
                                              g.call_function(aten.sum.default, (y2,))))
    if extra_user:
        total = g.call_function(aten.add.Tensor, (total, g.call_function(aten.sum.default, (f,))))
    g.output(total)
    return fx.GraphModule(root, g)


def _loss_and_grads(gm: fx.GraphModule, x: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_(True)
    loss = gm(x)
    loss.backward()
    return loss.detach(), x.grad, *(p.grad for p in gm.parameters())


def _calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_overlap_fuses_f_and_its_projections_into_one_column_parallel_call():
    x = torch.randn(B, T, C_IN)
    expected = _loss_and_grads(_column_entry_graph(), x)
    gm = overlap_tp_backward(_column_entry_graph())
    assert gm.meta[K.OVERLAP] == 1
    assert not _calls(gm, C.copy_to_tp)
    assert not _calls(gm, aten.linear.default) and not _calls(gm, aten.matmul.default)
    (fused,) = _calls(gm, C.column_parallel)
    x_arg, group, layouts, weights, biases, sp_dim = fused.args
    assert x_arg.name == "x" and group is None and sp_dim is None
    assert layouts == ("linear", "mm")
    assert [w.target for w in weights] == ["w1", "w2t"]
    assert [getattr(b, "target", None) for b in biases] == ["b1", None]
    # one getitem per projection, carrying the projection's meta; the node keeps f's region
    items = [u for u in fused.users if u.target is operator.getitem]
    assert sorted(i.args[1] for i in items) == [0, 1]
    assert [tuple(i.meta[K.VAL].shape) for i in sorted(items, key=lambda i: i.args[1])] == \
        [(B, T, N1), (B, T, N2)]
    assert [i.meta[K.REGION] for i in sorted(items, key=lambda i: i.args[1])] == \
        [("block", 0), ("block", 1)]
    assert fused.meta[K.REGION] == ("block", 0)
    assert "column_parallel" in gm.code
    # the same numbers: loss, input gradient and every weight / bias gradient
    for got, want in zip(_loss_and_grads(gm, x), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_overlap_leaves_an_entry_read_by_anything_but_a_projection():
    gm = run_passes(_column_entry_graph(extra_user=True), [OVERLAP_PASS])
    assert gm.meta[K.OVERLAP] == 0
    assert len(_calls(gm, C.copy_to_tp)) == 1 and not _calls(gm, C.column_parallel)


def _row_exit_graph() -> fx.GraphModule:
    """y = reduce_from_tp(dropout(linear(x, w), 0.0), None), as the tensor-parallel rewrite
    leaves a row-parallel projection (group None: a group of one); out = sum(y * y)."""
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.w = torch.nn.Parameter(torch.randn(N1, C_IN))
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[K.VAL] = torch.empty(B, T, C_IN, device="meta")
    w = g.get_attr("w")
    w.meta[K.VAL] = torch.empty(N1, C_IN, device="meta")
    y = g.call_function(aten.linear.default, (x, w))
    d = g.call_function(aten.dropout.default, (y, 0.0, True))
    r = g.call_function(C.reduce_from_tp, (d, None))
    for node in (y, d, r):
        node.meta[K.VAL] = torch.empty(B, T, N1, device="meta")
    g.output(g.call_function(aten.sum.default, (g.call_function(aten.mul.Tensor, (r, r)),)))
    return fx.GraphModule(root, g)


def test_overlap_fuses_a_row_parallel_projection_and_its_g_into_one_row_parallel_call():
    """passes.overlap: linear(x, W) → (dropout p=0) → g becomes row_parallel(x, group,
    "linear", W, None), the collective matmul; the same loss and gradients (a group of one
    runs the projection alone)."""
    x = torch.randn(B, T, C_IN)
    expected = _loss_and_grads(_row_exit_graph(), x)
    gm = overlap_tp_backward(_row_exit_graph())
    assert gm.meta[K.OVERLAP] == 1
    (fused,) = _calls(gm, C.row_parallel)
    assert fused.args[2:] == ("linear", fused.args[3], None) and fused.args[3].target == "w"
    assert not _calls(gm, C.reduce_from_tp) and not _calls(gm, aten.linear.default)
    assert not _calls(gm, aten.dropout.default)
    for got, want in zip(_loss_and_grads(gm, x), expected, strict=True):
        torch.testing.assert_close(got, want)

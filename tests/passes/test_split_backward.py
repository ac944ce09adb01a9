"""B (input gradients) then W (weight gradients) equals one full backward, hooks included."""
from __future__ import annotations

import copy

import pytest
import torch

from autopar.runtime.split_backward import backward_input, backward_weight

import models


def _blocks():
    return models.build("gpt", seed=0, vocab=32, seq=8, heads=2, hidden=16).transformer.h


def _grads(net):
    return {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("with_input_grad", [True, False])
def test_b_then_w_equals_full_backward(with_input_grad):
    ref, net = _blocks(), copy.deepcopy(_blocks())
    x0 = torch.randn(2, 8, 16)
    dy = torch.randn(2, 8, 16)
    fired: list[str] = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.append(name))

    xr = x0.clone().requires_grad_(with_input_grad)
    yr = ref[1](ref[0](xr))
    yr.backward(dy)

    x = x0.clone().requires_grad_(with_input_grad)
    y = net[1](net[0](x))
    work = backward_input([y], [dy], [x], list(net.parameters()))
    if with_input_grad:
        torch.testing.assert_close(x.grad, xr.grad)
        assert not fired and all(p.grad is None for p in net.parameters())   # no dW yet
    backward_weight(work)
    want, got = _grads(ref), _grads(net)
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)
    assert sorted(fired) == sorted(want)        # post-accumulate hooks fired once each


def test_scalar_loss_and_accumulation_over_two_microbatches():
    ref, net = _blocks(), copy.deepcopy(_blocks())
    xs = [torch.randn(2, 8, 16) for _ in range(2)]
    for x0 in xs:
        ref[1](ref[0](x0.clone().requires_grad_())).square().mean().backward()
    works = []
    for x0 in xs:
        x = x0.clone().requires_grad_()
        works.append(backward_input([net[1](net[0](x)).square().mean()], [None], [x],
                                    list(net.parameters())))
    for w in works:                              # W's deferred past the next micro-batch's B
        backward_weight(w)
    want, got = _grads(ref), _grads(net)
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)


def test_weight_joining_late_and_weight_off_the_input_path():
    lin, bias = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    y = lin(x) + bias * 2.0                       # bias joins x's path at the add
    work = backward_input([y], [torch.ones(3, 4)], [x], [lin.weight, lin.bias, bias])
    assert bias.grad is None                       # resumed from the add's recorded grad in W
    backward_weight(work)
    torch.testing.assert_close(bias.grad, torch.full((4,), 6.0))

    other = torch.nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    outs = [lin(x), other * 2.0]                   # `other` never meets x's path: no split
    work = backward_input(outs, [torch.ones(3, 4), torch.ones(4)], [x], [lin.weight, other])
    assert other.grad is not None and lin.weight.grad is not None    # all done in B
    backward_weight(work)
    torch.testing.assert_close(other.grad, torch.full((4,), 2.0))


def test_a_chunks_saved_tensors_live_until_its_w_and_no_longer():
    """B runs with retain_graph (W resumes from what it recorded), so the chunk's saved tensors
    stay between B and W — what the cost model holds for a pending micro-batch
    (cost/memory.py `inflight`) — and are freed once its W has run: the attention node's
    saved query, which W never reads, is the probe."""
    import gc
    import weakref
    net = _blocks()
    x = torch.randn(2, 8, 16, requires_grad=True)
    y = net[1](net[0](x))
    nodes, stack, attention = set(), [y.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        attention += [node] if hasattr(node, "_saved_query") else []
        stack += [f for f, _ in node.next_functions]
    assert len(attention) == 2                          # one scaled-dot-product node a block
    probes = [weakref.ref(node._saved_query) for node in attention]
    work = backward_input([y], [torch.ones_like(y)], [x], list(net.parameters()))
    del y, nodes, stack, attention, node
    gc.collect()
    assert all(p() is not None for p in probes)         # pending: held until its W
    backward_weight(work)
    del work
    gc.collect()
    assert all(p() is None for p in probes)             # after W: freed



class _Matmul(torch.autograd.Function):
    """x·wᵀ as a Python autograd.Function, as transformers' grouped_mm op under expert
    parallelism: the weight's branch joins the input's path at a Python Function's node."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


@pytest.mark.parametrize("scale", [3.0, None])
def test_w_after_the_outputs_are_dropped_at_a_python_functions_node(scale):
    """The executor drops a chunk's outputs after B. A recorded node that is a Python
    Function's lives only through the graph on torch 2.11: W must still reach it, whether
    the output's own node is a C++ one (× scale) or that Python Function's (None)."""
    w0, x0, dy = torch.randn(4, 4), torch.randn(3, 4), torch.randn(3, 4)
    wr, w = w0.clone().requires_grad_(), w0.clone().requires_grad_()

    def chunk(x, w):
        y = _Matmul.apply(x, w)
        return y if scale is None else y * scale
    chunk(x0.clone().requires_grad_(), wr).backward(dy)

    x = x0.clone().requires_grad_()
    y = chunk(x, w)
    work = backward_input([y], [dy], [x], [w])
    del y
    backward_weight(work)
    torch.testing.assert_close(w.grad, wr.grad)

"""A chunk's backward in two parts: B (input gradients) now, W (weight gradients) later.

Math (2401.10241 §2): for y = x·Wᵀ the backward is dx = dy·W (what the previous pipeline stage
waits for) and dW = dyᵀ·x (what nobody waits for). B runs the chunk's autograd graph from the
output gradients down to the received inputs only, and on the way records the gradient
arriving at each node where a weight's branch joins that path; W later runs autograd from those
recorded gradients down to the weights only. Together they do the work of one full backward,
nothing twice.

The graph bookkeeping (reverse graph, "parameter groups": per weight, the nodes where its branch
meets the input's path) is torch.distributed.pipelining's (_backward.py: get_param_groups), as
its ScheduleInterleavedZeroBubble uses it. W differs from theirs in one way: it accumulates
through `torch.autograd.backward(..., inputs=weights)`, i.e. through the weights'
AccumulateGrad nodes, so `register_post_accumulate_grad_hook` hooks fire as in a plain backward
(the data-parallel bucketing and the fp32 main-grad folding rely on them).

Fallback: when the chunk receives no input that needs a gradient (the first chunk), or some
weight's branch never meets the input path (its gradient could not be resumed from recorded
ones), B does nothing / the full backward respectively and W does the rest, so the result is
always the plain backward's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge


@dataclass
class WeightWork:
    """What W needs: either the recorded parameter groups, or the whole backward to run."""
    groups: list[dict[str, Any]] | None = None
    full: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None
    weights: dict[Any, torch.Tensor] | None = None     # AccumulateGrad node -> weight
    # what holds the graph of the recorded nodes until W (`_graph_holds`): a Python
    # autograd.Function's node (expert parallelism's all-to-all, a torch.library op's
    # autograd) is held by its Python object only weakly on torch 2.11; with the chunk's
    # outputs dropped after B, its recorded edge is dead at W ("element 0 of tensors does not
    # require grad")
    roots: list[Any] | None = None


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
                   ) -> WeightWork:
    """B: accumulate d(outputs)/d(inputs)·grads into each input's .grad; return W's work.

    `grads[k]` is None for a scalar loss output (gradient 1). Inputs and weights that do not
    require a gradient are ignored."""
    outs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
    ins = [x for x in inputs if x.requires_grad]
    ws = [w for w in weights if w.requires_grad]
    if not outs:
        return WeightWork()
    if not ins:                                   # first chunk: nothing to hand back early
        return WeightWork(full=([o for o, _ in outs], [g for _, g in outs]))
    # imported here: torch.distributed.pipelining loads its schedules and torch._dynamo
    # (~1.6 s a process), which a rank that never splits a backward does not need
    from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc,
                                                        construct_reverse_graph,
                                                        get_param_groups)
    roots = [fn for fn in (_get_grad_fn_or_grad_acc(o) for o, _ in outs) if fn is not None]
    acc = {_get_grad_fn_or_grad_acc(w): w for w in ws}
    groups = get_param_groups([_get_grad_fn_or_grad_acc(x) for x in ins], list(acc),
                              construct_reverse_graph(roots))
    covered = set().union(*(g["params"] for g in groups)) if groups else set()
    if covered != set(acc):                        # a weight off the input path: no split
        torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
        return WeightWork()
    handles = []
    for group in groups:
        group["intermediates"] = list(group["intermediates"])
        group["grads"] = [None] * len(group["intermediates"])
        for k, node in enumerate(group["intermediates"]):
            def record(grad_inputs, group=group, k=k):
                group["grads"][k] = grad_inputs
            handles.append(node.register_prehook(record))
    try:
        torch.autograd.backward([o for o, _ in outs], [g for _, g in outs], inputs=ins,
                                retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return WeightWork(groups=groups, weights=acc, roots=_graph_holds([o for o, _ in outs]))


def _graph_holds(outputs: Sequence[torch.Tensor]) -> list[Any]:
    """Per output, what keeps its autograd graph alive without its data: its grad_fn where
    that is a C++ node (whose Python object owns it), else the output itself (a Python
    Function's node is owned by the graph only)."""
    from torch.autograd.function import BackwardCFunction
    return [o if isinstance(o.grad_fn, BackwardCFunction) else o.grad_fn for o in outputs]


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the weight gradients B left (through AccumulateGrad: hooks fire)."""
    if work.full is not None:
        torch.autograd.backward(*work.full)
        return
    # One engine call per group: a single call for all groups would also push the upper
    # groups' gradients down to the lower recorded nodes (input-gradient work, then clamped
    # away) — measured 40% slower than per-group calls on a GPT block.
    for group in work.groups or ():
        edges, grads = [], []
        for recorded, node in zip(group["grads"], group["intermediates"]):
            for i, g in enumerate(recorded or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        # A recorded node below another recorded node would get its gradient twice (once
        # recorded, once flowing down again): clamp each to what B recorded.
        handles = [node.register_prehook(lambda _g, rec=rec: rec)
                   for rec, node in zip(group["grads"], group["intermediates"])
                   if len(group["intermediates"]) > 1]
        try:
            if edges:
                weights = [work.weights[a] for a in group["params"]]
                torch.autograd.backward(edges, grads, inputs=weights)
        finally:
            for h in handles:
                h.remove()
        group.clear()
    work.roots = None

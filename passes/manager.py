"""Run graph passes from one list: lint and recompile after each, and name the pass that broke
the graph.

The compiler's shape (docs/STYLE.md item 1):

    capture(model, ...)             the entry: nn.Module -> GraphModule (passes/capture.py)
    run_passes(gm, [pass, ...])     GraphModule -> GraphModule, one pass after another
    split_chunks(gm, plan)          the one splitter: GraphModule -> list[GraphModule]
    run_passes(chunk, [pass, ...])  per chunk

A `Pass` is a function GraphModule -> GraphModule with the meta keys (passes/meta.py) it reads
and writes. `run_passes` lints the input graph once (so a broken input is not blamed on the
first pass), then after each pass lints the graph it returned, checks that every gm.meta key
the pass declares it writes is there, and recompiles it, so `gm.code` and `gm.forward` are the
graph as the pass left it. A failure raises `PassError` naming the pass, chained to the cause.
The pass functions themselves neither lint nor recompile: their public wrappers
(`apply_recompute`, `overlap_tp_backward`, ...) run them through `run_passes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch.fx as fx

from autopar.passes import meta as K


class PassError(RuntimeError):
    """A pass left the graph broken (lint failed) or did not write what it declares."""

    def __init__(self, pass_name: str, problem: str):
        super().__init__(f"pass {pass_name!r}: {problem}")
        self.pass_name = pass_name


@dataclass(frozen=True)
class Pass:
    """A named GraphModule -> GraphModule function and the declared meta keys it reads and
    writes (constants of passes/meta.py; an undeclared key is a ValueError here)."""
    name: str
    run: Callable[[fx.GraphModule], fx.GraphModule]
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in self.reads + self.writes:
            K.declared(key)


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass]) -> fx.GraphModule:
    """Run `passes` on `gm` in order (see the module docstring); returns the last pass's graph."""
    _lint(gm, "(input graph)", "the graph handed to run_passes")
    for p in passes:
        out = p.run(gm)
        if not isinstance(out, fx.GraphModule):
            raise PassError(p.name, f"returned a {type(out).__name__}, not a GraphModule")
        _lint(out, p.name, "the graph it returned")
        missing = [k for k in p.writes if K.declared(k).scope == "graph" and k not in out.meta]
        if missing:
            raise PassError(p.name, f"declares it writes gm.meta {missing} but left none there")
        out.recompile()
        gm = out
    return gm


def _lint(gm: fx.GraphModule, pass_name: str, what: str) -> None:
    try:
        gm.graph.lint()
    except (RuntimeError, ValueError) as exc:   # what torch.fx.Graph.lint raises
        raise PassError(pass_name, f"{what} does not lint: {str(exc).splitlines()[0]}") from exc

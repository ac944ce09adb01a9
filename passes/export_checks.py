"""Drop the metadata checks torch.export inserts into the graph.

torch.export (non-strict) records `aten._assert_tensor_metadata(x, dtype=..., device=...,
layout=...)` where the model casts or moves a tensor (`x.float()`, `x.to(device)`), pinning
the dtype and device x had at capture. They compute nothing. Under mixed precision the
runtime decides the dtypes of what a graph receives (a floating value crossing a pipeline
stage travels in the compute dtype, autopar.compile), and a capture on fp32 weights pinned
fp32 where the run has bf16 (transformers' Mixtral: its embedding), so autopar.build drops
them from every 16-bit graph; the graph's own casts stay: they are the computation. (fp32
graphs keep them, as export made them: there they hold, and passes/device.py rebinds their
device.)

`DROP_METADATA_ASSERTS` (in a pass list)
Requires: a GraphModule.
Guarantees: no node of gm or of its graph submodules (higher-order op bodies) calls
  aten._assert_tensor_metadata; every other node and the numbers are unchanged.
Reads and writes no node.meta keys.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.manager import Pass

_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)


def _drop_checks(gm: fx.GraphModule) -> fx.GraphModule:
    for module in gm.modules():    # gm and its graph submodules
        if not isinstance(module, fx.GraphModule):
            continue
        checks = [n for n in module.graph.nodes
                  if n.op == "call_function" and n.target in _CHECKS and not n.users]
        for n in checks:
            module.graph.erase_node(n)
        if checks and module is not gm:
            module.recompile()   # run_passes recompiles the top graph; a submodule's is ours
    return gm


DROP_METADATA_ASSERTS = Pass("drop_metadata_asserts", _drop_checks)

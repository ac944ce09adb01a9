"""The loss in fp32 under mixed precision.

Under bf16 training every stack computes the loss on fp32 logits: torch.autocast's fp32 op list
holds log_softmax and nll_loss, Megatron-LM's cross-entropy converts the logits to float, and
torchtitan's loss calls `.float()` on them. A bf16 log-softmax over a large vocabulary loses
the small probabilities, and the cost model prices the saved log-probabilities at 4 bytes
(passes/graph_profile.py LOSS_BYTES_PER_ELEM). This pass makes the graph say so: the floating
input of each log-softmax / cross-entropy node is cast with `aten.to.dtype(x, torch.float32)`, which
returns its input itself when it already is fp32 (an fp32 run is unchanged: no copy, nothing more
saved) and an fp32 copy under bf16 (its backward casts the gradient back). The same for the
tensor-parallel pass's vocabulary-parallel cross-entropy (autopar.runtime.shard), which
computes in fp32 inside but returns its input's dtype: given bf16 logits it would round the
loss to 8 significant bits.

`fp32_loss_pass()` is a pass-list entry (run per chunk, after passes.pipeline.split_chunks, or
on the whole graph).
Requires: node.meta[VAL] on the loss nodes' inputs. Guarantees: every node of LOSS_OPS (and
  every vocab_parallel_cross_entropy) reads its first argument as fp32; the same values and
  gradients under fp32.
Reads node.meta: VAL, REGION. Writes: VAL and REGION (the loss node's) on the casts it inserts.
"""
from __future__ import annotations

import torch
import torch.fx

from autopar.passes import meta as K
from autopar.passes.manager import Pass
from autopar.runtime.shard import vocab_parallel_cross_entropy

aten = torch.ops.aten
# the ops autocast runs in fp32 that a language-model loss is made of
LOSS_OPS = frozenset({aten.cross_entropy_loss.default, aten._log_softmax.default,
                      aten.log_softmax.int})
# ... and what the tensor-parallel pass makes of them (vocabulary-parallel logits)
_CAST_OPS = LOSS_OPS | {vocab_parallel_cross_entropy}


def fp32_loss_pass() -> Pass:
    """The pass casting each loss op's input to fp32 (see the module docstring)."""
    return Pass("fp32-loss", _cast_loss_inputs, reads=(K.VAL, K.REGION),
                writes=(K.VAL, K.REGION))


def _cast_loss_inputs(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _CAST_OPS:
            continue
        x = n.args[0]
        val = x.meta.get(K.VAL) if isinstance(x, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        with gm.graph.inserting_before(n):
            cast = gm.graph.call_function(aten.to.dtype, (x, torch.float32))
        cast.meta[K.VAL] = torch.empty(tuple(val.shape), dtype=torch.float32, device="meta")
        if K.REGION in n.meta:
            cast.meta[K.REGION] = n.meta[K.REGION]
        n.args = (cast, *n.args[1:])
    return gm

"""Build the per-chunk graphs of a ParallelProgram: capture → layers → tensor split → cut.

`build_program(prog, precision)` captures the FULL model (every layer, no repeat limit) with
example inputs resized to the plan's micro-batch size (the graph has static shapes: views carry
the batch dimension) in the run's compute dtype (precision "bf16": traced on bf16 parameters,
passes/capture.py, so a norm's fp32 upcast is a real cast and the dtypes export bakes in are
bf16; "fp32": as the model is; a 16-bit graph also loses export's metadata checks,
passes/export_checks.py) and runs the layers pass on it. `BuiltProgram.chunks(tp_rank)` then runs,
per tensor rank, the pass pipeline (passes/manager.py: lint + recompile after each pass):

    full_graph_passes   the context split's layouts (plan.c > 1: the sharding engine's
                        context mode on the captured graph, recorded in meta),
                        the tensor-parallel rewrite (plan.t > 1, or weights to materialise),
                        the context-parallel rewrite reading those layouts (plan.c > 1,
                        passes/context_parallel.py),
                        then, when plan.t > 1 and the schedule does not split the backward
                        into B and W, passes.overlap's fusion of each column-parallel entry
                        with its projections (the input gradient's all-reduce overlaps the
                        weight gradients), and the expert-parallel rewrite (plan.ep > 1,
                        passes/expert_parallel.py: this expert rank's E/ep experts, tokens
                        exchanged by all-to-all), and with c·d > 1 the router load-balancing
                        loss's token counts averaged over the data group
                        (passes/router_stats.py)
    split_chunks        the plan's p·v chunks
    chunk_passes        per chunk, the loss in fp32 (passes/loss_precision.py: a no-op under
                        fp32, fp32 logits under bf16), then recompute per plan.recompute (whole
                        blocks for 'full' and 'op', the attention core for 'selective'; after
                        the cut, so region meta is intact)

The result is cached on the program per precision (`prog._autopar_built`).
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from autopar.passes import meta as K
from autopar.passes.capture import capture
from autopar.passes.device import DEVICE_PASS
from autopar.passes.expert_parallel import expert_parallel_pass
from autopar.passes.export_checks import DROP_METADATA_ASSERTS
from autopar.passes.context_parallel import context_layout_pass, context_parallel_pass
from autopar.passes.layers import LAYERS_PASS
from autopar.passes.fp8 import fp8_pass
from autopar.passes.loss_precision import fp32_loss_pass
from autopar.passes.manager import Pass, run_passes
from autopar.passes.overlap import OVERLAP_COLUMNS_PASS, OVERLAP_PASS
from autopar.passes.router_stats import router_stats_pass
from autopar.passes.pipeline import check_stages, chunk_attr_targets, count_layers, split_chunks
from autopar.passes.recompute import recompute_pass
from autopar.passes.tensor_parallel import tensor_parallel_pass
from autopar.plan import Plan
from autopar.schedules import SPLIT_BACKWARD

# precision -> compute dtype (bf16: bf16 compute, fp32 master weights; autopar.runtime.precision;
# fp16: the same in fp16 with dynamic loss scaling, autopar.runtime.loss_scale)
# fp8 / fp8-rowwise: bf16 as above, the blocks' linear GEMMs in FP8 (passes/fp8.py, tensorwise
# or rowwise scaling)
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
              "fp8": torch.bfloat16, "fp8-rowwise": torch.bfloat16}
FP8_RECIPES = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}


@dataclass
class BuiltProgram:
    """The captured full graph and, per tensor rank, its chunk GraphModules."""
    plan: Plan
    gm: torch.fx.GraphModule                 # full graph, regions labelled, not tensor-split
    num_layers: int
    prefix: str                              # capture's module prefix ("model.")
    state_keys: dict[str, str]               # user state-dict key -> graph attribute name
    example_args: tuple                      # (*inputs, targets) at micro-batch size
    model: torch.nn.Module | None = None       # the user's model (meta parameters are
    init: Any = None                           # materialised from its own init, see shard.py)
    _chunks: dict[tuple, list[torch.fx.GraphModule]] = field(default_factory=dict)
    tp_results: dict[int, Any] = field(default_factory=dict)
    _attrs: list[set[str]] | None = None
    precision: str = "fp32"                    # the compute dtype the graph was captured in

    def chunks(self, tp_rank: int = 0, pp_rank: int | None = None, *,
               weights: bool = True, ep_rank: int = 0) -> list[torch.fx.GraphModule]:
        """The p·v chunk GraphModules as tensor rank `tp_rank` runs them.

        Which weights are real tensors (local shards only, issue 3): with `pp_rank`, only
        those of pipeline rank pp_rank's chunks (c ≡ pp_rank mod p) — the other chunks' are
        meta tensors of their local shape, so no rank ever holds the whole model; with
        weights=False none (code generation needs shapes only); with neither, all chunks'
        (single-process inspection and tests). ep_rank: the expert rank whose E/ep experts
        the chunks keep (plan.ep > 1). Cached per (tp_rank, pp_rank, weights, ep_rank).
        """
        if not 0 <= tp_rank < self.plan.t:
            raise ValueError(f"tp_rank={tp_rank}: must lie in [0, t={self.plan.t})")
        if pp_rank is not None and not 0 <= pp_rank < self.plan.p:
            raise ValueError(f"pp_rank={pp_rank}: must lie in [0, p={self.plan.p})")
        if not 0 <= ep_rank < self.plan.ep:
            raise ValueError(f"ep_rank={ep_rank}: must lie in [0, ep={self.plan.ep})")
        key = (tp_rank, pp_rank if weights else None, weights, ep_rank)
        if key not in self._chunks:
            self._chunks[key] = self._cut(tp_rank, self._materialize(pp_rank, weights),
                                          ep_rank)
        return self._chunks[key]

    def user_tensors(self) -> dict[int, torch.Tensor]:
        """id -> tensor of the user's parameters and buffers the captured graph holds (the
        build shares them, never writes them; whoever trains must copy them)."""
        return {id(x): x for x in list(self.gm.parameters()) + list(self.gm.buffers())}

    def release(self, tp_rank: int, pp_rank: int | None = None, ep_rank: int = 0) -> None:
        """Forget cached chunks so their weights are freed once the runtime owns copies."""
        self._chunks.pop((tp_rank, pp_rank, True, ep_rank), None)

    def _materialize(self, pp_rank: int | None, weights: bool) -> set[str] | None:
        if not weights:
            return set()
        if pp_rank is None:
            return None
        if self._attrs is None:
            self._attrs = chunk_attr_targets(self.gm, self.plan)
        p, n = self.plan.p, len(self.plan.stages)
        return set().union(*(self._attrs[c] for c in range(pp_rank, n, p)))

    def _cut(self, tp_rank: int, materialize: set[str] | None,
             ep_rank: int = 0) -> list[torch.fx.GraphModule]:
        # the passes work in place: on a copy of the graph and module tree that shares the
        # tensors (they replace attributes, never write into a tensor), so a real model's
        # weights are not duplicated on every rank
        with warnings.catch_warnings():
            # torch 2.13's GraphModule deepcopy copies its pytree specs through a path its
            # own deprecation flags (a FutureWarning per chunk on every rank): not ours
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                    category=FutureWarning)
            copied = copy.deepcopy(self.gm, self.user_tensors())
        gm = run_passes(copied, self._full_graph_passes(tp_rank, materialize, ep_rank))
        if K.TP_INFO in gm.meta:
            self.tp_results[tp_rank] = gm.meta[K.TP_INFO]
        chunk_passes = [fp32_loss_pass(), recompute_pass(self.plan.recompute)]
        if self.precision in FP8_RECIPES:   # before recompute: it copies the FP8 calls
            chunk_passes.insert(1, fp8_pass(FP8_RECIPES[self.precision]))
        return [run_passes(c, chunk_passes)
                for c in split_chunks(gm, self.plan, prefix=self.prefix)]

    def _full_graph_passes(self, tp_rank: int, materialize: set[str] | None,
                           ep_rank: int = 0) -> list[Pass]:
        # group=None: the graph gets a placeholder tensor group (get_attr `tp_group`) that the
        # runtime binds to this rank's real group when it loads the generated chunk.
        # With t = 1 the rewrite only materialises meta parameters (global-shape init of their
        # module) and turns other pipeline ranks' weights into meta tensors. Last, the
        # capture's device constants become `rank_device`, bound to each rank's device.
        passes = []
        if self.plan.c > 1:   # the engine's sequence layouts, read by the context rewrite
            passes.append(context_layout_pass(self.plan))
        if self.plan.t > 1 or self.plan.c > 1 or _has_meta(self.gm) or materialize is not None:
            passes.append(tensor_parallel_pass(self.plan, tp_rank, None, model=self.model,
                                               init=self.init, materialize=materialize))
        if self.plan.c > 1:   # after the tensor split: it keeps the sequence dims whole
            passes.append(context_parallel_pass(self.plan))
        if self.plan.t > 1 and self.plan.schedule not in SPLIT_BACKWARD:
            passes.append(OVERLAP_COLUMNS_PASS if self.precision in FP8_RECIPES
                          else OVERLAP_PASS)
        if self.plan.ep > 1:   # group None: `ep_group`, bound by the runtime to its group
            passes.append(expert_parallel_pass(self.plan.ep, ep_rank))
        if self.plan.d * self.plan.c > 1:   # load-balancing counts over the c·d data group
            passes.append(router_stats_pass(self.plan.d * self.plan.c))
        return passes + [DEVICE_PASS]


def _resize_batch(x: Any, b: int) -> Any:
    """A fresh copy of x with batch dimension b (rows repeated cyclically).

    Always a copy: torch.export treats one tensor passed twice (inputs and targets) as one
    input, which would wire the targets to the inputs.
    """
    if not isinstance(x, torch.Tensor):
        return x
    if x.dim() == 0 or x.shape[0] == b:
        return x.clone()
    idx = torch.arange(b, device=x.device) % x.shape[0]
    return x[idx].clone()


def _state_keys(model: torch.nn.Module, gm: torch.fx.GraphModule, prefix: str) -> dict[str, str]:
    """Map every key of model.state_dict() to the graph attribute holding that tensor.

    Tied weights are one tensor under several keys; the graph names one of them.
    """
    targets = {n.target[len(prefix):] if n.target.startswith(prefix) else n.target
               for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    by_id: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(value), []).append(key)
    out: dict[str, str] = {}
    for keys in by_id.values():
        graph_name = next((k for k in keys if k in targets), None)
        for k in keys:
            out[k] = graph_name if graph_name is not None else k
    return out


def _has_meta(gm: torch.fx.GraphModule) -> bool:
    return any(t.is_meta for t in list(gm.parameters()) + list(gm.buffers()))


def build_program(prog: Any, precision: str = "fp32") -> BuiltProgram:
    """Capture (in `precision`'s compute dtype), label and (lazily, per tensor rank) cut
    `prog`'s model; cached on `prog` per precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: must be one of {sorted(PRECISIONS)} "
                         f"(bf16 = bf16 compute with fp32 master weights)")
    cache = prog.__dict__.setdefault("_autopar_built", {})
    if precision in cache:
        return cache[precision]
    plan: Plan = prog.plan
    if prog.loss_fn is None or prog.example_targets is None:
        raise ValueError("build: the program has no loss_fn/example_targets; pipeline training "
                         "needs the loss in the graph — parallelize(..., loss_fn=autopar."
                         "cross_entropy)")
    b = plan.micro_batch_size
    inputs = tuple(_resize_batch(x, b) for x in prog.example_inputs)
    targets = _resize_batch(prog.example_targets, b)
    captured = capture(prog.model, inputs, prog.loss_fn, targets,
                       compute_dtype=PRECISIONS[precision],
                       keywords=getattr(prog, "input_keywords", ()))
    # fp32: the graph export made, as it always was; 16-bit: without export's dtype checks
    low = [DROP_METADATA_ASSERTS] if precision != "fp32" else []
    gm = run_passes(captured.gm, low + [LAYERS_PASS])
    num_layers = count_layers(gm)
    check_stages(plan, num_layers)
    built = BuiltProgram(plan=plan, gm=gm, num_layers=num_layers, prefix=captured.prefix,
                         state_keys=_state_keys(prog.model, gm, captured.prefix),
                         example_args=inputs + (targets,), model=prog.model,
                         init=getattr(prog, "init", None), precision=precision)
    cache[precision] = built
    return built

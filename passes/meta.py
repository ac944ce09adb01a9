"""Every `node.meta` / `gm.meta` key autopar reads or writes, declared once.

Code spells a key by its constant (`node.meta[meta.REGION]`), never by its string. The keys
autopar writes follow one scheme, `autopar_<concept>[_<detail>]`; torch's own keys keep the
names torch gives them and are listed as inputs (writer "torch.export").

`KEYS` is the registry: per key its scope ("node": `node.meta`, "graph": `gm.meta`), value
type, meaning, the module that writes it (and those that rewrite or copy it onto nodes they
make) and the modules that read it — exactly the modules whose source does, by module path
(tests/unit/test_meta_keys.py scans the source with `ast` and holds the lists to the code; "tests"
as a reader: only tests read it). `passes.manager.Pass` declares its reads and writes with
these constants and checks them against the registry.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class MetaKey:
    """One declared key: where it lives, what it holds, who writes and who reads it.
    `writer`: the module that makes it ("torch.export" for torch's keys); `rewritten_by`: the
    other modules that write it (a rewrite that changes it, a pass that copies it onto the
    nodes it makes); `readers`: the modules that read it."""
    name: str
    scope: Literal["node", "graph"]
    type: str
    meaning: str
    writer: str
    readers: tuple[str, ...]
    rewritten_by: tuple[str, ...] = ()


# ----- torch's keys (inputs; capture guarantees them) ------------------------------------------
VAL = "val"
NN_MODULE_STACK = "nn_module_stack"
STACK_TRACE = "stack_trace"

# ----- capture and layers ----------------------------------------------------------------------
REPEATS = "autopar_repeats"
REPEAT_KEYS = "autopar_repeat_keys"
REGION = "autopar_region"
LAYERS = "autopar_layers"

# ----- the profile (planning graph only) -------------------------------------------------------
GEMM = "autopar_gemm"
GEMM_SPLIT = "autopar_gemm_split"
GEMM_IDX = "autopar_gemm_idx"
OTHER = "autopar_other"
SAVED = "autopar_saved"
PARAMS = "autopar_params"

# ----- tensor parallelism ----------------------------------------------------------------------
TP_LAYOUT = "autopar_tp_layout"
TP_ROLE = "autopar_tp_role"
TP_CONVERT = "autopar_tp_convert"
TP_PARAM = "autopar_tp_param"
TP_GLOBAL_VAL = "autopar_tp_global_val"
TP_INFO = "autopar_tp_info"
EP_PARAM = "autopar_ep_param"

# ----- context parallelism ---------------------------------------------------------------------
CP_SEQ_DIM = "autopar_cp_seq_dim"
CP_SELECT = "autopar_cp_select"
CP_PARTIAL = "autopar_cp_partial"
CP_REDUCE = "autopar_cp_reduce"

# ----- overlap, pipeline cut, recompute --------------------------------------------------------
OVERLAP = "autopar_overlap"
CHUNK = "autopar_chunk"
RECOMPUTE = "autopar_recompute"

KEYS: tuple[MetaKey, ...] = (
    MetaKey(name=VAL, scope="node", type="FakeTensor | tensor on meta | tuple of them",
            meaning="shape and dtype of the node's value (local shapes after the "
                    "tensor-parallel rewrite)",
            writer="torch.export",
            rewritten_by=("passes.tensor_parallel", "passes.context_parallel",
                          "passes.expert_parallel", "passes.overlap", "passes.recompute",
                          "passes.loss_precision", "passes.router_stats"),
            readers=("passes.layers", "passes.graph_facts", "passes.sharding.ops",
                     "passes.sharding.propagator", "passes.sharding.views",
                     "passes.tp_layouts", "passes.tensor_parallel", "passes.tp_cost",
                     "passes.overlap", "passes.pipeline", "passes.recompute",
                     "passes.context_parallel", "passes.expert_chains", "passes.expert_parallel",
                     "passes.fp8", "passes.loss_precision", "passes.router_stats",
                     "passes.graph_profile")),
    MetaKey(name=NN_MODULE_STACK, scope="node", type="dict[str, tuple[str, type | str]]",
            meaning="module path of the user's code that made the node",
            writer="torch.export", rewritten_by=("passes.tensor_parallel",),
            readers=("passes.capture", "passes.layers", "passes.graph_profile",
                     "passes.tensor_parallel", "autopar.codegen")),
    MetaKey(name=STACK_TRACE, scope="node", type="str",
            meaning="the user's source lines that made the node (named in errors)",
            writer="torch.export", rewritten_by=("passes.tensor_parallel",),
            readers=("passes.sharding.ops", "passes.sharding.context", "passes.pipeline",
                     "passes.recompute", "passes.tensor_parallel", "autopar.codegen")),
    MetaKey(name=REPEATS, scope="graph", type="dict[str, int]",
            meaning="true child count of each repeated block container capture truncated, "
                    "by its path in NN_MODULE_STACK; empty for a full capture",
            writer="passes.capture", readers=("passes.layers",)),
    MetaKey(name=REPEAT_KEYS, scope="graph", type="dict[str, tuple[str, ...]]",
            meaning="for each container capture truncated, the key of the kept child every "
                    "true child stands for (one kept child per parameter layout)",
            writer="passes.capture", readers=("passes.layers",)),
    MetaKey(name=REGION, scope="node", type="tuple[str, int | None]",
            meaning='("embedding", None) | ("block", i) | ("head", None)',
            writer="passes.layers", rewritten_by=("passes.recompute", "passes.loss_precision"),
            readers=("passes.activation_meter", "passes.pipeline", "passes.recompute",
                     "passes.fp8", "passes.loss_precision")),
    MetaKey(name=LAYERS, scope="graph", type="passes.layers.LayerStructure",
            meaning="the blocks, embedding and head regions and the values crossing blocks",
            writer="passes.layers", readers=("passes.layers", "autopar.api")),
    MetaKey(name=GEMM, scope="node", type="cost.profile.Gemm",
            meaning="the GEMM of a weight matmul node, as the cost model prices it",
            writer="passes.graph_profile", readers=("passes.tp_cost",)),
    MetaKey(name=GEMM_SPLIT, scope="node", type='"n" | "k" | "batch" | None',
            meaning="Megatron's structural split of a GEMM node (column, row, batched)",
            writer="passes.graph_profile", readers=("passes.activation_meter", "passes.tp_cost")),
    MetaKey(name=GEMM_IDX, scope="node", type="tuple[int, ...]",
            meaning="indices of the node's GEMMs in its region's RegionProfile.gemms",
            writer="passes.graph_profile", readers=("passes.tp_cost", "passes.graph_profile")),
    MetaKey(name=OTHER, scope="node", type="tuple[float, bool]",
            meaning="non-GEMM bytes moved per sequence, and whether counted as split",
            writer="passes.graph_profile", readers=("passes.tp_cost",)),
    MetaKey(name=SAVED, scope="node", type='list[tuple[str | None, float, str]]',
            meaning='tensors the node saves for backward: (producer name, bytes per sequence, '
                    '"split" | "repl" | "attn")',
            writer="passes.activation_meter", readers=("passes.tp_cost",)),
    MetaKey(name=PARAMS, scope="graph", type="dict[str, dict[int, tuple[int, bool]]]",
            meaning="per region: parameter identity -> (elements, split) as profiled",
            writer="passes.graph_profile", readers=("passes.tp_cost",)),
    MetaKey(name=CP_SEQ_DIM, scope="node", type="int",
            meaning="the dim of the node's value that holds this context rank's tokens (absent: "
                    "the value is whole on every context rank); recorded by the engine before "
                    "the tensor split, copied by it onto the nodes it makes from their input",
            writer="passes.context_parallel", rewritten_by=("passes.tensor_parallel",),
            readers=("passes.context_parallel", "passes.tensor_parallel")),
    MetaKey(name=CP_SELECT, scope="node", type="dict[str, int]",
            meaning="operands (by name) this node reads whole along a dim that meets the "
                    "rank's tokens: selected at the rank's positions (context_select) on "
                    "that dim",
            writer="passes.context_parallel", readers=("passes.context_parallel",)),
    MetaKey(name=CP_PARTIAL, scope="node", type="bool",
            meaning="the node's value is this context rank's summand of a sum over the "
                    "tokens (a sum along them, a count of them: histc) — whole-shaped, the "
                    "rank's own",
            writer="passes.context_parallel", readers=("passes.context_parallel",)),
    MetaKey(name=CP_REDUCE, scope="node", type="list[str]",
            meaning="operands (by name, CP_PARTIAL values) this node reads summed over the "
                    "context ranks (context_sum, an all-reduce) before it",
            writer="passes.context_parallel", readers=("passes.context_parallel",)),
    MetaKey(name=TP_LAYOUT, scope="node",
            type="Replicate | Shard | Partial | Whole | tuple of them",
            meaning="how the tensor ranks hold the node's value",
            writer="passes.tp_layouts", rewritten_by=("passes.tensor_parallel",),
            readers=("passes.tp_layouts", "passes.tensor_parallel", "passes.tp_cost",
                     "passes.pipeline")),
    MetaKey(name=TP_ROLE, scope="node", type="str",
            meaning='what the rewrite does to the node: "column" | "row" | "vocab_embedding" '
                    '| "vocab_ce" | "partial_mean" | "split_norm"',
            writer="passes.tp_layouts",
            readers=("passes.tp_layouts", "passes.tensor_parallel", "passes.tp_cost")),
    MetaKey(name=TP_CONVERT, scope="node", type="dict[str, Layout]",
            meaning="input name -> the layout the node needs it in (a collective or slice)",
            writer="passes.tp_layouts", readers=("passes.tensor_parallel", "passes.tp_cost")),
    MetaKey(name=TP_PARAM, scope="node", type="autopar.runtime.shard.ParamSplit",
            meaning="the split of a get_attr parameter (split ones only)",
            writer="passes.tp_layouts",
            readers=("passes.tensor_parallel", "passes.fp8")),
    MetaKey(name=TP_GLOBAL_VAL, scope="node", type="tensor on meta | tuple of them",
            meaning="the single-device value shape of a node whose VAL the rewrite made local",
            writer="passes.tensor_parallel",
            readers=("passes.tensor_parallel",)),
    MetaKey(name=EP_PARAM, scope="node", type="passes.expert_parallel.ExpertSlice",
            meaning="the experts a get_attr expert parameter keeps on this expert rank (dim 0)",
            writer="passes.expert_parallel", readers=("autopar.compile",)),
    MetaKey(name=TP_INFO, scope="graph", type="passes.tp_layouts.TPInfo",
            meaning="the tensor-parallel decision for one t and sequence-parallel mode",
            writer="passes.tp_layouts",
            readers=("passes.tensor_parallel", "passes.tp_cost", "autopar.build")),
    MetaKey(name=OVERLAP, scope="graph", type="int",
            meaning="how many column-parallel entries were fused with their projections, "
                    "plus row-parallel projections fused with their reduction",
            writer="passes.overlap", readers=("tests",)),
    MetaKey(name=CHUNK, scope="graph", type="passes.pipeline.ChunkSpec",
            meaning="what the runtime needs to know about a chunk besides its code",
            writer="passes.pipeline",
            readers=("autopar.codegen", "autopar.compile")),
    MetaKey(name=RECOMPUTE, scope="graph", type='dict: {"mode": str, "regions": list[str]}',
            meaning="the recompute mode and the checkpointed submodules of a chunk",
            writer="passes.recompute", readers=("tests",)),
)

BY_NAME: MappingProxyType[str, MetaKey] = MappingProxyType({k.name: k for k in KEYS})


def declared(name: str) -> MetaKey:
    """The registry entry of `name`; ValueError for a key nobody declared."""
    if name not in BY_NAME:
        raise ValueError(f"meta key {name!r} is not declared in autopar.passes.meta; declare it "
                         f"there (scope, type, meaning, writer, readers) and use its constant")
    return BY_NAME[name]

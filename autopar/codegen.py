"""Emit each pipeline chunk as a readable Python module; load such a module back for the runtime.

A chunk module holds a header docstring (chunk, layers, ranks, degrees, collectives), the
imports its code needs, constants the runtime reads (RECV/SEND boundaries, MODEL_INPUTS,
PARAMETERS with the user's state-dict names), and `class ChunkNN(torch.nn.Module)` whose
`forward` is the FX-generated code of the chunk graph. The runtime attaches this rank's local
parameter tensors to an instance and calls it: what runs is exactly this source
(`load_chunk_module`), whether generated in memory or read back from `prog.save(dir)`.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import json
import linecache
import math
import os
import re
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import torch
import torch.fx

from autopar.build import build_program
from autopar.cost.hardware import Cluster, cluster_to_dict
from autopar.passes import meta as K
from autopar.passes.device import RANK_DEVICE, uses_rank_device
from autopar.passes.pipeline import ChunkSpec
from autopar.saved_program import BUILD_FILE, build_info, chunk_file_name

_COLLECTIVE_MODULES = ("autopar.runtime.collectives", "autopar.runtime.shard", "torch.distributed")


def _import_lines(globals_: dict[str, Any]) -> list[str]:
    """Import statements binding every global the FX code refers to."""
    lines: list[str] = []
    for name, obj in sorted(globals_.items()):
        if name in ("fx_pytree", "pytree"):
            continue  # only used by pytree-flattening codegen, which chunk graphs do not have
        if isinstance(obj, types.ModuleType):
            lines.append(f"import {obj.__name__}" if obj.__name__ == name
                         else f"import {obj.__name__} as {name}")
        elif obj is type(None):
            lines.append(f"{name} = type(None)")
        elif isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
            lines.append(f"from math import {name}")
        elif obj is torch.device:
            lines.append(f"from torch import device as {name}")
        elif hasattr(obj, "__module__") and hasattr(obj, "__qualname__"):
            mod, qual = obj.__module__, obj.__qualname__
            if "." in qual or "<" in qual:
                lines.append(f"import {mod}\n{name} = {mod}.{qual}")
            else:
                lines.append(f"from {mod} import {qual} as {name}" if qual != name
                             else f"from {mod} import {qual}")
        else:
            raise ValueError(f"codegen: the chunk graph refers to {name} = {obj!r}, which "
                             f"cannot be written as an import; make it a module-level function "
                             f"or pass it as a graph argument")
    return lines


def _collectives(gm: torch.fx.GraphModule) -> list[str]:
    names = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        target = n.target
        mod = getattr(target, "__module__", "") or ""
        qual = getattr(target, "__qualname__", getattr(target, "__name__", str(target)))
        if mod.startswith(_COLLECTIVE_MODULES) or "_c10d_functional" in str(target):
            label = f"{mod}.{qual}" if mod else str(target)
            if label not in names:
                names.append(label)
    return names


def render_chunk(gm: torch.fx.GraphModule, plan: Any, tp_rank: int = 0,
                 model_name: str = "model", precision: str = "fp32") -> str:
    """The Python source of one chunk GraphModule (from passes.pipeline.split_chunks), built
    for `precision` (autopar.build: the graph was captured in its compute dtype).
    Why this size: one template of the generated module (imports, parameter table, forward, its
    nested formatting helpers) read top to bottom; split, the template would be in pieces."""
    spec: ChunkSpec = gm.meta[K.CHUNK]
    collectives = _collectives(gm)
    cls = f"Chunk{spec.chunk:02d}"
    params = {attr: (qual, tuple(getattr(gm, attr).shape),
                     str(getattr(gm, attr).dtype).replace("torch.", ""))
              for attr, qual in spec.params.items()}
    buffers = {attr: (qual, tuple(getattr(gm, attr).shape),
                      str(getattr(gm, attr).dtype).replace("torch.", ""))
               for attr, qual in spec.buffers.items()}

    def bounds(bs) -> str:
        return "[\n" + "".join(f"    {(b.name, b.shape, b.dtype, b.requires_grad, b.replicated)!r},\n"
                               for b in bs) + "]"

    def describe(bs, direction: str) -> str:
        if not bs:
            return "nothing"
        return ", ".join(f"{b.name} {tuple(b.shape)} {b.dtype}" for b in bs) + f" {direction}"

    prev_rank = (spec.chunk - 1) % plan.p
    next_rank = (spec.chunk + 1) % plan.p
    header = f'''"""autopar pipeline chunk {spec.chunk} of {spec.num_chunks} ({model_name}): {spec.describe()}.

Runs on pipeline rank {spec.rank} (chunk c -> rank c mod p, p={plan.p}, v={plan.v}); tensor rank
{tp_rank} of t={plan.t}; data-parallel degree d={plan.d}; schedule {plan.schedule}, micro-batch
size {plan.micro_batch_size}, {plan.num_microbatches} micro-batches per step.
Receives: {describe(spec.recv, f"from chunk {spec.chunk - 1} (pipeline rank {prev_rank})")}.
Sends:    {describe(spec.send, f"to chunk {spec.chunk + 1} (pipeline rank {next_rank})")}.
Returns:  {"the scalar loss (mean over the micro-batch)" if spec.returns_loss else "the values it sends"}.
Collectives: {", ".join(collectives) if collectives else "none (p2p send/recv is done by the runtime)"}.

Generated by autopar.codegen from the FX graph; autopar.runtime executes this file as written.
"""'''
    consts = [
        f"CHUNK = {spec.chunk}",
        f"NUM_CHUNKS = {spec.num_chunks}",
        f"PIPELINE_RANK = {spec.rank}",
        f"TENSOR_RANK = {tp_rank}",
        "# the precision the graph was captured for; compile() refuses to run it in another",
        f"PRECISION = {precision!r}",
        f"LAYERS = ({spec.first_layer}, {spec.last_layer})  # blocks [first, last)",
        f"EMBEDDING = {spec.embedding}",
        f"HEAD = {spec.head}",
        f"COLLECTIVES = {collectives!r}",
        "# (name, shape, dtype, requires_grad, replicated over the tensor group) of each value",
        "# received from the previous chunk",
        f"RECV = {bounds(spec.recv)}",
        "# ... and sent to the next chunk (forward outputs, in order)",
        f"SEND = {bounds(spec.send)}",
        "# indices into SEND of values this chunk also reads (kept after sending)",
        f"SEND_KEPT = {list(spec.send_kept)!r}",
        "# indices into (*model_inputs, targets) that forward takes after the received values",
        f"MODEL_INPUTS = {list(spec.model_inputs)!r}",
        f"RETURNS_LOSS = {spec.returns_loss}",
        "# the loss is the mean over the targets other than this index (the runtime weighs each",
        "# micro-batch by its counted tokens); None: another loss, micro-batches averaged",
        f"LOSS_IGNORE_INDEX = {spec.loss_ignore_index!r}",
        "# attribute -> (user state-dict key, local shape, dtype)",
        "PARAMETERS = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in params.items()) + "}",
        "BUFFERS = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in buffers.items()) + "}",
        "# non-tensor attributes bound by the runtime ('tp_group': this rank's tensor group,",
        "# 'tp_rng': its dropout streams, 'rank_device': its device)",
        f"OBJECTS = {_objects(gm, spec)!r}",
    ]
    doc = (f"{spec.describe()}. Parameters and buffers are attached by the runtime "
           f"(see PARAMETERS).")
    globals_: dict[str, Any] = {}
    classes = _render_class(gm, cls, doc, globals_)
    imports = ["import torch"] + [ln for ln in _import_lines(globals_) if ln != "import torch"]
    return "\n\n".join([header, "\n".join(imports), "\n".join(consts), *classes,
                        f"CHUNK_CLASS = {cls}\n"])


def _objects(gm: torch.fx.GraphModule, spec: ChunkSpec) -> dict[str, str]:
    """The chunk's non-tensor attributes, `rank_device` also when only a submodule reads it."""
    objects = dict(spec.objects)
    if uses_rank_device(gm):
        objects[RANK_DEVICE] = RANK_DEVICE
    return objects


def _render_class(gm: torch.fx.GraphModule, cls: str, doc: str,
                  globals_: dict[str, Any]) -> list[str]:
    """Class sources for `gm` and, first, the graph submodules it calls (higher-order ops such
    as autocast / set_grad_enabled regions keep their body as a submodule)."""
    graph = _named_by_module(gm.graph)
    code = graph.python_code(root_module="self")
    globals_.update(code.globals)
    out: list[str] = []
    init = []
    for name, child in gm.named_children():
        if isinstance(child, torch.fx.GraphModule):
            sub_cls = f"{cls}_{name}"
            out += _render_class(child, sub_cls, f"Graph submodule {name} of {cls}.", globals_)
            init.append(f"        self.{name} = {sub_cls}()")
        elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
            raise ValueError(f"codegen: chunk submodule {name} ({type(child).__name__}) holds "
                             f"state; only graph submodules can be emitted")
    body = textwrap.indent(_with_source_comments(code.src.strip("\n"), graph), "    ")
    init_src = ("\n    def __init__(self):\n        super().__init__()\n" + "\n".join(init) + "\n"
                if init else "")
    out.append(f'class {cls}(torch.nn.Module):\n    """{doc}"""\n{init_src}\n{body}\n')
    return out


def _named_by_module(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of `graph` whose computed values are named after the module that computed them
    and the op (`layers_0_attn_q_proj_linear`, not `linear_3`), from torch.export's
    nn_module_stack; values made outside any submodule keep their names. Only local names of
    the generated forward change: its inputs, outputs and attributes are the graph's."""
    named = copy.deepcopy(graph)
    for node in named.nodes:
        stack = node.meta.get(K.NN_MODULE_STACK) if node.op == "call_function" else None
        if not stack:
            continue
        path = list(stack.values())[-1][0]
        path = path[len(MODEL_PREFIX):] if path.startswith(MODEL_PREFIX) else path
        if path:
            op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            node._rename(f"{path}_{op}".replace(".", "_"))   # the namespace keeps names unique
    return named


# the loss wrapper's attribute holding the user's model (passes/capture.py)
MODEL_PREFIX = "model."
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>[^\n]*)')
_TORCH_DIR = os.path.dirname(torch.__file__)


def _user_frame(stack_trace: str | None) -> str | None:
    """`file:line in fn: code` of the innermost frame of a node's stack trace (as torch.export
    records it) that is not torch's own: the user's model line that made the node."""
    frames = [m for m in _FRAME.finditer(stack_trace or "")
              if not m["file"].startswith(_TORCH_DIR)]
    if not frames:
        return None
    f = frames[-1]
    path = f["file"]
    if "site-packages" + os.sep in path:        # transformers/models/llama/modeling_llama.py
        path = path.split("site-packages" + os.sep, 1)[1]
    return f"{path}:{f['line']} in {f['fn']}: {f['code'].strip()}"


def _with_source_comments(src: str, graph: torch.fx.Graph) -> str:
    """`src` with a `# file:line in fn: code` comment above each run of statements that
    came from the same line of the user's model (node.meta["stack_trace"])."""
    where = {n.name: _user_frame(n.meta.get(K.STACK_TRACE)) for n in graph.nodes}
    out, last = [], None
    for line in src.splitlines():
        name = line.strip().split(" = ", 1)[0] if " = " in line else None
        loc = where.get(name)
        if loc is not None and loc != last:
            out.append(f"{line[:len(line) - len(line.lstrip())]}# {loc}")
            last = loc
        out.append(line)
    return "\n".join(out)


def chunk_source(prog: Any, chunk: int = 0, tp_rank: int = 0, precision: str = "fp32") -> str:
    """The generated Python of pipeline chunk `chunk` as tensor rank `tp_rank` runs it in
    `precision` ("fp32" or "bf16")."""
    built = build_program(prog, precision)
    chunks = built.chunks(tp_rank, weights=False)   # source needs shapes, not weights
    if not 0 <= chunk < len(chunks):
        raise ValueError(f"chunk={chunk}: the plan has {len(chunks)} chunks (p·v = "
                         f"{prog.plan.p}·{prog.plan.v}); pass 0 <= chunk < {len(chunks)}")
    return render_chunk(chunks[chunk], prog.plan, tp_rank, model_name=prog.plan.model,
                        precision=precision)


def load_chunk_module(source: str, filename: str = "<autopar chunk>") -> types.ModuleType:
    """Execute chunk source as a fresh module, registered with linecache (as torch.fx does for
    its generated code) so tracebacks show the generated lines, and in sys.modules under a
    name its source determines: Dynamo looks a function's module up there when it inlines a
    call into it from another module (torch.compile of an 'op'-recompute block, which
    passes.recompute.checkpoint_ops calls back)."""
    digest = hashlib.sha1(f"{filename}\n{source}".encode()).hexdigest()[:16]
    module = types.ModuleType(f"autopar_generated_chunk_{digest}")
    module.__file__ = filename
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own codegen
    sys.modules[module.__name__] = module
    return module


_LAUNCH = '''"""Train this saved autopar program under torchrun: {gpus} ranks as planned (another
count re-plans for it with the same global batch, and resumes from the checkpoint resharded).

    torchrun --standalone --nproc_per_node={gpus} launch.py --data tokens.bin --steps 1000 \\
        --checkpoint ckpt
    ./run.sh --data tokens.bin ...                                  (the same, one node)
    NNODES=2 MASTER_ADDR=head ./run_multinode.sh --data tokens.bin ...   (on every node)
    sbatch slurm.sbatch --data tokens.bin ...

{model_line}
--data: a flat uint16/uint32 token file (nanoGPT's train.bin, a Megatron .bin), each
data-parallel replica reading its rows of every global batch; 'file.py:function' for any other
source (an iterable of global batches); 'random' for random tokens. --eod ID: rows of packed
documents (per-document positions, block-diagonal causal mask). The chunk_*.py files next
to this script are what runs on the planned rank count (edit them and the change takes
effect). `python launch.py --help` lists the options; the loop is autopar/launch.py.
"""
import sys
from pathlib import Path

from autopar.launch import main

if __name__ == "__main__":
    sys.exit(main(Path(__file__).resolve().parent))
'''


_RUN_MULTINODE = """#!/bin/sh
# Multi-node launch of this program: run the same command on every node.
#   NNODES=2 MASTER_ADDR=node0 MASTER_PORT=29500 ./run_multinode.sh --data tokens.bin
# The c10d rendezvous runs on MASTER_ADDR:MASTER_PORT; the plan is for NNODES x NPROC_PER_NODE
# = {gpus} ranks. Elastic: NNODES=MIN:MAX (e.g. 1:2) with MAX_RESTARTS=3 lets the job go on
# with fewer nodes when one is lost; launch.py then re-plans for the ranks that are left (same
# global batch) and resumes from its --checkpoint, resharded.
# torchrun numbers the nodes itself (it ignores --node-rank with c10d); each node's ranks are
# consecutive, so the plan's tensor-parallel groups (adjacent ranks) stay inside a node.
set -eu
: "${{NNODES:={nnodes}}}"
: "${{NPROC_PER_NODE:={per_node}}}"
: "${{MASTER_ADDR:?set MASTER_ADDR to the address of node 0}}"
: "${{MASTER_PORT:=29500}}"
: "${{RDZV_ID:=autopar-{model}}}"
case "$NNODES" in
  *:*) ;;
  *) if [ $((NNODES * NPROC_PER_NODE)) -ne {gpus} ]; then
       echo "run_multinode.sh: NNODES*NPROC_PER_NODE = $((NNODES * NPROC_PER_NODE)), the plan is for {gpus} ranks; launch.py will re-plan for $((NNODES * NPROC_PER_NODE))" >&2
     fi ;;
esac
cd "$(dirname "$0")"
exec torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \\
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" \\
  --max-restarts="${{MAX_RESTARTS:-0}}" launch.py "$@"
"""

_SLURM = """#!/bin/bash
# SLURM batch script for this program: {nnodes} node(s) x {per_node} GPU(s) = {gpus} ranks.
#   sbatch slurm.sbatch --data tokens.bin --steps 1000 --checkpoint ckpt
# One task per node; each runs torchrun, which starts that node's ranks; they meet at a c10d
# rendezvous on the allocation's first node. With --checkpoint a restarted or requeued job
# resumes from the last complete checkpoint.
#SBATCH --job-name=autopar-{model}
#SBATCH --nodes={nnodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --exclusive
#SBATCH --output=autopar-%j.out
set -euo pipefail
PROGRAM_DIR="${{AUTOPAR_PROGRAM_DIR:-{directory}}}"   # where prog.save() wrote this program
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_ADDR=$(srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" hostname --ip-address | awk '{{print $1}}')
export MASTER_PORT=${{MASTER_PORT:-29500}}
srun --kill-on-bad-exit=1 torchrun \\
  --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={per_node} \\
  --rdzv-backend=c10d --rdzv-endpoint="$HEAD_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
  --max-restarts=${{MAX_RESTARTS:-1}} \\
  "$PROGRAM_DIR/launch.py" "$@"
"""


def _nodes(plan: Any, cluster: Any) -> tuple[int, int]:
    """(nodes, ranks per node): nodes of the cluster's size (8 if unknown), divisor of gpus."""
    per_node = min(int(getattr(cluster, "gpus_per_node", 0) or 8), plan.gpus)
    while plan.gpus % per_node:
        per_node -= 1
    return plan.gpus // per_node, per_node


def save_program(prog: Any, directory: Path, *, model: str | None = None,
                 precision: str = "fp32") -> Path:
    """Write plan.json, chunk_XX.py (chunk_XX_tpR.py when t > 1), launch.py, run.sh (one node),
    run_multinode.sh (torchrun, c10d rendezvous), slurm.sbatch (srun torchrun) and build.json
    (`model`, the `file.py:factory` launch.py builds by default, the planning pins, which
    launch.py keeps when it re-plans for another rank count, and `precision`, the one the
    chunks are generated for and launch.py's default --precision)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = prog.plan
    (directory / "plan.json").write_text(plan.to_json())
    for tp in range(plan.t):
        for c in range(plan.p * plan.v):
            (directory / chunk_file_name(c, tp, plan.t)).write_text(
                chunk_source(prog, c, tp, precision))
    model_line = (f"--model defaults to {model} (what autopar build was given)." if model else
                  "--model FILE.py:factory is required: factory() returns the model, or a dict "
                  "with 'model'\nand optionally 'example_inputs', 'loss_fn', 'example_targets' "
                  "(autopar.factory).")
    (directory / "launch.py").write_text(_LAUNCH.format(gpus=plan.gpus, model_line=model_line))
    cluster = getattr(prog, "cluster", None)
    (directory / BUILD_FILE).write_text(build_info(
        model, getattr(prog, "pins", {}), precision,
        cluster_to_dict(cluster) if isinstance(cluster, Cluster) else None,
        getattr(prog, "documents", None)))
    nnodes, per_node = _nodes(plan, getattr(prog, "cluster", None))
    model = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in str(plan.model))
    scripts = {
        "run.sh": "#!/bin/sh\n# usage: ./run.sh --data tokens.bin [--steps N] [--checkpoint ckpt] "
                  "(launch.py --help)\n"
                  f'cd "$(dirname "$0")" && exec torchrun --standalone '
                  f'--nproc_per_node={plan.gpus} launch.py "$@"\n',
        "run_multinode.sh": _RUN_MULTINODE.format(gpus=plan.gpus, nnodes=nnodes,
                                                  per_node=per_node, model=model),
        "slurm.sbatch": _SLURM.format(gpus=plan.gpus, nnodes=nnodes, per_node=per_node,
                                      model=model, directory=directory.resolve()),
    }
    for name, text in scripts.items():
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    (directory / "chunks.json").write_text(json.dumps(
        {chunk_file_name(c, tp, plan.t): {"chunk": c, "tensor_rank": tp,
                                          "pipeline_rank": c % plan.p}
         for tp in range(plan.t) for c in range(plan.p * plan.v)}, indent=2))
    return directory

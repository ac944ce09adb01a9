"""Emit each pipeline chunk as a readable Python module; load such a module back for the runtime.

A chunk module holds a header docstring (chunk, layers, ranks, degrees, collectives), the
imports its code needs, constants the runtime reads (RECV/SEND boundaries, MODEL_INPUTS,
PARAMETERS with the user's state-dict names), and `class ChunkNN(torch.nn.Module)` whose
`forward` is the FX-generated code of the chunk graph. The runtime attaches this rank's local
parameter tensors to an instance and calls it: what runs is exactly this source
(`load_chunk_module`), whether generated in memory or read back from `prog.save(dir)`.
"""
from __future__ import annotations

import hashlib
import json
import linecache
import math
import textwrap
import types
from pathlib import Path
from typing import Any

import torch
import torch.fx

from autopar.build import build_program
from autopar.passes import meta as K
from autopar.passes.pipeline import ChunkSpec

_COLLECTIVE_MODULES = ("autopar.runtime.collectives", "autopar.runtime.shard", "torch.distributed")


def chunk_file_name(chunk: int, tp_rank: int, t: int) -> str:
    return f"chunk_{chunk:02d}.py" if t == 1 else f"chunk_{chunk:02d}_tp{tp_rank}.py"


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
                 model_name: str = "model") -> str:
    """The Python source of one chunk GraphModule (from passes.pipeline.split_chunks)."""
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
        f"LAYERS = ({spec.first_layer}, {spec.last_layer})  # blocks [first, last)",
        f"EMBEDDING = {spec.embedding}",
        f"HEAD = {spec.head}",
        f"COLLECTIVES = {collectives!r}",
        "# (name, shape, dtype, requires_grad, replicated over the tensor group) of each value",
        "# received from the previous chunk",
        f"RECV = {bounds(spec.recv)}",
        "# ... and sent to the next chunk (forward outputs, in order)",
        f"SEND = {bounds(spec.send)}",
        "# indices into (*model_inputs, targets) that forward takes after the received values",
        f"MODEL_INPUTS = {list(spec.model_inputs)!r}",
        f"RETURNS_LOSS = {spec.returns_loss}",
        "# attribute -> (user state-dict key, local shape, dtype)",
        "PARAMETERS = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in params.items()) + "}",
        "BUFFERS = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in buffers.items()) + "}",
        "# non-tensor attributes bound by the runtime ('tp_group': this rank's tensor group)",
        f"OBJECTS = {dict(spec.objects)!r}",
    ]
    doc = (f"{spec.describe()}. Parameters and buffers are attached by the runtime "
           f"(see PARAMETERS).")
    globals_: dict[str, Any] = {}
    classes = _render_class(gm, cls, doc, globals_)
    imports = ["import torch"] + [ln for ln in _import_lines(globals_) if ln != "import torch"]
    return "\n\n".join([header, "\n".join(imports), "\n".join(consts), *classes,
                        f"CHUNK_CLASS = {cls}\n"])


def _render_class(gm: torch.fx.GraphModule, cls: str, doc: str,
                  globals_: dict[str, Any]) -> list[str]:
    """Class sources for `gm` and, first, the graph submodules it calls (higher-order ops such
    as autocast / set_grad_enabled regions keep their body as a submodule)."""
    code = gm.graph.python_code(root_module="self")
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
    body = textwrap.indent(code.src.strip("\n"), "    ")
    init_src = ("\n    def __init__(self):\n        super().__init__()\n" + "\n".join(init) + "\n"
                if init else "")
    out.append(f'class {cls}(torch.nn.Module):\n    """{doc}"""\n{init_src}\n{body}\n')
    return out


def chunk_source(prog: Any, chunk: int = 0, tp_rank: int = 0) -> str:
    """The generated Python of pipeline chunk `chunk` as tensor rank `tp_rank` runs it."""
    built = build_program(prog)
    chunks = built.chunks(tp_rank, weights=False)   # source needs shapes, not weights
    if not 0 <= chunk < len(chunks):
        raise ValueError(f"chunk={chunk}: the plan has {len(chunks)} chunks (p·v = "
                         f"{prog.plan.p}·{prog.plan.v}); pass 0 <= chunk < {len(chunks)}")
    return render_chunk(chunks[chunk], prog.plan, tp_rank, model_name=prog.plan.model)


def load_chunk_module(source: str, filename: str = "<autopar chunk>") -> types.ModuleType:
    """Execute chunk source as a fresh module, registered with linecache (as torch.fx does for
    its generated code) so tracebacks show the generated lines. The module is not put in
    sys.modules: it lives as long as the runtime holds it."""
    digest = hashlib.sha1(f"{filename}\n{source}".encode()).hexdigest()[:16]
    module = types.ModuleType(f"autopar_generated_chunk_{digest}")
    module.__file__ = filename
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own codegen
    return module


def synthetic_batch(step: int, global_batch: int, seq: int, vocab: int,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated launcher's training data: (inputs, targets) of the whole global batch of
    optimizer step `step` (random tokens; each data-parallel rank takes its rows)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


_LAUNCH = '''"""Launch the saved autopar program under torchrun (one node, several nodes, or SLURM).

    torchrun --standalone --nproc_per_node={gpus} launch.py --model FILE.py:factory [--steps N]
    NNODES=2 MASTER_ADDR=head ./run_multinode.sh --model FILE.py:factory   (on every node)
    sbatch slurm.sbatch --model FILE.py:factory

`factory()` returns (model, example_inputs, loss_fn) as given to autopar.parallelize; the model
must be built with the same seed on every rank. The chunk_*.py files next to this script are
what runs (edit them and the change takes effect). Trains on random tokens
(autopar.codegen.synthetic_batch) and prints the loss of every step; with --checkpoint PATH it
saves every --save-every steps and resumes from PATH when it exists (so a job restarted by
torchrun --max-restarts, or requeued by SLURM, continues where it stopped).
"""
import argparse
import importlib.util
import json
import os
from pathlib import Path

import torch

from autopar.api import ParallelProgram
from autopar.codegen import synthetic_batch
from autopar.plan import Plan

HERE = Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="file.py:factory")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="data seed")
    ap.add_argument("--vocab", type=int, default=None,
                    help="token range of the random data (default: model.config.vocab_size)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--checkpoint", default=None, help="checkpoint path (resumed if present)")
    ap.add_argument("--save-every", type=int, default=1)
    ap.add_argument("--losses-out", default=None, help="write the losses as JSON (rank 0)")
    args = ap.parse_args()
    path, _, fn = args.model.partition(":")
    spec = importlib.util.spec_from_file_location("user_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, example_inputs, loss_fn = getattr(mod, fn or "factory")()
    plan = Plan.from_json((HERE / "plan.json").read_text())
    prog = ParallelProgram(model=model, plan=plan, profile=None, example_inputs=example_inputs,
                           loss_fn=loss_fn, example_targets=torch.zeros_like(example_inputs[0]),
                           cluster=None)
    runner = prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                          precision=args.precision, program_dir=HERE)
    vocab = args.vocab or getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        raise SystemExit("launch.py: pass --vocab (the model has no config.vocab_size)")
    rank0 = torch.distributed.get_rank() == 0
    start = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        start = runner.load_checkpoint(args.checkpoint)
        if rank0:
            print(f"resumed from {{args.checkpoint}} at step {{start}}", flush=True)
    share = plan.global_batch_size // plan.d
    seq = int(example_inputs[0].shape[1])
    losses = []
    for step in range(start, args.steps):
        x, y = synthetic_batch(step, plan.global_batch_size, seq, vocab, args.seed)
        lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
        loss = runner.train_step(x[lo:hi], y[lo:hi])
        losses.append(loss)
        if rank0:
            print(f"step {{step}}: loss {{loss:.5f}}", flush=True)
        if args.checkpoint and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            runner.save_checkpoint(args.checkpoint)
    if rank0 and args.losses_out:
        Path(args.losses_out).write_text(json.dumps({{"start": start, "losses": losses}}))
    runner.close()   # every rank is done before any leaves; then the groups are destroyed


if __name__ == "__main__":
    main()
'''

_RUN_MULTINODE = """#!/bin/sh
# Multi-node launch of this program: run the same command on every node.
#   NNODES=2 MASTER_ADDR=node0 MASTER_PORT=29500 ./run_multinode.sh --model m.py:factory
# The c10d rendezvous runs on MASTER_ADDR:MASTER_PORT; NNODES x NPROC_PER_NODE must be {gpus}.
# It numbers the nodes itself (torchrun ignores --node-rank with c10d); each node's ranks are
# consecutive, so the plan's tensor-parallel groups (adjacent ranks) stay inside a node.
set -eu
: "${{NNODES:={nnodes}}}"
: "${{NPROC_PER_NODE:={per_node}}}"
: "${{MASTER_ADDR:?set MASTER_ADDR to the address of node 0}}"
: "${{MASTER_PORT:=29500}}"
: "${{RDZV_ID:=autopar-{model}}}"
if [ $((NNODES * NPROC_PER_NODE)) -ne {gpus} ]; then
  echo "run_multinode.sh: NNODES*NPROC_PER_NODE = $((NNODES * NPROC_PER_NODE)), the plan needs {gpus} ranks" >&2
  exit 2
fi
cd "$(dirname "$0")"
exec torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \\
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" \\
  --max-restarts="${{MAX_RESTARTS:-0}}" launch.py "$@"
"""

_SLURM = """#!/bin/bash
# SLURM batch script for this program: {nnodes} node(s) x {per_node} GPU(s) = {gpus} ranks.
#   sbatch slurm.sbatch --model my_model.py:factory --steps 1000 --checkpoint ckpt
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


def save_program(prog: Any, directory: Path) -> Path:
    """Write plan.json, chunk_XX.py (chunk_XX_tpR.py when t > 1), launch.py, run.sh (one node),
    run_multinode.sh (torchrun, c10d rendezvous) and slurm.sbatch (srun torchrun)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = prog.plan
    (directory / "plan.json").write_text(plan.to_json())
    for tp in range(plan.t):
        for c in range(plan.p * plan.v):
            (directory / chunk_file_name(c, tp, plan.t)).write_text(chunk_source(prog, c, tp))
    (directory / "launch.py").write_text(_LAUNCH.format(gpus=plan.gpus))
    nnodes, per_node = _nodes(plan, getattr(prog, "cluster", None))
    model = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in str(plan.model))
    scripts = {
        "run.sh": "#!/bin/sh\n# usage: ./run.sh --model my_model.py:factory [--steps N]\n"
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

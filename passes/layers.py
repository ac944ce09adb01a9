"""Find the repeated transformer blocks and the embedding / head regions of a captured graph.

`tag_layers(gm) -> gm` (the pass; `LAYERS_PASS` in a pass list) and `find_layers(gm)` (the
analysis entry: runs the pass, returns the `LayerStructure`).
Requires: a GraphModule from `capture` (nodes carry meta[NN_MODULE_STACK] and meta[VAL]).
Guarantees: every node gets meta[REGION] = ("embedding", None) | ("block", i) |
  ("head", None); gm.meta[LAYERS] is the `LayerStructure`: the block module paths in graph
  order, the nodes of each region and the values crossing each block boundary. The graph is
  unchanged.
Reads (keys of passes/meta.py): node NN_MODULE_STACK, VAL; gm REPEATS (the true block count of
  a truncated capture; absent: the blocks in the graph). Writes: node REGION; gm LAYERS.

How blocks are found (structure, never attribute names): for every module path in the stacks,
its siblings (same parent path) are listed in order of first appearance; a run of ≥2
consecutive siblings of the same class whose nodes appear one after the other is a candidate.
The candidate covering the most graph nodes is a block list (so q/k/v projections, which also
repeat, lose to the blocks that contain them); while its members differ and more than half of
each is a run of its own, the members are stacks and their runs are the block lists (T5's
encoder and decoder T5Stacks hold its T5Blocks; a BERT decoder layer's two attentions, alike
layers, do not open it). Every further run outside those whose blocks are at least
a quarter as large is another kind (BART's decoder layers beside its encoder layers; a BERT
decoder layer, with cross-attention, is 2.3 encoder layers). The kinds are
ordered by execution and the blocks numbered over all of them: ("block", i) is global.
Nodes outside every block are:
  - embedding if they do not depend on any block output (token/position embeddings, masks,
    rotary tables computed once and fed to every block) and either feed a block or come first;
  - head if they depend on the last block (final norm, LM head, loss) or only feed the head
    (flattened targets);
  - glue between blocks (depends on block i, feeds block i+1: the encoder's final norm) is
    counted in block i.
Placeholders and get_attr nodes take the region of their first user.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Iterable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopar.passes import meta as K
from autopar.passes.capture import CALL_COUNT, Captured
from autopar.passes.manager import Pass, run_passes

Region = tuple[str, int | None]


class LayerError(ValueError):
    """The graph has no repeated blocks, or its blocks are not all alike."""


@dataclass(frozen=True, kw_only=True)
class BlockKind:
    """One kind of repeated block: a stack of blocks of one class under one container.

    container: module path (as in nn_module_stack) of the block list, e.g. "model.transformer.h".
    block_paths: its block module paths present in the graph, in execution order.
    first: the global index (in `LayerStructure.block_paths`) of its first block in the graph.
    num_layers: its true block count (> len(block_paths) when capture truncated it).
    first_layer: the model-wide index of its first layer (the kinds' true counts in order).
    blocks: the global indices of its blocks in the graph (empty: first, first + 1, ...).
    layers: the model-wide indices of its layers, true counts (empty: the contiguous
      first_layer, ..., first_layer + num_layers - 1 of a whole stack). Set when one stack
      holds blocks of several kinds (`LayerStructure.mixed`): dense and MoE layers, layers
      with and without rotary, ...
    name: how the plan names it ("" for a whole stack: its container).
    """
    container: str
    block_class: str
    block_paths: tuple[str, ...]
    first: int = 0
    num_layers: int = 0
    first_layer: int = 0
    blocks: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()
    name: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.block_paths)

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.blocks or tuple(range(self.first, self.first + self.num_blocks))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.layers or tuple(range(self.first_layer, self.first_layer + self.num_layers))

    @property
    def label(self) -> str:
        return self.name or self.container.removeprefix("model.")

    @property
    def shared(self) -> tuple[str, ...]:
        """The modules called by several of its blocks (one set of weights at several
        depths: ALBERT's layer group, a decoder calling one block k times), in order."""
        mods = [module_path(p) for p in self.block_paths]
        return tuple(m for m in dict.fromkeys(mods) if mods.count(m) > 1)


@dataclass(frozen=True, kw_only=True)
class LayerStructure:
    """The layer view of a captured graph. Node lists hold node names in graph order.

    kinds: the kinds of repeated block in execution order (one for a decoder-only LM; the
      encoder's and the decoder's blocks of an encoder-decoder model); every kind's blocks run
      one after the other, and a block's global index i counts over all kinds in that order.
    block_paths: the block module paths present in the graph, in execution order (all kinds).
    num_layers: the model's true block count over all kinds (> len(block_paths) when capture
      truncated it).
    block_inputs[i]: non-parameter values from outside block i that block i reads (the residual
      stream and anything shared such as masks, rotary tables or the encoder's output).
    block_outputs[i]: values of block i read outside it (the residual stream handed on).
    signatures[i]: (op, output shapes, dtypes) per node of block i; see `block_signature`.
    notes: how the blocks were found where the plan should say so (no repeated stack: one
      block per child; a block called at several depths).
    """
    kinds: tuple[BlockKind, ...]
    block_paths: tuple[str, ...]
    num_layers: int
    embedding_nodes: tuple[str, ...]
    block_nodes: tuple[tuple[str, ...], ...]
    head_nodes: tuple[str, ...]
    block_inputs: tuple[tuple[str, ...], ...]
    block_outputs: tuple[tuple[str, ...], ...]
    signatures: tuple[tuple, ...]
    notes: tuple[str, ...] = ()

    @property
    def container(self) -> str:
        """The first kind's block list (the only one of a single-kind model)."""
        return self.kinds[0].container

    @property
    def block_class(self) -> str:
        return self.kinds[0].block_class

    @property
    def num_blocks(self) -> int:
        """Blocks present in the graph (≤ num_layers)."""
        return len(self.block_paths)

    # The repeat unit: what the cost model analyses once and repeats. One block for a single
    # kind; one block of every kind (the first of each in the graph) for several kinds, which
    # then must have the same depth: the model is `num_units` such units.
    @property
    def unit_blocks(self) -> tuple[int, ...]:
        return tuple(k.first for k in self.kinds)

    @property
    def mixed(self) -> bool:
        """The kinds are graph kinds interleaved in one stack (dense and MoE layers, ...): each
        kind is profiled on its own and the stack is priced layer by layer (passes/graph_profile.py
        `kinds_profile`), not as units of one layer of each kind."""
        return any(k.layers for k in self.kinds)

    @property
    def pattern(self) -> tuple[int, ...]:
        """The kind of every layer of the model (true counts), in execution order."""
        out = [0] * self.num_layers
        for k, kind in enumerate(self.kinds):
            for i in kind.layer_ids:
                out[i] = k
        return tuple(out)

    def only(self, k: int) -> "LayerStructure":
        """This structure with kind k as its only kind (its unit: the kind's first block)."""
        kind = self.kinds[k]
        return replace(self, kinds=(replace(kind, layers=()),))

    @property
    def num_units(self) -> int:
        depths = {k.num_layers for k in self.kinds}
        if len(depths) > 1:
            raise LayerError(
                f"find_layers: the stacks have different depths ("
                f"{', '.join(f'{k.num_layers} × {k.block_class}' for k in self.kinds)}); the "
                f"planner prices a unit of one block of each kind, so the depths must be "
                f"equal. Fix: give parallelize a hand-made plan= (any stage split compiles), "
                f"or make the stacks equally deep")
        return depths.pop()

    @property
    def unit_nodes(self) -> tuple[str, ...]:
        """The unit's nodes in graph order."""
        return tuple(x for i in self.unit_blocks for x in self.block_nodes[i])

    @property
    def unit_inputs(self) -> tuple[str, ...]:
        """Values from outside the unit that it reads (residual streams first, as each
        block lists them)."""
        own = set(self.unit_nodes)
        return tuple(dict.fromkeys(x for i in self.unit_blocks for x in self.block_inputs[i]
                                   if x not in own))

    @property
    def unit_outputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(x for i in self.unit_blocks for x in self.block_outputs[i]))

    def kind_of(self, i: int) -> int:
        """The kind of the graph's block i."""
        return next(k for k, kind in enumerate(self.kinds) if i in kind.block_ids)

    def describe(self) -> str:
        join = " and " if self.mixed else " then "
        stacks = join.join(f"{k.num_layers} × {k.block_class}"
                           + (f" {k.name[k.name.find('['):]}" if k.name else "")
                           + f" at {k.container}" for k in self.kinds)
        return (f"{stacks} ({self.num_blocks} in graph); embedding {len(self.embedding_nodes)} "
                f"nodes, block {len(self.block_nodes[0])} nodes, head {len(self.head_nodes)} "
                f"nodes")


def block_signature(structure: LayerStructure, i: int) -> tuple:
    """What makes blocks interchangeable for the cost model: op sequence and shapes of block i."""
    return structure.signatures[i]


def tag_layers(gm: torch.fx.GraphModule, *, check_identical: bool = True
               ) -> torch.fx.GraphModule:
    """Tag every node of `gm` with its region and store the LayerStructure in gm.meta[LAYERS]
    (see the module docstring). Raises LayerError when no block repeats or (check_identical)
    the blocks differ."""
    nodes = list(gm.graph.nodes)
    stacks = {n: _stack_paths(n) for n in nodes}
    kinds, notes = _find_blocks(nodes, stacks)
    block_paths = tuple(p for k in kinds for p in k.block_paths)
    block_of = _block_index(nodes, stacks, block_paths)
    regions = _assign_regions(nodes, block_of, len(block_paths))
    for n in nodes:
        n.meta[K.REGION] = regions[n]
    structure = _describe(nodes, regions, kinds, block_of, gm.meta.get(K.REPEATS, {}))
    structure = _split_kinds(structure, nodes, stacks, gm.meta.get(K.REPEAT_KEYS, {}))
    structure = replace(structure, notes=notes + _shared_notes(structure))
    if check_identical:
        _check_identical(structure)
    gm.meta[K.LAYERS] = structure
    return gm


LAYERS_PASS = Pass("layers", tag_layers, reads=(K.NN_MODULE_STACK, K.VAL, K.REPEATS,
                                                K.REPEAT_KEYS),
                   writes=(K.REGION, K.LAYERS))


def find_layers(gm: torch.fx.GraphModule | Captured, *, check_identical: bool = True
                ) -> LayerStructure:
    """Run the layers pass on `gm` (a GraphModule or a `Captured`) and return its
    LayerStructure; the nodes keep their REGION tags."""
    gm = gm.gm if isinstance(gm, Captured) else gm
    layers = LAYERS_PASS if check_identical else Pass(
        "layers", partial(tag_layers, check_identical=False), LAYERS_PASS.reads,
        LAYERS_PASS.writes)
    return run_passes(gm, [layers]).meta[K.LAYERS]


# ----- finding the block list --------------------------------------------------------------------

def _stack_paths(node: torch.fx.Node) -> tuple[tuple[str, str], ...]:
    """(call path, class) of every module on the node's call stack, outermost first. A call
    path is the module path with each repeated call of a module marked by its call count
    (torch.export's "@k" on the stack key): one block called at several depths (ALBERT, a
    decoder that calls one block k times) is k calls "encoder.layer", "encoder.layer@1", ...,
    each holding the calls of its submodules ("encoder.layer@1.attn")."""
    stack = node.meta.get(K.NN_MODULE_STACK) or {}
    seen: list[tuple[str, str]] = []   # (module path, call path) of the enclosing calls
    out = []
    for key, value in stack.items():
        path, cls = value[0], value[1]
        count = CALL_COUNT.search(key)
        outer = next(((m, c) for m, c in reversed(seen)
                      if m and path.startswith(m + ".")), ("", ""))
        call = (outer[1] + path[len(outer[0]):] if outer[0] else path) + (
            count.group(0) if count else "")
        seen.append((path, call))
        out.append((call, cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"))
    return tuple(out)



def module_path(call: str) -> str:
    """The module path of a call path: "encoder.layer@2.attn@2" -> "encoder.layer.attn"."""
    return re.sub(r"@\d+", "", call)


def _shared_notes(structure: LayerStructure) -> tuple[str, ...]:
    return tuple(
        f"{m} is called at {sum(module_path(p) == m for p in kind.block_paths)} depths: one set "
        f"of weights shared by those layers, tensor-split as usual; every pipeline stage that "
        f"calls it holds a copy, its gradients summed over them (as a tied embedding's)"
        for kind in structure.kinds for m in kind.shared)


def _find_blocks(nodes: list[torch.fx.Node], stacks: dict
                 ) -> tuple[tuple[BlockKind, ...], tuple[str, ...]]:
    """The kinds of repeated block, in execution order, without their counts filled in: the
    best run of repeated siblings (most nodes) that run one into the next, opened up while its
    members are stacks of blocks themselves, and every further run outside it whose blocks are
    at least a quarter as large (a second stack: the encoder of an encoder-decoder model).
    With no such run, or a best one holding few of the matmuls (`_holds_most`), one block per
    child of the main module (`_one_block_per_child`), said in the returned notes.
    Why this size: one walk over the module stacks that keeps the candidate repeats, their order
    and the second stack of an encoder-decoder together; the steps share its tables."""
    first_seen: dict[str, int] = {}
    last_seen: dict[str, int] = {}
    count: dict[str, int] = defaultdict(int)
    gemms: dict[str, int] = defaultdict(int)
    cls_of: dict[str, str] = {}
    for pos, n in enumerate(nodes):
        for path, cls in stacks[n]:
            first_seen.setdefault(path, pos)
            last_seen[path] = pos
            count[path] += 1
            gemms[path] += _is_gemm(n)
            cls_of[path] = cls
    children: dict[str, list[str]] = defaultdict(list)
    for path in sorted(first_seen, key=first_seen.__getitem__):
        if path:
            children[path.rpartition(".")[0]].append(path)
    # a stack's blocks run one into the next (q/k/v projections and embedding tables that
    # repeat side by side are no stack)
    runs = [(parent, run) for parent, kids in children.items()
            for run in _same_class_runs(kids, cls_of, first_seen, last_seen)
            if _chained(run, nodes, stacks, first_seen, last_seen)]
    total = sum(map(_is_gemm, nodes))
    if not runs or not _holds_most(best_of_runs(runs, count)[1], runs, gemms, total):
        return _one_block_per_child(children, cls_of, first_seen, last_seen, gemms, total)

    def covered(run: tuple[str, ...]) -> int:
        return sum(count[k] for k in run)

    def inside(path: str, outer: str) -> bool:
        return path == outer or path.startswith(outer + ".")

    def best_of(cands: list) -> tuple[str, tuple[str, ...]]:
        return best_of_runs(cands, count)

    def alike(run: tuple[str, ...]) -> bool:
        # blocks of one kind: the same ops, the first possibly with more (T5's position bias)
        sigs = [_signature([n for n in nodes if any(p == m for p, _ in stacks[n])])
                for m in run]
        return len(set(sigs[1:])) == 1 and _is_subsequence(sigs[1], sigs[0])

    def open_up(parent: str, run: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
        # members that differ (T5's encoder and decoder T5Stacks), more than half of each of
        # which is one run of its own, are stacks, not blocks; alike members stay blocks even
        # when a run fills most of each (a BERT decoder layer's self- and cross-attention)
        if alike(run):
            return [(parent, run)]
        inner = []
        for member in run:
            cands = [r for r in runs if r[0] != parent and inside(r[0], member)]
            best = best_of(cands) if cands else None
            if best is None or 2 * covered(best[1]) <= count[member]:
                return [(parent, run)]
            inner.append(best)
        return [k for r in inner for k in open_up(*r)]

    chosen = open_up(*best_of(runs))
    block_size = min(count[m] for _, run in chosen for m in run)
    for parent, run in sorted(runs, key=lambda r: -covered(r[1])):
        taken = [m for _, r in chosen for m in r]
        if any(inside(m, t) or inside(t, m) for m in run for t in taken):
            continue
        if 4 * min(count[m] for m in run) >= block_size:
            chosen += open_up(parent, run)
    chosen.sort(key=lambda r: first_seen[r[1][0]])
    for (_, a), (_, b) in zip(chosen, chosen[1:]):
        if last_seen[a[-1]] > first_seen[b[0]]:
            raise LayerError(
                f"find_layers: the blocks of {a[0].rpartition('.')[0]} and of "
                f"{b[0].rpartition('.')[0]} interleave in execution ({b[0]} starts before "
                f"{a[-1]} ends); autopar cuts pipeline stages in execution order, so each stack "
                f"of blocks must run whole before the next. Fix: run the stacks one after the "
                f"other, or make the alternating blocks one module class")
    return tuple(BlockKind(container=parent, block_class=cls_of[run[0]], block_paths=run)
                 for parent, run in chosen), ()


def best_of_runs(runs: list, count: dict) -> tuple[str, tuple[str, ...]]:
    """The run covering most nodes, then the shallowest (q/k/v projections lose to the blocks
    holding them)."""
    return max(runs, key=lambda r: (sum(count[k] for k in r[1]), -r[0].count(".")))


def _holds_most(best: tuple[str, ...], runs: list, gemms: dict, total: int) -> bool:
    """Does the best run hold more than half of the matmuls no other stack holds (the
    outermost runs outside it: an encoder's beside a decoder's)? Runs of a few linears
    inside named modules (an attention's projections, an MLP's) hold few of a model's."""
    def inside(path: str, outer: str) -> bool:
        return path.startswith(outer + ".")

    others = [r for _, r in runs if not any(inside(m, b) or m == b for m in r for b in best)]
    outer = [r for r in others if not any(inside(r[0], m) for o in others if o is not r
                                          for m in o)]
    rest = total - sum(gemms[m] for r in outer for m in r)
    return 2 * sum(gemms[m] for m in best) > rest


def _is_gemm(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in (
        "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm",
        "scaled_dot_product_attention", "convolution")


def _chained(run: tuple[str, ...], nodes: list, stacks: dict, first_seen: dict,
             last_seen: dict) -> bool:
    """Does every member of `run` read (through any nodes between) the one before it? A
    member's node may also read one of its own member's first (Nemotron's LayerNorm1P reads
    the residual and its own `weight + 1`): each input counts, not only the latest."""
    member = {m: j for j, m in enumerate(run)}
    reached: dict[torch.fx.Node, int] = {}   # the latest member a node depends on
    fed = [False] * len(run)
    for n in nodes[first_seen[run[0]]:last_seen[run[-1]] + 1]:
        j = next((member[p] for p, _ in stacks[n] if p in member), -1)
        deps = [reached[a] for a in n.all_input_nodes if a in reached]
        if j > 0 and j - 1 in deps:
            fed[j] = True
        reached[n] = max([j, *deps])
    return all(fed[1:])


def _one_block_per_child(children: dict, cls_of: dict, first_seen: dict, last_seen: dict,
                         gemms: dict, total: int) -> tuple[tuple[BlockKind, ...], tuple[str, ...]]:
    """No stack of repeated blocks: the children of the model's main module (the outermost
    one holding every matrix multiply) that hold one are its blocks, in execution order, the
    last of several being the head (the output projection); each block is a kind of its own.
    The note says so for the plan."""
    main = ""
    while (kids := [k for k in children[main] if gemms[k]]) and len(kids) == 1 and (
            gemms[kids[0]] == total and children[kids[0]]):
        main = kids[0]
    if not kids:
        raise LayerError(
            f"find_layers: no block to plan: no module{f' inside {main}' if main else ''} "
            f"holds a matrix multiply ({total} in the graph, all in one forward); autopar "
            f"cuts pipeline stages and splits tensors by module. Fix: move the layers' "
            f"weights and matmuls into submodules (one per layer)")
    blocks = tuple(kids[:-1] if len(kids) > 1 else kids)
    for a, b in zip(blocks, blocks[1:]):
        if last_seen[a] > first_seen[b]:
            raise LayerError(
                f"find_layers: no repeated blocks, and the modules {a} and {b} of {main or 'the model'} "
                f"interleave in execution ({b} starts before {a} ends), so they cannot be "
                f"cut into pipeline stages either. Fix: put each layer in a module of its own "
                f"(e.g. an nn.ModuleList of blocks) and call them one after the other")
    names = ", ".join(b.rpartition(".")[2] for b in blocks)
    note = (f"no repeated blocks found (no module has ≥2 consecutive children of one class "
            f"that run one into the next and hold most of the matrix multiplies): planned with "
            f"one block per child of {main or 'the model'} holding a matrix multiply ({names}), "
            f"each a kind of its own; pipeline stages cut only between them. A stack of "
            f"identical blocks (an nn.ModuleList) plans better")
    return (BlockKind(container=main, block_class=cls_of[blocks[0]], block_paths=blocks),), (
        note,)


def _same_class_runs(kids: list[str], cls_of: dict, first_seen: dict,
                     last_seen: dict) -> Iterable[tuple[str, ...]]:
    """Maximal runs (len ≥ 2) of consecutive siblings of one class executed one after another."""
    run: list[str] = []
    for kid in kids:
        if run and cls_of[kid] == cls_of[run[-1]] and first_seen[kid] > last_seen[run[-1]]:
            run.append(kid)
            continue
        if len(run) >= 2:
            yield tuple(run)
        run = [kid]
    if len(run) >= 2:
        yield tuple(run)


def _block_index(nodes: list, stacks: dict, block_paths: tuple[str, ...]) -> dict:
    index = {p: i for i, p in enumerate(block_paths)}
    out = {}
    for n in nodes:
        for path, _ in stacks[n]:
            if path in index:
                out[n] = index[path]
                break
    return out


# ----- regions -------------------------------------------------------------------------------------

def _assign_regions(nodes: list, block_of: dict, num_blocks: int) -> dict:
    last_block_pos = max(i for i, n in enumerate(nodes) if n in block_of)
    # After-block dependency: the highest block whose output a node (transitively) reads.
    dep: dict[torch.fx.Node, int] = {}
    for n in nodes:
        d = max((dep[a] for a in n.all_input_nodes if a in dep), default=-1)
        dep[n] = block_of.get(n, d)
    # Does a node (transitively) feed a block?
    feeds: dict[torch.fx.Node, bool] = {}
    for n in reversed(nodes):
        feeds[n] = any(u in block_of or feeds.get(u, False) for u in n.users)
    regions: dict[torch.fx.Node, Region] = {}
    for pos, n in enumerate(nodes):
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if n in block_of:
            regions[n] = ("block", block_of[n])
        elif dep[n] == num_blocks - 1 or (dep[n] < 0 and not feeds[n] and pos > last_block_pos):
            regions[n] = ("head", None)
        elif dep[n] >= 0:
            regions[n] = ("block", dep[n])  # glue between blocks i and i+1
        else:
            regions[n] = ("embedding", None)
    # Placeholders / parameters: the region of the first user; output: head.
    for n in nodes:
        if n.op == "output":
            regions[n] = ("head", None)
        elif n.op in ("placeholder", "get_attr"):
            users = sorted(n.users, key=nodes.index) if len(n.users) > 1 else list(n.users)
            regions[n] = regions.get(users[0], ("embedding", None)) if users else ("embedding", None)
    return regions


def _describe(nodes: list, regions: dict, kinds: tuple[BlockKind, ...], block_of: dict,
              repeats: dict[str, int]) -> LayerStructure:
    block_paths = tuple(p for k in kinds for p in k.block_paths)
    nb = len(block_paths)
    per_block: list[list[str]] = [[] for _ in range(nb)]
    inputs: list[dict[str, None]] = [{} for _ in range(nb)]
    outputs: list[dict[str, None]] = [{} for _ in range(nb)]
    emb, head = [], []
    for n in nodes:
        kind, i = regions[n]
        if kind == "embedding":
            emb.append(n.name)
        elif kind == "head":
            head.append(n.name)
        else:
            per_block[i].append(n.name)
            for a in n.all_input_nodes:
                if regions[a] != ("block", i) and a.op != "get_attr":
                    inputs[i][a.name] = None
                    ka, ia = regions[a]
                    if ka == "block":
                        outputs[ia][a.name] = None
    for n in nodes:  # block values read by the head
        if regions[n][0] == "head":
            for a in n.all_input_nodes:
                if regions[a][0] == "block":
                    outputs[regions[a][1]][a.name] = None
    # glue after the last block of a stack (the encoder's final norm) is counted in that block
    # but is no part of the repeated unit: the last block's signature is its own module's nodes
    by_name = {n.name: n for n in nodes}
    lasts, end = set(), 0
    for k in kinds:
        end += k.num_blocks
        lasts.add(end - 1)
    own = [[by_name[x] for x in blk] for blk in per_block]
    for i in lasts:
        own[i] = [n for n in own[i] if block_of.get(n) == i or (
            n.op == "get_attr" and any(block_of.get(u) == i for u in n.users))]
    signatures = tuple(_signature(blk) for blk in own)
    counted, first, first_layer = [], 0, 0
    for k in kinds:
        true = repeats.get(k.container, k.num_blocks)
        counted.append(BlockKind(container=k.container, block_class=k.block_class,
                                 block_paths=k.block_paths, first=first, num_layers=true,
                                 first_layer=first_layer))
        first += k.num_blocks
        first_layer += true
    return LayerStructure(
        kinds=tuple(counted), block_paths=block_paths, num_layers=first_layer,
        embedding_nodes=tuple(emb),
        block_nodes=tuple(tuple(b) for b in per_block), head_nodes=tuple(head),
        block_inputs=tuple(tuple(x) for x in inputs),
        block_outputs=tuple(tuple(x) for x in outputs), signatures=signatures)


def _signature(block: list[torch.fx.Node]) -> tuple:
    sig = []
    for n in block:
        if n.op in ("call_function", "call_method", "call_module"):
            sig.append((str(n.target), _shapes(n.meta.get(K.VAL))))
        elif n.op == "get_attr":
            sig.append(("param", _shapes(n.meta.get(K.VAL))))
    return tuple(sig)


def _shapes(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (tuple(_size(d) for d in val.shape), str(val.dtype))
    if isinstance(val, (tuple, list)):
        return tuple(_shapes(v) for v in val)
    return None


def _size(d: Any) -> int | str:
    """A dim's size, or the name of a data-dependent one (JetMoE's rows per expert: an
    unbacked symbol, u0, which no int can stand for)."""
    return str(d) if free_unbacked_symbols(d) else int(d)


def _is_subsequence(short: tuple, long: tuple) -> bool:
    rest = iter(long)
    return all(any(op == x for x in rest) for op in short)


def _added_compute(short: tuple, long: tuple) -> bool:
    """Whether `long` (which holds `short` as a subsequence) adds an aten op of its own, not
    only graph bookkeeping (torch.export's `_guards_fn` call lands in the first block)."""
    rest, added = iter(long), []
    for op in short:
        for x in rest:
            if x == op:
                break
            added.append(x)
    added.extend(rest)
    return any(str(x[0]).startswith("aten.") for x in added)


def _split_kinds(structure: LayerStructure, nodes: list, stacks: dict,
                 repeat_keys: dict[str, tuple[str, ...]]) -> LayerStructure:
    """Each stack's blocks grouped by signature into kinds (dense and MoE layers, layers with
    and without rotary, ...); a stack whose blocks all match stays one kind, its first block
    allowed to add ops when they compute a value it hands the later blocks (T5's position
    bias: block 0 has more outputs) or are no compute (export's guard call); a first block
    that only adds ops of its own (rotary in a sliding layer before a full-attention one) is
    a kind. With kinds, every kind lists its graph blocks and its model-wide layers: a
    truncated capture's REPEAT_KEYS give the kept block each true layer stands for (capture
    keeps one block of every parameter layout)."""
    sig = structure.signatures
    per_stack = []
    for kind in structure.kinds:
        ids = kind.block_ids
        groups: list[list[int]] = []
        for i in ids[1:]:
            grp = next((g for g in groups if sig[g[0]] == sig[i]), None)
            groups.append([i]) if grp is None else grp.append(i)
        match = next((g for g in groups if sig[g[0]] == sig[ids[0]]), None)
        outs = structure.block_outputs
        if match is None:   # the first block may add ops that hand the others a value
            match = max((g for g in groups if _is_subsequence(sig[g[0]], sig[ids[0]])
                         and (len(outs[ids[0]]) > len(outs[g[0]])   # T5's position bias
                              or not _added_compute(sig[g[0]], sig[ids[0]]))),
                        key=lambda g: len(sig[g[0]]), default=None)
        groups.insert(0, [ids[0]]) if match is None else match.insert(0, ids[0])
        per_stack.append(sorted(groups, key=lambda g: g[0]))
    if all(len(groups) == 1 for groups in per_stack):
        return structure
    inside = defaultdict(dict)   # graph block -> {class of a module inside it: its depth}
    for n in nodes:
        own = [p for p, _ in stacks[n] if p in structure.block_paths]
        for p, c in stacks[n] if own else ():
            if p.startswith(own[0] + "."):
                seen = inside[structure.block_paths.index(own[0])]
                seen[c.rpartition(".")[2]] = min(seen.get(c.rpartition(".")[2], 99),
                                                 p.count("."))
    cls_at = {p: c for n in nodes for p, c in stacks[n] if p in structure.block_paths}
    kinds, offset = [], 0
    for kind, groups in zip(structure.kinds, per_stack):
        keys = repeat_keys.get(kind.container)
        at = {p.rpartition(".")[2]: i for p, i in zip(kind.block_paths, kind.block_ids)}
        layer_block = [at[k] for k in keys] if keys else list(kind.block_ids)
        gid = {i: g for g, grp in enumerate(groups) for i in grp}
        for g, grp in enumerate(groups):
            layers = tuple(offset + j for j, i in enumerate(layer_block) if gid[i] == g)
            mine = inside[grp[0]]
            others = {c: d for h in groups if h is not grp for c, d in inside[h[0]].items()}
            # the outermost module class only this kind has (or only the others have)
            own = sorted((d, c) for c, d in mine.items() if c not in others)
            lack = sorted((d, c) for c, d in others.items() if c not in mine)
            what = (own[0][1] if own else f"without {lack[0][1]}" if lack
                    else f"{len(sig[grp[0]])} ops")
            cls = cls_at[structure.block_paths[grp[0]]]
            if len({cls_at[structure.block_paths[h[0]]] for h in groups}) > 1:
                what = cls.rpartition(".")[2]   # blocks of several classes (no repeated stack)
            name = f"{kind.container.removeprefix('model.')} [{what}]" if len(groups) > 1 else ""
            kinds.append(replace(kind, block_class=cls,
                                 block_paths=tuple(structure.block_paths[i] for i in grp),
                                 first=grp[0], blocks=tuple(grp), num_layers=len(layers),
                                 first_layer=layers[0], layers=layers, name=name))
        offset += len(layer_block)
    return replace(structure, kinds=tuple(kinds))


def _check_identical(structure: LayerStructure) -> None:
    """Within each kind, blocks 1, 2, ... do the same ops on the same shapes, and block 0 does
    those too, possibly with more in between: the first block may compute a value it hands
    to the others (T5's relative position bias, computed by the first block of each stack)."""
    for kind in structure.kinds:
        ids = kind.block_ids
        ref = ids[1] if len(ids) > 1 else ids[0]
        for i in ids:
            sig, want = structure.signatures[i], structure.signatures[ref]
            ok = _is_subsequence(want, sig) if i == kind.first else sig == want
            if ok:
                continue
            later, earlier = (ref, i) if i == kind.first else (i, ref)
            a, b = structure.signatures[earlier], structure.signatures[later]
            where = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            x = a[where] if where < len(a) else "(end of block)"
            y = b[where] if where < len(b) else "(end of block)"
            raise LayerError(
                f"find_layers: block {later} ({structure.block_paths[later]}) differs from "
                f"block {earlier} ({structure.block_paths[earlier]}) at op #{where}: {y} vs {x} "
                f"({len(b)} vs {len(a)} ops); autopar analyses one block of each kind and "
                f"repeats it, so the blocks of one stack must do the same ops on the same "
                f"shapes (the first may only add ops, e.g. a position bias it hands on). Fix: "
                f"make the blocks identical; find_layers alone (not parallelize) accepts "
                f"check_identical=False as an approximation")

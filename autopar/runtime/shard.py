"""Local shards of tensor-parallel parameters, and the vocab-parallel ops of the rewritten graph.

A `ParamSplit(dim, blocks, padded)` says how one parameter is split over t ranks: along `dim`
the parameter is cut into consecutive blocks of global sizes `blocks` (q, k, v of a fused
projection are three blocks), and rank r holds the r-th 1/t of every block, concatenated:

    W (3C, C), blocks (C, C, C), t = 2:   rank r holds rows [rC/2, (r+1)C/2) of each of q, k, v
                                           → local (3C/2, C)

`whole` (one flag per block, empty = none): a block every rank holds whole instead of 1/t of
it — the replicated part of a mixed projection (multi-query attention: q split by heads, the
one k/v head replicated):

    W (C+2d, C), blocks (C, d, d), whole (F, T, T), t = 2:  rank r holds rows [rC/2, (r+1)C/2)
                                           of q and all of k and v → local (C/2+2d, C)

`padded` > 0 (vocab dims only): the dim is zero-padded to `padded` rows first; rank r holds rows
[r·padded/t, (r+1)·padded/t). Padding is invisible outside: `unshard` drops it, the
vocab-parallel cross-entropy masks padded logits to -inf.

The functions below are FX `call_function` targets; each takes the tensor-parallel group
explicitly and reads the rank from it, so every rank runs the same graph code.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from autopar.runtime.collectives import (all_gather, copy_to_tp, group_rank, group_size,
                                         reduce_from_tp)


class UnboundGroup:
    """Stands in for the process group of a graph rewritten for inspection only (group=None);
    running such a graph fails in the first collective."""

    def __init__(self, t: int):
        self.t = t

    def __repr__(self) -> str:
        return f"UnboundGroup(t={self.t})"


@dataclass(frozen=True)
class ParamSplit:
    dim: int
    blocks: tuple[int, ...]
    padded: int = 0
    whole: tuple[bool, ...] = ()   # per block: held whole by every rank (replicated part)

    def is_whole(self, i: int) -> bool:
        return bool(self.whole) and self.whole[i]

    def local_size(self, t: int) -> int:
        if self.padded:
            return self.padded // t
        return sum(b if self.is_whole(i) else b // t for i, b in enumerate(self.blocks))

    def ranges(self, rank: int, t: int) -> list[tuple[int, int]]:
        """(start, length) of this rank's pieces in global coordinates (may pass the end of an
        unpadded dim: the rows there are padding)."""
        if self.padded:
            n = self.padded // t
            return [(rank * n, n)]
        out, offset = [], 0
        for i, b in enumerate(self.blocks):
            out.append((offset, b) if self.is_whole(i) else (offset + rank * (b // t), b // t))
            offset += b
        return out

    def whole_ranges(self, t: int) -> list[tuple[int, int]]:
        """(start, length) of the whole blocks in LOCAL coordinates (the same on every rank):
        the rows whose gradient each rank holds a summand of, all-reduced over the group."""
        out, offset = [], 0
        for i, b in enumerate(self.blocks):
            if self.is_whole(i):
                out.append((offset, b))
            offset += b if self.is_whole(i) else b // t
        return out


def local_shard(full: torch.Tensor, split: ParamSplit, rank: int, t: int) -> torch.Tensor:
    """This rank's shard of `full` (a copy; padded rows are zeros)."""
    return _pieces(full, split, rank, t).clone()


def unshard(pieces: list[torch.Tensor], split: ParamSplit, full_size: int) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order), padding dropped."""
    t = len(pieces)
    if split.padded:
        return torch.cat(pieces, dim=split.dim).narrow(split.dim, 0, full_size)
    out = []
    offset = 0
    for i, b in enumerate(split.blocks):
        if split.is_whole(i):      # the same on every rank: rank 0's copy
            out.append(pieces[0].narrow(split.dim, offset, b))
            offset += b
            continue
        n = b // t
        out += [p.narrow(split.dim, offset, n) for p in pieces]
        offset += n
    return torch.cat(out, dim=split.dim)


def gather_unshard(local: torch.Tensor, split: ParamSplit, full_size: int,
                   group: Any) -> torch.Tensor:
    """The full tensor from every tensor rank's shard `local` of it (padding dropped).
    Collective over the tensor-parallel `group`: every rank calls it and gets the result."""
    piece = local.detach().contiguous().unsqueeze(0)                   # (1, *local)
    return unshard(list(all_gather(piece, 0, group).unbind(0)), split, full_size)


# ----- local shards of a meta-device model --------------------------------------------------
#
# Choice (issue 3, "local shards only"): a meta parameter is initialised by its owning module's
# own code at its GLOBAL shape — the module's direct parameters are made real at full size on
# CPU, filled with their constructor's constant (recorded by `meta_init`, else NaN), then
# `reset_parameters()` and `init(module)` run under the seed (seed, module path), and each rank
# keeps its slice. So kaiming's fan-in sees the global fan-in, every rank agrees on replicated
# parameters, and the gathered state dict equals `init_full_like_meta` on a real model.
# Peak extra memory: ONE module's direct parameters (the largest is the embedding / LM head),
# never the whole model. What cannot match `torch.manual_seed(s); Model(cfg)` bit for bit: the
# real constructor draws every init from one global RNG stream in construction order, which
# per-module seeds do not replay; and init code that runs only in the model's __init__ (e.g.
# GPT's 1/sqrt(2·n_layer) rescale of c_proj) is skipped on a meta model unless `init` does it.


def module_seed(seed: int, module_path: str) -> int:
    """The seed a module's parameters are initialised with (the same on every rank)."""
    return _stable_seed(seed, module_path, 0)


def init_module_full(module: torch.nn.Module, module_path: str, seed: int,
                     init: Callable[[torch.nn.Module], None] | None
                     ) -> dict[str, torch.Tensor]:
    """The full-size initial values of `module`'s direct parameters, computed by its own code
    (starting from the constructor constant meta_init recorded — a real module's current
    value — then reset_parameters(), then init(module)) under module_seed(seed, module_path).
    The module itself is left as it was."""
    saved = dict(module._parameters)
    consts = module.__dict__.get("_autopar_param_fill", {})
    full: dict[str, torch.Tensor] = {}
    for n, p in saved.items():
        if p is None:
            continue
        if not p.is_meta:  # a real module (init_full_like_meta): start from its own value
            value = p.detach().to("cpu", copy=True)
        elif p.dtype.is_floating_point:
            value = torch.full(p.shape, consts.get(n, float("nan")), dtype=p.dtype)
        else:
            value = torch.zeros(p.shape, dtype=p.dtype)
        full[n] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
        module._parameters[n] = full[n]
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(module_seed(seed, module_path))
        with torch.no_grad():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            if init is not None:
                init(module)
    finally:
        torch.random.set_rng_state(gen_state)
        module._parameters.update(saved)
    out = {}
    for n, p in full.items():
        if p.dtype.is_floating_point and torch.isnan(p).any():
            raise ValueError(
                f"materialise {module_path}.{n} ({type(module).__name__}): nothing initialises "
                f"it on a meta model — its module has no reset_parameters() and init= left it "
                f"unset. Fix: build the model under autopar.runtime.shard.meta_init() (records "
                f"constructor constants such as RMSNorm's ones), or pass init= that sets it")
        out[n] = p.detach()
    return out


def init_full_like_meta(model: torch.nn.Module, init: Callable[[torch.nn.Module], None] | None,
                        seed: int) -> torch.nn.Module:
    """Re-initialise a REAL `model` in place exactly as apply_tensor_parallel materialises the
    same model from the meta device (per-module seeds, global shapes): the single-device twin
    of a meta-initialised parallel model. Returns `model`."""
    for path, module, names in owned_parameters(model):
        values = init_module_full(module, path, seed, init)
        with torch.no_grad():
            for n in names:
                module._parameters[n].copy_(values[n])
    return model


def owned_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, list[str]]]:
    """(module path, module, its parameter names) for every parameter's FIRST owner in
    named_parameters() order (a tied parameter belongs to the module that comes first)."""
    seen: set[int] = set()
    out = []
    for path, module in model.named_modules():
        names = [n for n, p in module._parameters.items() if p is not None and id(p) not in seen]
        seen |= {id(module._parameters[n]) for n in names}
        if names:
            out.append((path, module, names))
    return out


def real_buffer(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The real value of a buffer of a model built under meta_init (None if not recorded)."""
    return module.__dict__.get("_autopar_real_buffers", {}).get(name)


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build a model whose parameters and buffers are on the meta device, recording what a
    meta model otherwise loses:

      buffers       computed for real on CPU by the constructor (rotary cos/sin tables, position
                    ids, masks: small and not re-creatable from the module) and kept on the
                    owning module, so compile() restores them — the meta model keeps meta twins;
      parameters    moved to meta as soon as they are registered (peak memory: one parameter,
                    uninitialised); a constant fill (RMSNorm's ones) is recorded so
                    materialisation can start from it.

        with meta_init():
            model = LlamaStyle(config)      # all meta; plan / capture / compile as usual
    """
    reg_p, reg_b = torch.nn.Module.register_parameter, torch.nn.Module.register_buffer
    metas: dict[int, tuple[Any, torch.nn.Parameter]] = {}  # id -> (weakref to real, meta)

    def register_parameter(self, name, param):
        if param is not None and not param.is_meta:
            seen = metas.get(id(param))
            if seen is None or seen[0]() is not param:  # ids of freed tensors get reused
                flat = param.detach().reshape(-1)
                if flat.numel() and param.dtype.is_floating_point and \
                        bool((flat == flat[0]).all()):
                    self.__dict__.setdefault("_autopar_param_fill", {})[name] = float(flat[0])
                metas[id(param)] = (weakref.ref(param), torch.nn.Parameter(
                    torch.empty_like(param, device="meta"), requires_grad=param.requires_grad))
            param = metas[id(param)][1]
        reg_p(self, name, param)

    def register_buffer(self, name, tensor, persistent=True):
        if tensor is not None and not tensor.is_meta:
            self.__dict__.setdefault("_autopar_real_buffers", {})[name] = tensor
            tensor = torch.empty_like(tensor, device="meta")
        reg_b(self, name, tensor, persistent)

    torch.nn.Module.register_parameter = register_parameter
    torch.nn.Module.register_buffer = register_buffer
    try:
        yield
    finally:
        torch.nn.Module.register_parameter, torch.nn.Module.register_buffer = reg_p, reg_b


def _stable_seed(seed: int, name: str, rank: int) -> int:
    h = 1469598103934665603
    for ch in f"{name}#{rank}".encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 61)
    return (seed * 1000003 + h) % (1 << 62)


# ----- layout helpers used by the rewritten graph ----------------------------------------------

def local_blocks(x: torch.Tensor, group: Any, dim: int, blocks: list[int],
                 padded: int = 0, whole: tuple[bool, ...] = ()) -> torch.Tensor:
    """This rank's pieces of a replicated `x` under Shard(dim, blocks); no communication (the
    caller puts copy_to_tp before it when gradients must be summed). Its backward puts the
    gradient in this rank's rows and zeros elsewhere: a summand, as a value held whole in a
    split region (sharding.Whole) keeps its gradient."""
    t, rank = group_size(group), group_rank(group)
    split = ParamSplit(dim % x.dim(), tuple(blocks), padded, tuple(whole))
    return _pieces(x, split, rank, t)


def _pieces(x: torch.Tensor, split: ParamSplit, rank: int, t: int) -> torch.Tensor:
    """Differentiable gather of this rank's ranges of `x` along split.dim, zeros past its end."""
    out, size = [], x.shape[split.dim]
    for start, length in split.ranges(rank, t):
        real = max(0, min(length, size - start))
        if real:
            out.append(x.narrow(split.dim, start, real))
        if real < length:
            pad = list(x.shape)
            pad[split.dim] = length - real
            out.append(x.new_zeros(pad))
    return torch.cat(out, dim=split.dim)


def partial_mean(x: torch.Tensor, group: Any, dims: list[int], keepdim: bool = False,
                 dtype: Any = None) -> torch.Tensor:
    """This rank's summand of a mean over a split dim: mean(x_local) / t, so that the sum over
    the t ranks (a Partial, all-reduced by the caller's reduce_from_tp) is the global mean
    (every rank holds an equal 1/t of the dim). Used e.g. by an RMSNorm over all heads
    (OLMo-2's q/k norm), whose statistic is then one small all-reduce."""
    return torch.mean(x, dims, keepdim, dtype=dtype) / group_size(group)


def tp_norm(x: torch.Tensor, group: Any, size: int, weight: torch.Tensor | None,
            bias: torch.Tensor | None, eps: float, rms: bool = False) -> torch.Tensor:
    """LayerNorm (rms=False) or RMSNorm over the last dim of `size` elements, split across the
    group (each rank holds its slice of x, weight and bias). Each statistic — the mean, then
    the variance about it (LayerNorm: two; RMSNorm: the mean square) — is a sum of the ranks'
    local sums, all-reduced forward and backward: its consumers are every rank's slice, so its
    gradient is the sum of the ranks' parts. Two passes (mean first), as torch's kernel, not
    E[x²] - mean², which cancels badly."""
    def total(local: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(reduce_from_tp(local, group), group) / size
    if not rms:
        x = x - total(x.sum(-1, keepdim=True))
    y = x * torch.rsqrt(total((x * x).sum(-1, keepdim=True)) + eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def shuffle_blocks(x: torch.Tensor, group: Any, dim: int, blocks: list[int],
                   padded: int = 0) -> torch.Tensor:
    """Reorder a full-size `x` (global order) so that each rank's pieces of Shard(dim, blocks)
    lie together, rank 0's first (zeros for vocab padding): a reduce-scatter of the result
    hands every rank its own pieces. The inverse of unshuffle_blocks; a permutation, so its
    gradient is the gradient permuted back."""
    t = group_size(group)
    if t == 1 and not padded:
        return x
    split = ParamSplit(dim % x.dim(), tuple(blocks), padded)
    return torch.cat([_pieces(x, split, r, t) for r in range(t)], dim=split.dim)


def unshuffle_blocks(x: torch.Tensor, group: Any, dim: int, blocks: list[int],
                     padded: int = 0) -> torch.Tensor:
    """Reorder a rank-major all-gather of Shard(dim, blocks) pieces into the global order
    (and drop vocab padding)."""
    t = group_size(group)
    dim = dim % x.dim()
    if padded:
        return x.narrow(dim, 0, sum(blocks))
    local = [b // t for b in blocks]
    per_rank = sum(local)
    out = []
    offset = 0
    for n in local:
        out += [x.narrow(dim, r * per_rank + offset, n) for r in range(t)]
        offset += n
    return torch.cat(out, dim=dim)


# ----- vocab-parallel embedding and cross-entropy ----------------------------------------------

def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, group: Any,
                             padding_idx: int = -1) -> torch.Tensor:
    """Partial sums of embedding(ids): rank r looks up the ids in its rows
    [r·V/t, (r+1)·V/t) and contributes zeros for the others (reduce_from_tp sums them)."""
    rows = weight.shape[0]
    start = group_rank(group) * rows
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    pad = padding_idx - start if 0 <= padding_idx - start < rows else None
    out = F.embedding(local, weight, padding_idx=pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy of logits split over the vocab, the full logits never gathered, with one
    collective. Rank r all-gathers (m_r, s_r, z_r): its row max, the sum of exp(logit - m_r)
    over its columns, and the target's logit if the target is one of its columns (else 0).
    Then with M = max_r m_r (the online-softmax rescaling):
        logsumexp = M + log Σ_r s_r·exp(m_r - M),   loss = logsumexp - Σ_r z_r.
    Megatron all-reduces the max, the target logit and the sum of exponentials in turn: three
    synchronisations of all t ranks where this has one."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, reduction):
        n_local, rank = logits.shape[-1], group_rank(group)
        start = rank * n_local
        logits = logits.float()
        cols = torch.arange(start, start + n_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))  # vocab padding
        # a slice that is all padding has max -inf: clamp so that exp(logit - max) is 0, not nan
        lmax = logits.max(dim=-1).values.clamp(min=torch.finfo(logits.dtype).min)   # (N,)
        exp = (logits - lmax.unsqueeze(-1)).exp_()                                  # (N, V/t)
        outside = (target < start) | (target >= start + n_local)
        local_t = (target - start).masked_fill(outside, 0)
        picked = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        every = _stacked_from_every_rank(torch.stack([lmax, exp.sum(dim=-1), picked]), group)
        maxes, sums, targets = every.unbind(1)                # every: (t, 3, N); each (t, N)
        gmax = maxes.max(dim=0).values
        rescale = (maxes - gmax).exp_()                                             # (t, N)
        sum_exp = (sums * rescale).sum(dim=0)
        loss = gmax + sum_exp.log() - targets.sum(dim=0)
        valid = target != ignore_index
        loss = loss.masked_fill(~valid, 0.0)
        mine = rescale[rank] / sum_exp          # softmax = exp · exp(m_r - M) / S
        ctx.save_for_backward(exp.mul_(mine.unsqueeze(-1)), local_t, outside, valid)
        ctx.reduction, ctx.count = reduction, valid.sum().clamp(min=1)
        if reduction == "mean":
            return loss.sum() / ctx.count
        return loss.sum() if reduction == "sum" else loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside, valid = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        scale = valid.to(g.dtype)
        if ctx.reduction == "mean":
            scale = scale * (grad / ctx.count)
        elif ctx.reduction == "sum":
            scale = scale * grad
        else:
            scale = scale * grad
        return g * scale.unsqueeze(-1), None, None, None, None, None


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any,
                                 vocab_size: int, ignore_index: int = -100,
                                 reduction: int = 1) -> torch.Tensor:
    """F.cross_entropy(full_logits, target) from this rank's vocab slice of the logits (N, V/t);
    `reduction` as in aten.cross_entropy_loss (0 none, 1 mean, 2 sum)."""
    out = _VocabParallelCE.apply(logits, target, group, vocab_size, ignore_index,
                                 _REDUCTIONS[reduction])
    return out.to(logits.dtype)


def _stacked_from_every_rank(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(t, *x.shape): every tensor rank's x, in rank order (the runtime's peer-guarded
    all-gather along a new leading dim)."""
    if group_size(group) == 1:
        return x.unsqueeze(0)
    return all_gather(x.unsqueeze(0), 0, group)


# ----- dropout streams --------------------------------------------------------------------------

class DropoutStreams:
    """The tensor-parallel dropout generators of one rank's program (Megatron's model-parallel
    RNG tracker). Split regions draw from a per-tensor-rank stream, seeded
    seed + 2718 + 1_000_003·tp_rank and advanced by every draw; replicated regions draw from
    the default generator, which this object never touches, so it stays identical on all
    tensor ranks. One object per program and rank, bound to the graph as the attribute
    `tp_rng` next to `tp_group` (the tensor-parallel pass makes one, the runtime binds its
    own when it loads the generated chunks): a freshly compiled program draws the same masks
    as the last one did. A recomputed region replays the streams (`recompute_context`).

    Under context parallelism (cp_rank of c) each context rank holds other tokens, so it
    draws other masks: the per-tensor-rank streams add CONTEXT_STRIDE·cp_rank to their seed,
    and values whole over the tensor group but split along the sequence draw from a stream
    shared by the rank's tensor ranks (`generator(..., per_tensor_rank=False)`: seed + 2718 +
    REPLICATED_OFFSET + CONTEXT_STRIDE·cp_rank), not from the default generator, which every
    context rank advances alike.
    """
    REPLICATED_OFFSET = 500_009
    CONTEXT_STRIDE = 7_919_999

    def __init__(self, tp_rank: int, cp_rank: int = 0):
        self.tp_rank, self.cp_rank = tp_rank, cp_rank
        self._gens: dict[tuple[int, str, bool], torch.Generator] = {}

    def __repr__(self) -> str:
        return (f"DropoutStreams(tp_rank={self.tp_rank}, cp_rank={self.cp_rank}, "
                f"streams={len(self._gens)})")

    def generator(self, seed: int, device: Any = "cpu",
                  per_tensor_rank: bool = True) -> torch.Generator:
        """This rank's stream for `seed` on `device`, created at its seed on first use."""
        device = torch.device(device)
        key = (seed, str(device), per_tensor_rank)
        if key not in self._gens:
            gen = torch.Generator(device=device)
            rank = (1_000_003 * self.tp_rank if per_tensor_rank else self.REPLICATED_OFFSET)
            gen.manual_seed(2718 + seed + rank + self.CONTEXT_STRIDE * self.cp_rank)
            self._gens[key] = gen
        return self._gens[key]

    def recompute_context(self) -> tuple[contextlib.AbstractContextManager,
                                          contextlib.AbstractContextManager]:
        """torch.utils.checkpoint's context_fn: snapshot the streams when the region runs
        forward, and run its recomputation with exactly those states (restoring the live ones
        afterwards), so tp_dropout draws the same masks twice."""
        snapshot = {k: g.get_state() for k, g in self._gens.items()}
        return contextlib.nullcontext(), self._replay(snapshot)

    @contextlib.contextmanager
    def _replay(self, snapshot: dict[tuple[int, str], torch.Tensor]) -> Iterator[None]:
        live = dict(self._gens)
        states = {k: g.get_state() for k, g in live.items()}
        for k in list(self._gens):
            if k in snapshot:
                self._gens[k].set_state(snapshot[k])
            else:
                del self._gens[k]  # created during this forward: recreated fresh on replay
        try:
            yield
        finally:
            self._gens.clear()
            self._gens.update(live)
            for k, g in live.items():
                g.set_state(states[k])


def tp_dropout(x: torch.Tensor, p: float, train: bool, streams: DropoutStreams,
               seed: int, per_tensor_rank: bool = True) -> torch.Tensor:
    """Dropout on a split value, its mask drawn from this tensor rank's own stream (or, with
    per_tensor_rank False, the stream its tensor ranks share: a context rank's tokens)."""
    if not train or p == 0.0:
        return x
    gen = streams.generator(seed, x.device, per_tensor_rank)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)


def tp_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, streams: DropoutStreams,
            seed: int, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
            is_causal: bool = False, *, per_tensor_rank: bool = True,
            **kwargs: Any) -> torch.Tensor:
    """scaled_dot_product_attention on this rank's heads whose attention-dropout mask comes
    from this tensor rank's stream (per_tensor_rank False: its tensor ranks' shared one): the
    default generator is swapped for the stream's state around the call (sdpa takes no
    generator argument) and restored after.
    Why this size: the sdpa arguments plus the tensor rank whose dropout stream it draws."""
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, **kwargs)
    gen = streams.generator(seed, q.device, per_tensor_rank)
    with as_default_stream(gen, q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
                                              **kwargs)


@contextlib.contextmanager
def as_default_stream(gen: torch.Generator, device: torch.device) -> Iterator[None]:
    """Draws from the default generator of `device` inside come from `gen` (advanced)."""
    default = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" \
        else torch.default_generator
    saved = default.get_state()
    default.set_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(default.get_state())
        default.set_state(saved)

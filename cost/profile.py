"""The cost model's view of a model: per-region GEMMs, parameters and activations.

A `ModelProfile` is what the planner knows about a model. It is built either from a captured
graph (`autopar.passes.graph_profile.profile_from_graph`, the real path: shapes come from torch.export
and the repeated block is analysed once) or analytically from transformer dimensions
(`transformer_profile`, used by tests and for checking the graph path against the textbook).

Everything is stated for ONE sequence (micro-batch size 1) at the profiled sequence length
`seq_len`; the cost model scales by the micro-batch size b. Under tensor parallelism of degree t,
each quantity says which part is divided by t (`split`) and which is replicated.

Units are in the names: `_flops`, `_bytes`, `_elems`.

Attention is measured both ways, and the hardware picks (`Cluster.attention`, cost/hardware.py):
the region fields describe attention written out ("materialized": the s×s scores and
probabilities are saved and streamed through HBM, the accounting of 2104.04473 / 2205.05198),
and `RegionProfile.fused` what changes when the region's scaled-dot-product-attention calls run
as one fused kernel ("flash": FlashAttention-2/3, cuDNN, PyTorch SDPA on CUDA: the kernel saves
q, k, v, its output and the row logsumexp, never writes the scores, and skips fully masked
tiles). `ModelProfile.with_attention(kind)` returns the profile priced one way; attention
written out with matmuls (BLOOM's ALiBi, GPT-2 eager) has no `fused` part and is materialized
under either kind, as the model's own code runs it.

Elementwise ops are measured both ways too, and the hardware picks (`Cluster.elementwise`): the
region fields (and `fused`) describe a stack that fuses elementwise chains into single kernels
("fused": Megatron-LM's fused kernels, torch.compile), whose intermediates are recomputed in
backward, not kept; `RegionProfile.eager` the same region run op by op ("eager": PyTorch
without a compiler, as autopar's runtime runs its chunks today), where every op reads its inputs
and writes its output, and autograd keeps every tensor an op saves.
`ModelProfile.for_cluster(cluster)` prices the profile for a cluster's two kinds.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from autopar.cost.imbalance import ExpertLoad

# Which dimension of a GEMM is divided by the tensor-parallel degree t:
#   "n"     column-parallel (output features split), e.g. qkv / fc1 / LM head (vocab)
#   "k"     row-parallel (reduction dim split; partial sums are all-reduced), e.g. proj / fc2
#   "batch" independent matmuls split across ranks, e.g. attention heads
#   None    replicated: every tensor rank does the whole GEMM
TpSplit = Literal["n", "k", "batch"] | None
RegionKind = Literal["embedding", "block", "head"]


@dataclass(frozen=True, kw_only=True)
class Gemm:
    """One matrix multiply of the forward pass for one sequence: `batch` independent (m×k)·(k×n).

    `m` scales with the micro-batch size b when `batch_scales` is False (token dimension of a
    linear layer: m = s tokens per sequence); otherwise `batch` scales with b (attention:
    batch = heads, m = n = s). Backward costs two GEMMs of the same size (dX and dW).
    """
    name: str
    batch: int
    m: int
    n: int
    k: int
    tp_split: TpSplit = None
    batch_scales: bool = False
    has_weight_grad: bool = True  # False for activation-activation products (attention)
    expert: bool = False          # an experts' grouped matmul (its rows follow the routing)

    @property
    def fwd_flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


ATTENTION_KINDS = ("flash", "materialized")
ELEMENTWISE_KINDS = ("fused", "eager")
# The score tile a fused kernel skips when fully masked: FlashAttention-2/3 run 128-row query
# blocks against 64-176-column key blocks for head dim 128 (flash-attention's kernel traits);
# 128 × 128 is the granularity at which a causal mask skips work.
FLASH_TILE = 128


def causal_tile_fraction(q_len: int, kv_len: int, tile: int = FLASH_TILE) -> float:
    """Fraction of the tile × tile blocks of a q_len × kv_len causal mask that hold an unmasked
    entry (query i sees keys <= i + kv_len - q_len, FlashAttention's bottom-right alignment):
    (n + 1) / (2n) for n × n tiles, 1/2 for long sequences."""
    rows, cols = -(-q_len // tile), -(-kv_len // tile)
    active = 0
    for i in range(rows):
        last_key = min(kv_len - 1, (i + 1) * tile - 1 + kv_len - q_len)
        active += 0 if last_key < 0 else min(cols, last_key // tile + 1)
    return active / (rows * cols)


@dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """One scaled-dot-product-attention call of a region, per sequence, as a fused kernel runs it.

    heads / kv_heads: query and key/value heads (the kernel reads k and v un-repeated: grouped
    query attention is native to FlashAttention-2/3); q_len / kv_len, head_dim / v_head_dim.
    active_fraction: the fraction of the kernel's tiles (FLASH_TILE × FLASH_TILE blocks of the
    q_len × kv_len score matrix) that are not fully masked; a fused kernel skips the others
    (causal: (n+1)/(2n) of n×n tiles). 1.0 for a dense mask or a mask that could not be read.
    gemms: indices of its scores and context GEMMs in the region's `gemms` (the materialized
    pricing, and the FLOP count of the papers' convention, which counts attention in full).
    materialized_bytes: non-GEMM traffic only attention written out moves, included in the
    region's other_bytes / other_split_bytes: the softmax over the scores, and the copy that
    lays the (B, H, L, E) context out as (B, L, H, E) for the projection (a fused kernel writes
    its output in that layout); a fused kernel moves neither.
    """
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    active_fraction: float
    gemms: tuple[int, ...]
    materialized_bytes: int

    @property
    def fwd_flops(self) -> float:
        """FLOPs the fused forward kernel runs: q·kᵀ and p·v over the tiles it does not skip."""
        return (2.0 * self.heads * self.q_len * self.kv_len * (self.head_dim + self.v_head_dim)
                * self.active_fraction)

    @property
    def io_bytes(self) -> int:
        """16-bit bytes the forward kernel reads and writes: q, k, v, output (+ fp32 logsumexp)."""
        return 2 * (self.heads * self.q_len * (self.head_dim + self.v_head_dim)
                    + self.kv_heads * self.kv_len * (self.head_dim + self.v_head_dim)
                    ) + 4 * self.heads * self.q_len


@dataclass(frozen=True, kw_only=True)
class FusedAttention:
    """A region with its attention calls run as fused kernels: the calls, and the region's saved
    activations measured that way (the same meaning as RegionProfile's act_* fields; the
    attention part is what selective recompute of the kernel still drops: the logsumexp)."""
    calls: tuple[AttentionCall, ...]
    act_split_bytes: int
    act_replicated_bytes: int
    act_attention_bytes: int

    @property
    def materialized_bytes(self) -> int:
        return sum(c.materialized_bytes for c in self.calls)

    @property
    def gemm_indices(self) -> frozenset[int]:
        return frozenset(i for c in self.calls for i in c.gemms)


@dataclass(frozen=True, kw_only=True)
class EagerOps:
    """A region run op by op (`Cluster.elementwise="eager"`): its non-GEMM traffic and saved
    activations with no elementwise fusion (every op reads its inputs and writes its output;
    every tensor autograd saves is kept), the same meaning as RegionProfile's fields; `fused`
    its attention calls as fused kernels run eagerly (k and v saved as the model passes them:
    repeated for grouped-query attention when the model repeats them)."""
    other_bytes: int
    other_split_bytes: int
    act_split_bytes: int
    act_replicated_bytes: int
    act_attention_bytes: int
    fused: FusedAttention | None = None


@dataclass(frozen=True, kw_only=True)
class RegionProfile:
    """One region of the model (embedding, one transformer block, or head+loss), per sequence.

    act_split_bytes / act_replicated_bytes: activations saved for backward for one sequence in
    the training precision, the split part divided by t under tensor parallelism, the replicated
    part divided by t only under sequence parallelism. act_attention_bytes is the part that
    selective recompute drops (the s² attention scores / softmax / dropout mask), split by t.
    input_bytes: the region's input activation for one sequence (what full recompute keeps,
    and what a pipeline boundary before this region sends).
    other_bytes: bytes read + written by non-GEMM ops (elementwise, norms, softmax) per
    sequence, priced at memory bandwidth; other_split_bytes is the part divided by t.
    tp_allreduce_elems: elements all-reduced across the tensor group in the forward pass for
    one sequence (Megatron block: 2 · s · h); backward moves the same amount.
    fused: the region's attention calls as fused kernels (None: no scaled-dot-product
    attention in the region); `ModelProfile.with_attention` applies it.
    eager: the region without elementwise fusion (None: measured one way only, as the textbook
    profile); `ModelProfile.with_elementwise` applies it.
    """
    kind: RegionKind
    name: str
    gemms: tuple[Gemm, ...]
    params_split_elems: int
    params_replicated_elems: int
    act_split_bytes: int
    act_replicated_bytes: int
    act_attention_bytes: int
    input_bytes: int
    other_bytes: int = 0
    other_split_bytes: int = 0
    tp_allreduce_elems: int = 0
    fused: FusedAttention | None = None
    eager: EagerOps | None = None
    # aten ops the region's forward dispatches one by one, GEMMs and attention kernels aside
    # (views included): what an eager runtime pays `Cluster.kernel_launch_s` for forward and
    # `Cluster.autograd_op_s` backward each (cost/compute.py `dispatch_s`); 0: not counted
    eager_ops: int = 0
    # parameter tensors of the region (tied ones once): what an optimizer stepping the model's
    # own tensors pays `Cluster.optimizer_tensor_s` for each (ZeRO-0); 0: not counted
    param_tensors: int = 0
    # context parallelism (cost/context.py): elements of K and V, full length and all kv
    # heads, one sequence's attention gathers from the other context ranks; 0 until the
    # profile is restated for c > 1
    cp_gather_elems: int = 0
    # a mixture of experts (passes/graph_profile.py _charge_experts): the experts' weights (part of
    # params_split_elems), the experts per layer, and the elements one token dispatch moves per
    # sequence (tokens · top-k · hidden, summed over the region's expert chains); 0 without
    expert_params_elems: int = 0
    experts: int = 0
    expert_dispatch_elems: int = 0
    # the expert weights by their expert count, (experts, params_elems, dispatch_elems), summing
    # to the two totals above: ep spreads a set only where it divides its experts (a chain of 2
    # shared experts beside 8 routed stays whole at ep = 4: passes/expert_parallel.py);
    # (): one set of `experts` (the analytic twin, older profiles)
    expert_sets: tuple[tuple[int, int, int], ...] = ()

    def spread_experts(self, ep: int) -> tuple[int, int]:
        """(params, dispatch) elements of the expert sets ep spreads over its ranks: those
        whose expert count ep divides (all of them at ep = 1); the rest stay whole, as dense
        weights, and move no tokens."""
        if not self.expert_sets:
            return self.expert_params_elems, self.expert_dispatch_elems
        kept = [(p, d) for e, p, d in self.expert_sets if e % ep == 0]
        return sum(p for p, _ in kept), sum(d for _, d in kept)

    @property
    def fwd_flops(self) -> int:
        return sum(g.fwd_flops for g in self.gemms)

    @property
    def params_elems(self) -> int:
        return self.params_split_elems + self.params_replicated_elems


@dataclass(frozen=True, kw_only=True)
class TPCollective:
    """A collective the tensor-parallel pass inserts beyond the structural (Megatron) ones, for one
    sequence: `kind` "all-gather" (also a reduce-scatter: the same bytes) or "all-reduce" of a
    value of `elems` elements (its global size); in the forward pass (repeated by a full
    recompute) or in the backward pass."""
    kind: Literal["all-gather", "all-reduce"]
    elems: int
    backward: bool
    what: str = ""
    # False: a parameter's gradient (sequence parallelism's copy_to_tp on a replicated weight
    # a sequence shard reads): `elems` per micro-batch whatever its size, in fp32
    per_sequence: bool = True


@dataclass(frozen=True, kw_only=True)
class TPRegionFallback:
    """What the tensor-parallel pass keeps whole in one region at one t, relative to the region's
    structural split (the `tp_split` of its GEMMs and its split / replicated counts).

    replicated_gemms: indices into RegionProfile.gemms the pass computes whole on every rank.
    whole_columns: (GEMM index, output columns every rank computes whole) of the GEMMs the pass
      splits in part (the k/v columns of a multi-query fused projection).
    params_elems: parameter elements the profile counts as split that stay replicated.
    act_split_bytes / act_attention_bytes: saved activations (per sequence) the profile divides
      by t that stay whole on every rank (also under sequence parallelism).
    other_split_bytes: non-GEMM bytes (per sequence) the profile divides by t that stay whole.
    allreduce_elems_removed: forward all-reduce elements of the structural count
      (RegionProfile.tp_allreduce_elems) the pass does not do (a row-parallel GEMM kept
      replicated, a vocabulary embedding not split); the backward pair goes with it.
    collectives: the extra collectives the pass inserts around the replicated values.
    """
    replicated_gemms: tuple[int, ...] = ()
    whole_columns: tuple[tuple[int, int], ...] = ()
    params_elems: int = 0
    act_split_bytes: int = 0
    act_attention_bytes: int = 0
    other_split_bytes: int = 0
    allreduce_elems_removed: int = 0
    collectives: tuple[TPCollective, ...] = ()

    @functools.cached_property
    def empty(self) -> bool:
        # cached (frozen: the fields never change): the cost model asks per priced configuration
        return self == NO_FALLBACK


NO_FALLBACK = TPRegionFallback()


@dataclass(frozen=True, kw_only=True)
class TPCorrection:
    """The tensor-parallel pass's decision at degree t (and sequence_parallel) as corrections of
    the structural profile, per region (built by autopar.passes.tp_cost from the graph)."""
    t: int
    sequence_parallel: bool
    embedding: TPRegionFallback = NO_FALLBACK
    block: TPRegionFallback = NO_FALLBACK
    head: TPRegionFallback = NO_FALLBACK
    fallbacks: tuple[str, ...] = ()  # the pass's replicated candidates (node: reason)

    @functools.cached_property
    def empty(self) -> bool:
        return self.embedding.empty and self.block.empty and self.head.empty

    def region(self, kind: str) -> TPRegionFallback:
        return getattr(self, kind)


@dataclass(frozen=True, kw_only=True)
class LayerKind:
    """One of several kinds of repeated block (an encoder-decoder's two stacks): where it sits
    in the model, its layers, and the forward GEMM FLOPs of one of its layers for one sequence
    (what a stage cut inside the repeat unit balances).

    layers / profile: a kind of an interleaved stack (dense and MoE layers, ...; cost/kinds.py):
    its model-wide layer indices and its own one-kind profile, as measured; empty / None for
    the stacks of a unit (an encoder-decoder's)."""
    name: str
    num_layers: int
    fwd_flops: int
    layers: tuple[int, ...] = ()
    profile: "ModelProfile | None" = field(default=None, compare=False, repr=False)


GEMM_PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A transformer as the planner sees it: embedding, `num_layers` identical blocks, head.

    `block` is analysed once and stands for every repeated layer (for an encoder-decoder, for
    every unit of one encoder and one decoder layer: `layer_kinds`). Dimensions are read from the
    graph (hidden, heads, kv_heads, vocab, ffn) and are used for divisibility rules.
    `activation_bytes_per_elem` is the training precision the act_* numbers assume (2: 16-bit).
    `tp_fallbacks`: for each tensor-parallel degree t (and sequence_parallel) the graph path
    analysed, what the tensor-parallel pass keeps replicated and the collectives it adds
    (`TPCorrection`); the cost model prices them. Empty for the textbook profile, and for a t
    that was not analysed: the structural split (`Gemm.tp_split`) is priced as is.
    """
    name: str
    num_layers: int
    seq_len: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    ffn: int
    embedding: RegionProfile
    block: RegionProfile
    head: RegionProfile
    tied_embeddings: bool = False
    # weights of a block called at several depths (ALBERT; passes/layers.py BlockKind.shared),
    # split by t like a block's / replicated: one set for all its layers, so no part of
    # `block`'s parameters; the first stage holds them and, for p > 1, the last a copy whose
    # gradients are summed with the first's (as a tied embedding: cost/shares.py rank_params)
    shared_split_elems: int = 0
    shared_replicated_elems: int = 0
    activation_bytes_per_elem: int = 2
    notes: tuple[str, ...] = field(default=())
    tp_fallbacks: tuple[TPCorrection, ...] = field(default=())
    # (t, why) for each degree the tensor-parallel pass refuses to build (a split lost for
    # divisibility that feeds no split work: passes/tp_layouts.py `lost_region_refusal`),
    # which the solver never offers (cost/families.py `tensor_rule`)
    tp_refused: tuple[tuple[int, str], ...] = field(default=())
    # None: as measured, both accountings at hand (the region fields are the materialized one,
    # `fused` the flash one); "flash" / "materialized": priced one way (`with_attention`)
    attention: str | None = None
    # None: as measured (the region fields fused, `eager` op by op); "fused" / "eager": priced
    # one way (`with_elementwise`)
    elementwise: str | None = None
    # 1: the whole sequence; c: restated for one of c context ranks (cost/context.py), with
    # seq_len the rank's s/c tokens
    context: int = 1
    # how the restated attention meets the other ranks' K/V (autopar.plan.CP_ATTENTION):
    # "all-gather" saves the gathered K/V for the backward, "ring" only the rank's own
    context_attention: str = "all-gather"
    # several kinds of block (encoder-decoder): `block` is the repeat unit, one layer of each
    # kind, and num_layers counts units; the kinds in execution order. Empty: one kind.
    layer_kinds: tuple[LayerKind, ...] = field(default=())
    # the precision the blocks' linear GEMMs run in: "bf16" or "fp8" (passes/fp8.py's rule:
    # the blocks' weight GEMMs; the embedding's and head's stay 16-bit), `with_gemm_precision`
    gemm_precision: str = "bf16"
    # bytes of the model's inputs per sequence that every rank of a replica holds for the whole
    # step, besides the token ids (packed documents' (T, T) boolean mask: cost/documents.py)
    input_bytes_per_sequence: float = 0.0
    # FP8 weights all-gathered in 8 bits under ZeRO-2/3 (tensorwise FP8: runtime/zero3_chunks.py
    # Fp8Gather); False for rowwise FP8, whose weights are cast along two axes and gathered in
    # bf16 (`with_gemm_precision(..., recipe="rowwise")`)
    fp8_gathers: bool = True
    # how unevenly the routers load the experts (cost/imbalance.py ExpertLoad); None: evenly
    expert_load: "ExpertLoad | None" = None

    def with_gemm_precision(self, precision: str, cluster,
                            recipe: str = "tensorwise") -> "ModelProfile":
        """This profile priced with its blocks' linear GEMMs in `precision` ("bf16" or "fp8";
        "fp8" needs the cluster's FP8 rate, Cluster.fp8_flops); recipe: the FP8 scaling
        (autopar/build.py FP8_RECIPES), whether ZeRO-2/3 gather the weights in FP8. The layer
        kinds' profiles (cost/kinds.py) follow, so their stage cut weighs the same GEMMs."""
        if precision not in GEMM_PRECISIONS:
            raise ValueError(f"precision={precision!r}: the planner prices {GEMM_PRECISIONS} "
                             f"(fp32, bf16 and fp16 runs are priced as 16-bit GEMMs)")
        if precision == "fp8" and not cluster.fp8_flops:
            raise ValueError(f"precision='fp8' on cluster {cluster.name!r}: it has no FP8 rate "
                             f"(Cluster.fp8_flops = 0: no FP8 tensor cores, e.g. A100, V100); "
                             f"plan in bf16, pick an FP8 cluster (dgx-h100-80gb, "
                             f"dgx-h200-141gb), or give the Cluster an fp8_flops")
        kinds = tuple(replace(k, profile=k.profile.with_gemm_precision(precision, cluster, recipe))
                      if k.profile is not None else k for k in self.layer_kinds)
        return replace(self, gemm_precision=precision, fp8_gathers=recipe == "tensorwise",
                       layer_kinds=kinds)

    def with_training_bytes(self, bytes_per_elem: int) -> "ModelProfile":
        """This profile with its floating activations in `bytes_per_elem` (4: an fp32 run, as
        compile's default precision and CPU training; 2: 16-bit): every `*_bytes` count of its
        regions, their fused / eager accountings, the tensor-parallel corrections and the
        layer kinds' profiles scaled from `activation_bytes_per_elem`, which it then states
        (the collectives and gradient reductions priced from it follow). The capture counts
        every floating value at TRAIN_BYTES_PER_ELEM; integer inputs (token ids) are scaled
        too, a few bytes per token. Idempotent for the same width."""
        if bytes_per_elem not in (2, 4):
            raise ValueError(f"bytes_per_elem={bytes_per_elem!r}: the cost model prices 16-bit "
                             f"(2) or fp32 (4) training activations; pass 2 or 4")
        if bytes_per_elem == self.activation_bytes_per_elem:
            return self
        ratio = bytes_per_elem / self.activation_bytes_per_elem
        kinds = tuple(replace(k, profile=k.profile.with_training_bytes(bytes_per_elem))
                      if k.profile is not None else k for k in self.layer_kinds)
        return replace(self, activation_bytes_per_elem=bytes_per_elem, layer_kinds=kinds,
                       **{k: _scaled_bytes(getattr(self, k), ratio)
                          for k in ("embedding", "block", "head", "tp_fallbacks")})

    @property
    def mixed(self) -> bool:
        """Kinds interleaved in one stack: num_layers counts layers, `block` is the mean layer
        (cost/kinds.py), not a unit of one layer of each kind."""
        return any(k.layers for k in self.layer_kinds)

    def for_cluster(self, cluster) -> "ModelProfile":
        """This profile priced for `cluster`'s elementwise execution and attention kernel
        (`Cluster.elementwise`, `Cluster.attention`); idempotent."""
        return self.with_elementwise(cluster.elementwise).with_attention(cluster.attention)

    def with_elementwise(self, kind: str) -> "ModelProfile":
        """This profile with its elementwise ops priced as `kind` (one of ELEMENTWISE_KINDS).

        "eager": every region measured op by op (`RegionProfile.eager`) takes that traffic and
        those activations, its fused attention calls the activations they save when run
        eagerly; a region without `eager` (the textbook profile, which states one accounting)
        stays as it is. "fused": the region fields as they are. "eager" must come before
        `with_attention` (it replaces what that one reads); idempotent for the same kind.
        What the tensor-parallel pass keeps whole (`tp_fallbacks`) stays as measured fused.
        """
        if kind not in ELEMENTWISE_KINDS:
            raise ValueError(f"elementwise={kind!r}: must be one of {ELEMENTWISE_KINDS} ('fused': "
                             f"elementwise chains run as single kernels that keep no "
                             f"intermediates; 'eager': op by op, every saved tensor kept); "
                             f"pick one of them")
        if self.elementwise == kind:
            return self
        if kind == "fused" and self.elementwise is None:  # the region fields: nothing replaced
            return replace(self, elementwise=kind)
        if self.elementwise is not None or self.attention is not None:
            raise ValueError(f"profile {self.name!r} is already priced (elementwise="
                             f"{self.elementwise!r}, attention={self.attention!r}) and cannot "
                             f"be re-priced with elementwise={kind!r}; price the profile as "
                             f"measured on a cluster with elementwise={kind!r}")
        return replace(self, elementwise=kind, **{k: _eager_region(getattr(self, k))
                                                  for k in ("embedding", "block", "head")})

    def with_attention(self, kind: str) -> "ModelProfile":
        """This profile with its attention priced as `kind` (one of ATTENTION_KINDS).

        "flash": every region with fused attention calls takes the activations measured with
        the fused kernel (RegionProfile.fused) and drops the softmax traffic over the scores;
        the calls stay in `fused` for the cost model to price as kernels. What the
        tensor-parallel pass keeps whole follows: a replicated call's score traffic goes, and
        its replicated attention activations shrink as the region's do (s² tensors → logsumexp).
        "materialized": the region fields as they are. Idempotent for the same kind.
        """
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"attention={kind!r}: must be one of {ATTENTION_KINDS} ('flash': "
                             f"fused kernels that never write the s×s scores; 'materialized': "
                             f"scores saved and streamed through memory); pick one of them")
        if self.attention == kind:
            return self
        if self.attention is not None:
            raise ValueError(f"profile {self.name!r} is already priced with {self.attention!r} "
                             f"attention and cannot be re-priced as {kind!r}; price the profile "
                             f"as measured (attention=None) on a cluster with attention={kind!r}")
        if kind == "materialized":
            return replace(self, attention=kind)
        regions = {k: _fused_region(getattr(self, k)) for k in ("embedding", "block", "head")}
        fallbacks = tuple(replace(c, **{k: _fused_fallback(getattr(self, k), c.region(k))
                                        for k in ("embedding", "block", "head")})
                          for c in self.tp_fallbacks)
        return replace(self, **regions, tp_fallbacks=fallbacks, attention=kind)

    def tp_correction(self, t: int, sequence_parallel: bool = False) -> TPCorrection | None:
        """The pass's corrections at (t, sequence_parallel); the other mode's at t when only
        that one was analysed (their replicated GEMMs and parameters are the same); None for
        t = 1, a t not analysed, or no corrections (the structural split holds)."""
        if t <= 1:
            return None
        sp = bool(sequence_parallel)
        found = None
        for c in self.tp_fallbacks:
            if c.t == t and c.sequence_parallel == sp:
                found = c
                break
            if c.t == t and found is None:
                found = c
        return None if found is None or found.empty else found

    @property
    def params_elems(self) -> int:
        # A tied head does not count the shared weight again (its params exclude it).
        return (self.embedding.params_elems + self.num_layers * self.block.params_elems
                + self.head.params_elems + self.shared_split_elems
                + self.shared_replicated_elems)

    def fwd_flops_per_seq(self) -> int:
        """Model FLOPs of one forward pass of one sequence (GEMMs only)."""
        return (self.embedding.fwd_flops + self.num_layers * self.block.fwd_flops
                + self.head.fwd_flops)


def _scaled_bytes(obj, ratio: float):
    """`obj` (a dataclass of the profile, or a tuple of them) with every integer field named
    `*_bytes` times `ratio`, recursively (ModelProfile.with_training_bytes)."""
    if isinstance(obj, tuple):
        return tuple(_scaled_bytes(o, ratio) for o in obj)
    if not dataclasses.is_dataclass(obj) or isinstance(obj, ModelProfile):
        return obj
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name.endswith("_bytes") and isinstance(v, int):
            changes[f.name] = round(v * ratio)
        elif dataclasses.is_dataclass(v) or (isinstance(v, tuple) and v
                                             and dataclasses.is_dataclass(v[0])):
            changes[f.name] = _scaled_bytes(v, ratio)
    return replace(obj, **changes) if changes else obj


def _eager_region(r: RegionProfile) -> RegionProfile:
    """The region run op by op (see ModelProfile.with_elementwise)."""
    e = r.eager
    if e is None:
        return r
    fused = r.fused if e.fused is None or r.fused is None else replace(
        r.fused, act_split_bytes=e.fused.act_split_bytes,
        act_replicated_bytes=e.fused.act_replicated_bytes,
        act_attention_bytes=e.fused.act_attention_bytes)
    return replace(r, other_bytes=e.other_bytes, other_split_bytes=e.other_split_bytes,
                   act_split_bytes=e.act_split_bytes, act_replicated_bytes=e.act_replicated_bytes,
                   act_attention_bytes=e.act_attention_bytes, fused=fused, eager=None)


def _fused_region(r: RegionProfile) -> RegionProfile:
    """The region with its attention calls as fused kernels (see ModelProfile.with_attention)."""
    f = r.fused
    if f is None:
        return r
    return replace(r, act_split_bytes=f.act_split_bytes,
                   act_replicated_bytes=f.act_replicated_bytes,
                   act_attention_bytes=f.act_attention_bytes,
                   other_bytes=r.other_bytes - f.materialized_bytes,
                   other_split_bytes=r.other_split_bytes - f.materialized_bytes)


def _fused_fallback(r: RegionProfile, fix: TPRegionFallback) -> TPRegionFallback:
    """A fallback measured with materialized attention, restated for fused kernels: the score
    traffic of the calls it keeps whole goes, and its attention activations scale as the
    region's (the pass keeps the same fraction of them whole)."""
    f = r.fused
    if f is None or fix.empty:
        return fix
    whole = [c for c in f.calls if set(c.gemms) <= set(fix.replicated_gemms)]
    scores = sum(c.materialized_bytes for c in whole)
    attn = (round(fix.act_attention_bytes * f.act_attention_bytes / r.act_attention_bytes)
            if r.act_attention_bytes else 0)
    return replace(fix, other_split_bytes=max(0, fix.other_split_bytes - scores),
                   act_attention_bytes=attn)


def transformer_profile(*, name: str = "gpt", num_layers: int, hidden: int, heads: int,
                        seq_len: int, vocab: int, ffn: int | None = None,
                        kv_heads: int | None = None, gated_mlp: bool = False,
                        tied_embeddings: bool = True,
                        bytes_per_elem: int = 2) -> ModelProfile:
    """Textbook GPT/Llama profile from dimensions (2104.04473 §3, 2205.05198 §4).
    Why this size: one keyword per published model dimension (layers, hidden, heads, kv heads,
    ffn, vocab, sequence, gating, tying, element size), and the formulas below read as the
    papers' equations, one region after another.

    Per layer and sequence, forward: qkv s·h·(h+2·h_kv), scores + context 2·a·s²·(h/a),
    proj s·h², MLP 2·s·h·f (3·s·h·f gated). Activations (16-bit), following 2205.05198 Eq. 2
    generalised to ffn size f: attention 11·s·h + 5·a·s², MLP 3·s·h + 4·s·f (= 19·s·h for
    f = 4h), two norms 4·s·h; of these 2·s·h (qkv input... layer norm inputs) and the dropout
    masks of the residual stay replicated under tensor parallelism: 10·s·h. With the attention
    as one causal fused kernel (`fused`), the 5·a·s² of scores, softmax and its dropout mask
    become the kernel's fp32 logsumexp, 4·a·s bytes (q, k, v and the output, which the
    projection saves, are already among the 11·s·h), and its 3·a·s² of score traffic and the
    2·s·h relayout of its output go.
    A gated MLP (SwiGLU) saves gate, up and their product: 6·s·f bytes for the 4·s·f.
    Today's stacks (`fused`) also recompute pointwise outputs from values they keep anyway
    (torch.compile's min-cut partitioner): the activation's output (s·f·e: GeLU of its input,
    SwiGLU's product of gate and up) and the two norms' outputs (2·s·h·e, from their inputs
    and statistics) are not kept.

    Non-GEMM traffic as a GPU stack with fused elementwise kernels moves it (the accounting
    `profile_from_graph` measures; 16-bit elements, 1-byte dropout masks), per block forward:
    two norms (read + write s·h each), the attention output's relayout to (s, h) (2·s·h,
    split), two bias-dropout-adds (read the branch and the residual, write the sum: 3·s·h,
    + s·h mask bytes), the activation (GeLU: read + write s·f; SwiGLU: read gate and up,
    write the product: 3·s·f; split), the materialized softmax over the scores (3·a·s², split).
    Embedding: token and position rows read and written, their sum, its dropout (7·s·h + s·h
    mask bytes). Head: the final norm (2·s·h), the loss in fp32 (reads 16-bit logits, writes
    fp32 log-probabilities, which it saves: s·V·(e + 4), split).
    """
    f = ffn if ffn is not None else 4 * hidden
    kvh = kv_heads if kv_heads is not None else heads
    hd = hidden // heads
    s, h, a = seq_len, hidden, heads
    kv_dim = kvh * hd
    mlp_in = 2 * f if gated_mlp else f
    gemms = (
        Gemm(name="qkv", batch=1, m=s, n=h + 2 * kv_dim, k=h, tp_split="n"),
        Gemm(name="scores", batch=a, m=s, n=s, k=hd, tp_split="batch", batch_scales=True,
             has_weight_grad=False),
        Gemm(name="context", batch=a, m=s, n=hd, k=s, tp_split="batch", batch_scales=True,
             has_weight_grad=False),
        Gemm(name="proj", batch=1, m=s, n=h, k=h, tp_split="k"),
        Gemm(name="fc_in", batch=1, m=s, n=mlp_in, k=h, tp_split="n"),
        Gemm(name="fc_out", batch=1, m=s, n=h, k=f, tp_split="k"),
    )
    e = bytes_per_elem
    # 2205.05198: total s·h·(34 + 5·a·s/h) with 2-byte elements and 1-byte dropout masks;
    # replicated under TP: 10·s·h (norm inputs 4, dropout masks 2, residual inputs 4).
    act_total_linear = (11 * s * h + 3 * s * h + (6 if gated_mlp else 4) * s * f
                        + 4 * s * h) * e // 2
    act_repl = 10 * s * h * e // 2
    act_attn = 5 * a * s * s * e // 2
    block_params_split = h * (h + 2 * kv_dim) + (h + 2 * kv_dim) + h * h + h * mlp_in + mlp_in + f * h
    block_params_repl = 4 * h + h + h  # two norms (weight+bias), proj bias, fc_out bias
    act_mlp = 3 if gated_mlp else 2  # elements the MLP activation's fused kernel moves per s·f
    block = RegionProfile(
        kind="block", name="block", gemms=gemms,
        params_split_elems=block_params_split, params_replicated_elems=block_params_repl,
        act_split_bytes=act_total_linear - act_repl, act_replicated_bytes=act_repl,
        act_attention_bytes=act_attn, input_bytes=s * h * e,
        other_bytes=(12 * s * h + act_mlp * s * f) * e + 2 * s * h + 3 * a * s * s * e,
        other_split_bytes=(2 * s * h + act_mlp * s * f) * e + 3 * a * s * s * e,
        tp_allreduce_elems=2 * s * h,
        fused=FusedAttention(
            calls=(AttentionCall(heads=a, kv_heads=kvh, q_len=s, kv_len=s, head_dim=hd,
                                 v_head_dim=hd, active_fraction=causal_tile_fraction(s, s),
                                 gemms=(1, 2),
                                 materialized_bytes=(3 * a * s * s + 2 * s * h) * e),),
            act_split_bytes=act_total_linear - act_repl - s * f * e,
            act_replicated_bytes=act_repl - 2 * s * h * e, act_attention_bytes=4 * a * s),
    )
    embedding = RegionProfile(
        kind="embedding", name="embedding", gemms=(),
        params_split_elems=vocab * h, params_replicated_elems=s * h,
        act_split_bytes=0, act_replicated_bytes=s * h * 1, act_attention_bytes=0,
        input_bytes=s * 8, other_bytes=7 * s * h * e + s * h, tp_allreduce_elems=s * h,
    )
    head = RegionProfile(
        kind="head", name="head",
        gemms=(Gemm(name="lm_head", batch=1, m=s, n=vocab, k=h, tp_split="n"),),
        params_split_elems=0 if tied_embeddings else vocab * h, params_replicated_elems=2 * h,
        act_split_bytes=s * vocab * 4, act_replicated_bytes=2 * s * h * e,
        act_attention_bytes=0, input_bytes=s * h * e,
        other_bytes=2 * s * h * e + s * vocab * (e + 4),
        other_split_bytes=s * vocab * (e + 4),
        tp_allreduce_elems=0,
    )
    return ModelProfile(
        name=name, num_layers=num_layers, seq_len=s, hidden=h, heads=a, kv_heads=kvh,
        vocab=vocab, ffn=f, embedding=embedding, block=block, head=head,
        tied_embeddings=tied_embeddings, activation_bytes_per_elem=e,
    )

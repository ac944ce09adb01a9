"""`autopar calibrate`'s compute measurements (cost/calibrate.py runs them on every rank):
the timing helpers, the grids of shapes, and what one rank's compute costs — GEMMs under
autograd, fused attention, streaming bandwidth, per-op dispatch on a block's op mix,
AdamW per parameter and per tensor, interleaved-zb's B/W split. Each returns seconds or
rates; cost/calibrate.py fits them and writes the cluster file."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

# a CPU's attention lengths: the short ones CPU runs train at (128: plan_vs_measured's GPT),
# where the rate moves most — fitted from 256 and 1024 alone, a GPT at 128 was priced 2.2×
# its measured attention (with the FLOP count below)
ATTENTION_LENS = (128, 256, 512, 1024)
_QUICK_ATTENTION_LENS = (64, 256)
_FULL_DIMS = (64, 128, 256, 512, 1024)
_QUICK_DIMS = (32, 128)
# A GPU's grids reach the shapes training runs: on an H100 (benchmarks/gpu.py, 2026-11-26) the
# CPU grids' largest GEMM (1024³ under autograd) ran at 31 TFLOP/s, launch-bound, and the fit
# extrapolated e_max 0.62 from it, and attention at length 1024 gave flash efficiencies of
# 0.19 / 0.11 at an extrapolated L_half of 8192; an isolated 8192³ GEMM runs ~800 TFLOP/s there
_GPU_DIMS = (512, 1024, 2048, 4096, 8192)
_GPU_ATTENTION_LENS = (512, 1024, 2048, 4096, 8192)
# the attention measured: (heads, head_dim) as a CPU can afford, as GPU models run it
_CPU_HEADS, _GPU_HEADS = (4, 64), (16, 128)
# the head dims `measure_attention_dims` times, and the length it times them at (a CPU's:
# the lengths CPU runs train at; a GPU's: where the length factor is near its asymptote)
ATTENTION_HEAD_DIMS, _QUICK_HEAD_DIMS = (16, 32, 64, 128), (32, 64)
_GPU_HEAD_DIMS = (64, 128, 256)
ATTENTION_DIM_LEN, _GPU_ATTENTION_DIM_LEN = 256, 4096
# a GPU's attention rows hold this many tokens (batch = tokens / length), as FlashAttention's
# own benchmarks (2205.14135, 2307.08691, 2407.08608: batch x seqlen = 16k): at batch 1 the
# H200's rows up to 2,048 tokens timed the host's dispatch (each backward 156-191 µs, the
# GEMM steps' own host floor), and the fit's half length came out at 4,871 tokens
_GPU_ATTENTION_TOKENS = 16384
# what a step's other work writes between two uses of an operand, written where calibrate
# times work whose operands training finds cold (a CPU's GEMMs, a checkpointed region's
# backward): beyond a core's L2 cache (2 MB an EPYC core; 1-2 MB on Xeons)
EVICT_BYTES = 8 << 20
# the checkpointed region `measure_checkpoint_region` times: an attention core of this many
# tokens
REGION_TOKENS = 256


def grids(device: torch.device, quick: bool
          ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(GEMM dims, attention lengths, attention head dims) measured on `device`."""
    if quick:
        return _QUICK_DIMS, _QUICK_ATTENTION_LENS, _QUICK_HEAD_DIMS
    if device.type == "cuda":
        return _GPU_DIMS, _GPU_ATTENTION_LENS, _GPU_HEAD_DIMS
    return _FULL_DIMS, ATTENTION_LENS, ATTENTION_HEAD_DIMS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_clock(device: torch.device) -> Callable[[], float]:
    """The clock compute is timed with: on a CPU rank running one thread, the process's CPU
    time (what the work took on the core it ran on: time the scheduler gave other processes
    of a shared machine is not the hardware's rate); otherwise wall time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def timed_s(fn: Callable[[], Any], device: torch.device, calls: int, repeats: int,
            clock: Callable[[], float] = time.perf_counter, typical: bool = False,
            evict: torch.Tensor | None = None) -> float:
    """Best per-call seconds of `repeats` batches of `calls` calls (a fixed count, so ranks
    that time collectives together run the same number); one warm-up call. The best, not the
    median: other load on the machine only ever adds time, so the least disturbed batch is the
    hardware's rate. `typical`: the mean call over every batch instead, for a cost that comes
    in rare long calls every job pays at their rate (a collective's wait: see
    `measure_collectives`; they come in bursts, so the mean of all the calls, not a median
    batch). `clock`: wall time (collectives: waiting is their cost), or `compute_clock` for
    compute. `evict` (a CPU's GEMMs, `measure_matmul`): written before each call, untimed, so
    that each call finds its operands cold, as a training step's GEMMs do: their operands were
    last touched before other layers' work pushed them out of the core's cache. Timed hot, in
    a loop over the same operands, the grid ran faster on an EPYC core than after an 8 MB
    write (2026-11-28): 128³ 13%, 256³ 6%, 512 × 512 × 128 2%, 1024³ 5% (after a 16 MB write
    a 4-layer GPT's shapes 7-10%); in that GPT's d = 2 step its GEMMs took 33.7 ms where the
    hot curve priced 29.3."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if evict is None:
            start = clock()
            for _ in range(calls):
                fn()
            _sync(device)
            times.append((clock() - start) / calls)
            continue
        total = 0.0
        for _ in range(calls):
            evict.fill_(1.0)
            _sync(device)
            start = clock()
            fn()
            _sync(device)
            total += clock() - start
        times.append(total / calls)
    return float(np.mean(times) if typical else np.min(times))


def _batch_calls(fn: Callable[[], Any], device: torch.device, clock: Callable[[], float],
                 target: float, most: int = 200) -> int:
    """Calls that make a timed batch last about `target` seconds at `fn`'s own measured rate
    (1..most): a warm-up call (one-time costs: library handles, kernel choice), then one timed
    call. Measured, not guessed from a FLOP rate: on a GPU a guess made for a CPU gave one
    call per batch, and each call then carried a synchronisation (~0.2 ms on an H100, the
    first run of 2026-11-27), 70x a 512³ GEMM's own time."""
    fn()
    _sync(device)
    start = clock()
    fn()
    _sync(device)
    return max(1, min(most, int(target / max(clock() - start, 1e-7))))


def measure_matmul(dims, dtype: torch.dtype, device: torch.device,
                   quick: bool) -> list[list[float]]:
    """[m, n, k, flops_per_s] for every (m, n, k) in dims³: a GEMM as training runs it, a
    projection y = x·Wᵀ forward and backward under autograd (dX = dY·W and dW = dYᵀ·x, the
    cost model's backward of 2 GEMMs; fresh outputs and gradients each call), its 3 GEMMs'
    FLOPs over the time. An isolated GEMM into a preallocated output ran ~1.5x faster on the
    2-core development machine than the same shape inside autograd (fp32, one thread).
    On a CPU each call finds its operands cold (`timed_s`'s evict), as a step's GEMMs do."""
    curve = []
    evict = torch.empty(EVICT_BYTES // 4, device=device) if device.type == "cpu" else None
    for m in dims:
        for n in dims:
            for k in dims:
                x = torch.randn(m, k, dtype=dtype, device=device, requires_grad=True)
                w = torch.randn(n, k, dtype=dtype, device=device, requires_grad=True)
                dy = torch.randn(m, n, dtype=dtype, device=device)

                def step():
                    x.grad = w.grad = None
                    torch.nn.functional.linear(x, w).backward(dy)
                clock = compute_clock(device)
                calls = _batch_calls(step, device, clock, 0.003 if quick else 0.01)
                s = timed_s(step, device, calls, 3, clock, evict=evict)
                curve.append([m, n, k, 6.0 * m * n * k / s])
    return curve


def measure_optimizer(dtype: torch.dtype, device: torch.device,
                      quick: bool) -> tuple[float, float]:
    """(seconds per parameter, seconds per tensor) of torch.optim.AdamW's step (its defaults
    on this device): per parameter over the parameters of one transformer block of width 1024
    (4 weight matrices 1024 x 3072, 1024², 1024 x 4096, 4096 x 1024, their biases and two
    norms), what the runtime's default optimizer costs per parameter a rank owns; per tensor
    over 32 tensors of 16 elements each, less their elements at that rate (single-tensor
    AdamW on a CPU runs each tensor's update as its own ops)."""
    h = 256 if quick else 1024
    shapes = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,),
              (h,), (h,), (h,), (h,)]
    clock = compute_clock(device)

    def step_s(shapes, calls):
        params = [torch.zeros(sh, dtype=dtype, device=device, requires_grad=True)
                  for sh in shapes]
        for prm in params:
            prm.grad = torch.full_like(prm, 1e-3)
        return timed_s(torch.optim.AdamW(params, lr=1e-4).step, device, calls, 3, clock)
    per_param = step_s(shapes, 2 if quick else 5) / sum(np.prod(sh) for sh in shapes)
    tiny = [(16,)] * 32
    per_tensor = step_s(tiny, 10) / len(tiny) - 16 * per_param
    return float(per_param), max(0.0, float(per_tensor))


def measure_attention(lengths, dtype: torch.dtype, device: torch.device,
                      quick: bool) -> list[list[float]]:
    """[length, fwd_flops_per_s, bwd_flops_per_s] of scaled-dot-product attention (causal; 4
    heads of 64 on a CPU, a sequence each; 16 of 128 on a GPU, `_GPU_ATTENTION_TOKENS` tokens
    each) at each length: batch·4·heads·L²·head_dim × the causal tiles' fraction, backward
    2.5 × — the FLOPs the cost model charges the same call (`AttentionCall.fwd_flops`:
    `causal_tile_fraction`, FLASH_TILE² tiles), so a rate measured at a length prices that
    length's time back. Counted as the exact triangle ((L+1)/2L), the rates came out up to 2×
    below the model's count at short lengths (1.0 of the tiles at L = 128)."""
    heads, dim = _attention_heads(device)
    return [[length, *_attention_rates(length, heads, dim, dtype, device, quick)]
            for length in lengths]


def _attention_heads(device: torch.device) -> tuple[int, int]:
    """(heads, head_dim) of the attention calibrate times on `device`."""
    return _GPU_HEADS if device.type == "cuda" else _CPU_HEADS


def attention_head_dim(device: torch.device) -> int:
    """The head dim `measure_attention`'s length curve is timed at on `device`."""
    return _attention_heads(device)[1]


def measure_attention_dims(dims, dtype: torch.dtype, device: torch.device,
                           quick: bool) -> list[list[float]]:
    """[length, head_dim, fwd_flops_per_s, bwd_flops_per_s] of the same attention at one length
    (`ATTENTION_DIM_LEN`) and head count, the head dim varied: small heads run a fused kernel
    below its rate (on the development CPU forward 37 / 41 / 52 / 60 GFLOP/s at head dims
    16 / 32 / 64 / 128, length 128), which the cost model prices through
    Cluster.flash_half_head_dim."""
    heads = _attention_heads(device)[0]
    length = _GPU_ATTENTION_DIM_LEN if device.type == "cuda" else ATTENTION_DIM_LEN
    return [[length, dim, *_attention_rates(length, heads, dim, dtype, device, quick)]
            for dim in dims]


def _attention_rates(length: int, heads: int, dim: int, dtype: torch.dtype,
                     device: torch.device, quick: bool) -> tuple[float, float]:
    """(forward, backward) FLOP/s of causal SDPA over `heads` heads of `dim` at `length`, the
    FLOPs counted as `measure_attention` says."""
    from autopar.cost.profile import AttentionCall, causal_tile_fraction
    sdpa = torch.nn.functional.scaled_dot_product_attention
    batch = max(1, _GPU_ATTENTION_TOKENS // length) if device.type == "cuda" else 1
    q, k, v = (torch.randn(batch, heads, length, dim, dtype=dtype, device=device,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, length, dim, dtype=dtype, device=device)
    clock = compute_clock(device)
    target = 0.003 if quick else 0.01

    def fwd():
        sdpa(q, k, v, is_causal=True)

    def both():
        sdpa(q, k, v, is_causal=True).backward(grad)
    fwd_s = timed_s(fwd, device, _batch_calls(fwd, device, clock, target, 50), 3, clock)
    both_s = timed_s(both, device, _batch_calls(both, device, clock, target, 50), 3, clock)
    flops = batch * AttentionCall(
        heads=heads, kv_heads=heads, q_len=length, kv_len=length, head_dim=dim,
        v_head_dim=dim, active_fraction=causal_tile_fraction(length, length), gemms=(),
        materialized_bytes=0).fwd_flops
    return flops / fwd_s, 2.5 * flops / max(both_s - fwd_s, 1e-9)


def measure_streaming(dtype: torch.dtype, device: torch.device, quick: bool) -> dict[str, float]:
    """A large copy's bytes read + written per second, and per dispatched op of a block's
    op mix its forward and backward times (`measure_dispatch`)."""
    nbytes = (8 if quick else 64) << 20
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    clock = compute_clock(device)
    copy_s = timed_s(lambda: dst.copy_(src), device, 3 if quick else 10, 3, clock)
    launch_s, autograd_s = measure_dispatch(dtype, device, clock)
    per_op_s, per_byte_s = measure_split_backward(dtype, device, clock)
    return {"hbm_bandwidth_Bps": 2.0 * nbytes / copy_s, "kernel_launch_s": launch_s,
            "autograd_op_s": autograd_s,
            "split_backward_op_s": per_op_s, "split_backward_s_per_byte": per_byte_s,
            "checkpoint_op_s": measure_checkpoint_op(dtype, device, clock),
            "checkpoint_region_s": measure_checkpoint_region(dtype, device, clock)}


def _block_ops(dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], Any], int]:
    """(forward, ops): the non-GEMM ops of a pre-norm transformer block — norms, the heads'
    views and transposes and their layout copies, a scale, the softmax, the residual adds, the
    activation — as aten overloads on tiny tensors that require grad, as autopar's generated
    chunks dispatch them (`RegionProfile.eager_ops` counts the same: views included)."""
    aten = torch.ops.aten
    batch, length, heads, dim = 4, 8, 2, 8
    width = heads * dim
    x = torch.randn(batch, length, width, dtype=dtype, device=device, requires_grad=True)
    w = torch.ones(width, dtype=dtype, device=device, requires_grad=True)
    b = torch.zeros(width, dtype=dtype, device=device, requires_grad=True)
    dense = torch.contiguous_format

    def forward():
        h = aten.native_layer_norm.default(x, [width], w, b, 1e-5)[0]
        q = aten.transpose.int(aten.view.default(h, [batch, length, heads, dim]), 1, 2)
        s = aten._softmax.default(aten.mul.Tensor(aten.clone.default(q, memory_format=dense),
                                                  0.5), -1, False)
        o = aten.clone.default(aten.transpose.int(s, 1, 2), memory_format=dense)
        r = aten.add.Tensor(x, aten.view.default(o, [batch, length, width]))
        g = aten.gelu.default(aten.native_layer_norm.default(r, [width], w, b, 1e-5)[0])
        return aten.add.Tensor(r, g)
    return forward, 13


def measure_dispatch(dtype: torch.dtype, device: torch.device,
                     clock: Callable[[], float]) -> tuple[float, float]:
    """(kernel_launch_s, autograd_op_s): a block's op mix (`_block_ops`), per op, its forward
    (the graph recorded) and what its backward adds. A block's ops, not one add: on a CPU core
    an add of 8 floats took 1.0 µs and a chain of multiply-adds 2.5 µs forward / 3.2 µs
    backward per op, where the block's mix took 3.9 / 7.0 (norms, softmax and the activation
    have costlier kernels to set up, their backward nodes dispatch several ops each); priced
    with the add, a 4-layer GPT's micro-batch carried ~1.3 ms the model lacked (2026-11-27)."""
    forward, ops = _block_ops(dtype, device)

    def both():
        forward().sum().backward()
    fwd_s = timed_s(forward, device, 20, 3, clock)
    both_s = timed_s(both, device, 20, 3, clock)
    return fwd_s / ops, max(0.0, both_s - fwd_s) / ops


def measure_checkpoint_op(dtype: torch.dtype, device: torch.device,
                          clock: Callable[[], float]) -> float:
    """What PyTorch's selective checkpoint (recompute 'op', passes/recompute.py) adds per
    forward op of a checkpointed region: two transformer blocks (`_two_blocks`) checkpointed
    under op's policy against checkpointed plainly, forward only — what its dispatch mode
    costs as it sees each op (a policy call, the output stored) — per op the profile counts,
    twice: the recomputation passes every op through its other mode again. Per counted op,
    not per dispatched aten op: a linear dispatches a transpose, a view and an addmm. 52-65 µs
    a counted op on an EPYC core (2026-11-27), where op's recompute priced without it was
    9-12% fast on a 4-layer GPT. 0 (not measured) on a torch that cannot run op
    (`op_mode_refusal`: compile refuses the mode there)."""
    from autopar.passes.recompute import checkpoint_ops, op_mode_refusal
    if op_mode_refusal():
        return 0.0
    forward, x, _, ops = _two_blocks(dtype, device)

    def plain():
        torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False,
                                          preserve_rng_state=True)

    def op():
        checkpoint_ops(None, None, forward, x)
    rounds = [(timed_s(op, device, 5, 1, clock), timed_s(plain, device, 5, 1, clock))
              for _ in range(7)]
    return 2.0 * max(0.0, float(np.median([a - b for a, b in rounds]))) / ops


def measure_checkpoint_region(dtype: torch.dtype, device: torch.device,
                              clock: Callable[[], float]) -> float:
    """What torch.utils.checkpoint (non-reentrant, RNG state kept: passes/recompute.py) costs
    per region beyond rerunning the region's forward, on the region recompute selective
    checkpoints: a fused attention core (calibrate's attention heads, REGION_TOKENS tokens)
    whose q, k, v a projection makes (views of its output, as a block's), forward + backward
    with EVICT_BYTES streamed between them (as a step's other layers run there),
    checkpointed less the same plainly, less the core's forward on its inputs just made (what
    the cost model prices the recomputation as); the median of 7 rounds. The region's size
    matters: on an EPYC core (2026-11-28) a region of one op on a 4 × 16 tensor cost 180-250
    us and one tiny attention call 250, while an attention core of 128-256 tokens (4 heads of
    32 or 64, batch 1-4) cost 500-700 us beyond its forward, the same at each of those sizes;
    the selective recompute of plan_vs_measured's GPT (four such cores a step) was priced
    ~3 ms a step fast with the one-op region's 190 us."""
    heads, dim = _GPU_HEADS if device.type == "cuda" else _CPU_HEADS
    width = heads * dim
    proj = torch.nn.Linear(width, 3 * width).to(device=device, dtype=dtype)
    x = torch.randn(1, REGION_TOKENS, width, dtype=dtype, device=device, requires_grad=True)
    evict = torch.empty(EVICT_BYTES // 4, device=device)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def core(q, k, v):
        return sdpa(q, k, v, is_causal=True)

    def qkv():
        return tuple(t.view(1, REGION_TOKENS, heads, dim).transpose(1, 2)
                     for t in proj(x).split(width, dim=2))

    def step(checkpointed: bool):
        y = (torch.utils.checkpoint.checkpoint(core, *qkv(), use_reentrant=False,
                                               preserve_rng_state=True)
             if checkpointed else core(*qkv()))
        loss = y.float().sum()
        evict.fill_(1.0)
        loss.backward()
    made = tuple(t.detach().requires_grad_() for t in qkv())
    rounds = [timed_s(lambda: step(True), device, 20, 1, clock)
              - timed_s(lambda: step(False), device, 20, 1, clock)
              - timed_s(lambda: core(*made), device, 20, 1, clock) for _ in range(7)]
    return max(0.0, float(np.median(rounds)))


# the shapes the split's cost is fitted on (width, sequences; length 128): the smallest where
# its per-op work shows, the largest where its per-byte work does
SPLIT_SHAPES = ((32, 1), (64, 4), (128, 8))


def measure_split_backward(dtype: torch.dtype, device: torch.device,
                           clock: Callable[[], float]) -> tuple[float, float]:
    """(seconds per forward op, seconds per saved byte) the B/W split (autopar.runtime.
    split_backward, interleaved-zb) adds to a chunk's backward beyond the same backward
    whole: two blocks of the examples' GPT (pre-norm, causal fused attention, GELU; 4 heads,
    sequences of 128) at each of SPLIT_SHAPES, split and whole in paired rounds, the
    differences fitted by least squares (both ≥ 0) to ops × a + bytes × c, with the ops and
    saved bytes (recompute "none") counted as the cost model counts them (`_counted`), so
    that both are fitted in the pricing's own units. Its work per op: the reverse graph, the
    parameter groups, an engine call per weight group, the recorded gradients' hooks; per
    byte: B's gradients made beside the retained graph where a whole backward reuses what
    each node frees (cold memory). In the runtime's allocator regime (calibrate keeps freed
    memory, as autopar.compile does on a CPU: runtime/host_memory.py).

    Why two terms: on these GPT blocks at 4 sequences the split added 1.74 / 1.73 / 2.44 ms
    at widths 64 / 128 / 256 (2026-11-28, an EPYC core, freed memory kept) — neither a share
    of the compute (0.19 / 0.08 / 0.04 of it) nor of the bytes alone. Fitted 22–24 µs an op
    and 0.07–0.12 ns a byte (8.4 MB the two blocks save at width 128, 4 sequences, as
    autograd's own count) in two fits, pricing those three at 1.3–1.5 / 1.6–2.0 / 2.2–3.0 ms;
    calibrate's former per-op chain of tanh and tiny linears read 9–12 µs an op, and its
    share of two blocks' compute 0.045–0.07."""
    from autopar.examples.gpt import GPT, GPTConfig
    rows = []
    for width, batch in SPLIT_SHAPES:
        model = GPT(GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4,
                              n_embd=width))
        blocks = model.transformer.h.to(device=device, dtype=dtype)
        x = torch.randn(batch, 128, width, dtype=dtype, device=device, requires_grad=True)
        rounds = [_split_times_s(lambda: blocks[1](blocks[0](x)), x,
                                 list(blocks.parameters()), device, clock, calls=3,
                                 repeats=1) for _ in range(7)]
        # paired rounds, the median: the two timings' wander (±10%) exceeds their difference
        extra = float(np.median([split_s - whole_s for whole_s, split_s in rounds]))
        rows.append((*_counted(model, dtype, batch), extra))
    return fit_split_backward(rows)


def fit_split_backward(rows: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(seconds per op, seconds per byte) ≥ 0 fitting rows of (ops, bytes, extra seconds) by
    least squares, relative to each row's extra (a small shape's milliseconds weigh as much
    as a large one's); a term that would come out negative is left out (0) and the other
    refitted alone."""
    A = np.array([[ops, nbytes] for ops, nbytes, _ in rows], dtype=float)
    y = np.array([extra for _, _, extra in rows], dtype=float)
    w = 1.0 / np.maximum(np.abs(y), 1e-9)
    coef = np.linalg.lstsq(A * w[:, None], y * w, rcond=None)[0]
    if (coef >= 0).all():
        return float(coef[0]), float(coef[1])
    singles = []
    for k in (0, 1):      # one term alone, the better of the two (never below 0)
        col = A[:, k] * w
        c = max(0.0, float(col @ (y * w)) / max(float(col @ col), 1e-300))
        one = (c, 0.0) if k == 0 else (0.0, c)
        singles.append((_split_sse(A, y, w, one), one))
    return min(singles)[1]


def _split_sse(A: np.ndarray, y: np.ndarray, w: np.ndarray, coef: tuple[float, float]) -> float:
    """The weighted squared error of `coef` on the rows."""
    r = (A @ np.array(coef) - y) * w
    return float(r @ r)


def _counted(model: torch.nn.Module, dtype: torch.dtype, batch: int) -> tuple[int, float]:
    """(forward ops, saved bytes) of `model`'s blocks, all of them, at `batch` sequences, as
    the cost model counts them for a plan of it: its profile (autopar.api.plan_profile, in
    `dtype`) as autopar's runtime runs it (ops one by one, the fused attention kernel: what
    the pricing restates a profile to on a CPU cluster, `ModelProfile.for_cluster`),
    `forward_ops` and `layer_activation_bytes` without recompute."""
    from autopar import cross_entropy
    from autopar.api import plan_profile
    from autopar.cost.compute import forward_ops
    from autopar.cost.memory import layer_activation_bytes
    model = model.to(device="cpu", dtype=torch.float32)
    ids = torch.zeros(1, model.config.block_size, dtype=torch.long)
    _, profile = plan_profile(model, (ids,), cross_entropy, None, "local-cpu", gpu_counts=(1,))
    profile = profile.with_training_bytes(torch.finfo(dtype).bits // 8).with_elementwise(
        "eager").with_attention("flash")
    layers = profile.num_layers
    return (layers * forward_ops(profile.block),
            layers * layer_activation_bytes(profile, 1, batch, "none", False))


def _two_blocks(dtype: torch.dtype, device: torch.device
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, list, int]:
    """(forward, its input, the weights, the ops the profile counts) of two pre-norm
    transformer blocks: norms, projections, causal fused attention, GELU, residual adds;
    width 128, 4 sequences of 128."""
    width, heads, batch, length = 128, 4, 4, 128
    mods = [torch.nn.ModuleDict({
        "ln1": torch.nn.LayerNorm(width), "qkv": torch.nn.Linear(width, 3 * width),
        "proj": torch.nn.Linear(width, width), "ln2": torch.nn.LayerNorm(width),
        "fc": torch.nn.Linear(width, 4 * width), "out": torch.nn.Linear(4 * width, width),
    }).to(device=device, dtype=dtype) for _ in range(2)]
    x = torch.randn(batch, length, width, dtype=dtype, device=device, requires_grad=True)
    F = torch.nn.functional

    def forward(y: torch.Tensor) -> torch.Tensor:
        for m in mods:
            q, k, v = (t.view(batch, length, heads, -1).transpose(1, 2)
                       for t in m["qkv"](m["ln1"](y)).split(width, -1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y + m["proj"](a.transpose(1, 2).reshape(batch, length, width))
            y = y + m["out"](F.gelu(m["fc"](m["ln2"](y))))
        return y
    ops = 2 * (15 + 4)     # per block: its eager ops (views, norms, adds, ...) and 4 GEMMs
    return forward, x, [q for m in mods for q in m.parameters()], ops


def _split_times_s(forward: Callable[[], torch.Tensor], x: torch.Tensor, weights: list,
                   device: torch.device, clock: Callable[[], float], calls: int = 20,
                   repeats: int = 5) -> tuple[float, float]:
    """(forward + backward whole, forward + backward split into B and W) seconds, each the
    best of `repeats` batches of `calls`."""
    from autopar.runtime.split_backward import backward_input, backward_weight
    grad = torch.ones_like(forward())

    def whole():
        forward().backward(grad)

    def split():
        backward_weight(backward_input([forward()], [grad], [x], weights))
    return (timed_s(whole, device, calls, repeats, clock),
            timed_s(split, device, calls, repeats, clock))

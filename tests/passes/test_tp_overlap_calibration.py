"""Tensor-parallel overlap priced against published runs: torchtitan's async TP (PyTorch's
collective matmul on symmetric memory) against its vanilla TP on the same jobs, Llama 3.1 on
Grand Teton H100s (pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md;
torch.compile, bf16, sequence 8,192, FSDP × TP 8, no pipeline; 2025-06):

- 70B on 256 GPUs (FSDP 32, TP 8, full AC, local batch 16): 597.3 tokens/s/GPU vanilla,
  652.4 async (1.09×). `Cluster.tp_comm_overlap` (0.49: what hides behind a GEMM still costs
  51% of its time) is fitted to this pair's speed-up.
- 8B on 64 GPUs (FSDP 8, TP 8, per-op SAC, local batch 12): 4,378 vanilla, 4,809.4 async
  (1.10×). Not fitted: checked here.

The vanilla run is priced with TP communication exposed (`tp_overlap` False, as the presets),
the async one with `tp_overlap` (cost/overlap.py). Grand Teton's cluster, its bf16 GEMM
efficiency and its attention (PyTorch's SDPA: FlashAttention-2 on Hopper) are
test_fp8_calibration's (the e_max fitted to torchtitan's 8B FSDP row, Table 1). The 8B's
per-op SAC is autopar's recompute "op" (passes/recompute.py: every other GEMM's output kept;
autopar also reruns the reduce-scatters torchtitan keeps). Both pairs, both modes, within 10%
(issue 28: "published runs with t = 8 and no pipeline priced within 10%"): the 70B ~9% slow
(its full AC is priced as a whole forward again; checkpoint's early stop skips the block's
last GEMM, which neither stack reruns), the 8B ~2% slow. Before the SDPA kernel and the
per-op SAC were priced as run (FlashAttention-3 rates; the 8B's SAC as Megatron's selective
recompute) the e_max fitted to 0.39, the 70B pair was 17% slow and the 8B 9% fast.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

import autopar
from autopar.cost.model import Config, predict
from test_fp8_calibration import SEQ, grand_teton, llama31


@dataclass(frozen=True, kw_only=True)
class Pair:
    """One published job run with vanilla and with async TP (tokens/s/GPU)."""
    name: str
    model: str
    gpus: int
    batch: int
    vanilla_tps: float
    async_tps: float
    pins: tuple


_TP8 = (("t", 8), ("p", 1), ("zero", 3), ("sequence_parallel", True))
PAIR_70B = Pair(name="70B, 256 GPUs, FSDP 32 x TP 8, full AC (fitted)", model="70b", gpus=256,
                batch=512, vanilla_tps=597.3, async_tps=652.4,
                pins=_TP8 + (("d", 32), ("micro_batch_size", 16), ("recompute", "full")))
PAIR_8B = Pair(name="8B, 64 GPUs, FSDP 8 x TP 8, per-op SAC", model="8b", gpus=64, batch=96,
               vanilla_tps=4378.0, async_tps=4809.4,
               pins=_TP8 + (("d", 8), ("micro_batch_size", 12), ("recompute", "op")))
PAIRS = (PAIR_70B, PAIR_8B)


@lru_cache(maxsize=None)
def tokens_per_gpu_s(pair: Pair) -> dict[str, float]:
    """Predicted tokens/s/GPU of the pair's pinned bf16 plan, TP exposed and overlapped."""
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    cl = grand_teton()
    prog = autopar.parallelize(llama31(pair.model), gpus=pair.gpus, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=pair.batch,
                               cluster=cl, name=f"llama3.1-{pair.model}", precision="bf16",
                               **dict(pair.pins))
    overlapped = predict(prog.profile, dataclasses.replace(cl, tp_overlap=True),
                         Config.of_plan(prog.plan))
    tokens = pair.batch * SEQ / pair.gpus
    return {"vanilla": tokens / prog.plan.predicted.step_time_s,
            "async": tokens / overlapped.step_time_s}


def comparison(pair: Pair) -> str:
    got = tokens_per_gpu_s(pair)
    published = {"vanilla": pair.vanilla_tps, "async": pair.async_tps}
    lines = [f"{pair.name}, {k} TP: predicted {got[k]:,.0f} tokens/s/GPU, published "
             f"{published[k]:,.1f} ({got[k] / published[k] - 1:+.1%})" for k in got]
    lines.append(f"{pair.name}, async / vanilla: predicted {got['async'] / got['vanilla']:.3f}"
                 f", published {pair.async_tps / pair.vanilla_tps:.3f}")
    return "\n".join(lines)


def test_async_tp_speedup_of_the_8b_pair_not_fitted_within_3_percent():
    """The overlap's price: the 8B's async / vanilla speed-up with tp_comm_overlap fitted to
    the 70B pair; without the interference (everything hidden free) it would be 1.21."""
    got = tokens_per_gpu_s(PAIR_8B)
    print("\n" + comparison(PAIR_8B))
    speedup = got["async"] / got["vanilla"]
    assert abs(speedup / (PAIR_8B.async_tps / PAIR_8B.vanilla_tps) - 1) < 0.03
    for mode, published in (("vanilla", PAIR_8B.vanilla_tps), ("async", PAIR_8B.async_tps)):
        assert abs(got[mode] / published - 1) < 0.10, (mode, got[mode], published)


def test_async_tp_pair_of_the_70b_fitted_and_within_10_percent():
    """The 70B pair: its speed-up is what tp_comm_overlap is fitted to (within 1%), and both
    modes within 10% of the published tokens/s/GPU."""
    got = tokens_per_gpu_s(PAIR_70B)
    print("\n" + comparison(PAIR_70B))
    speedup = got["async"] / got["vanilla"]
    assert abs(speedup / (PAIR_70B.async_tps / PAIR_70B.vanilla_tps) - 1) < 0.01
    for mode, published in (("vanilla", PAIR_70B.vanilla_tps),
                            ("async", PAIR_70B.async_tps)):
        assert abs(got[mode] / published - 1) < 0.10, (mode, got[mode], published)

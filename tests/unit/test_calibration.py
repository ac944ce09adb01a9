"""Cost model vs published measurements (published-results.md): TFLOP/s per GPU within ±10%.

TFLOP/s per GPU is the papers' definition: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) divided by
GPUs × predicted step time. Everything is pinned as published; profiles are analytic
(`transformer_profile`). Run with -s to see the side-by-side table.
"""
from __future__ import annotations

from autopar.cost.hardware import get_cluster
from autopar.cost.model import Config, predict
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve

V = 51200


def published_flops(B: int, s: int, l: int, h: int, vocab: int) -> float:
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))


# name, cluster, heads, h, l, s, t, p, gpus, B, b, v, recompute, sp, published TFLOP/s
ROWS = [
    ("2104.04473 1.7B", "dgx-a100-80gb", 24, 2304, 24, 2048, 1, 1, 32, 512, 16, 1, "full",
     False, 137.0),
    ("2104.04473 18.4B", "dgx-a100-80gb", 48, 6144, 40, 2048, 8, 1, 256, 1024, 8, 1, "full",
     False, 135.0),
    ("2104.04473 145.6B", "dgx-a100-80gb", 96, 12288, 80, 2048, 8, 8, 1536, 2304, 2, 2, "full",
     False, 148.0),
    # 2205.05198 Table 5: 13.75 s (selective + SP) and 18.13 s (full) per step
    ("2205.05198 175B sel+SP", "dgx-a100-80gb", 96, 12288, 96, 2048, 8, 8, 64, 64, 1, 3,
     "selective", True, published_flops(64, 2048, 96, 12288, V) / (64 * 13.75) / 1e12),
    ("2205.05198 175B full", "dgx-a100-80gb", 96, 12288, 96, 2048, 8, 8, 64, 64, 1, 3, "full",
     False, published_flops(64, 2048, 96, 12288, V) / (64 * 18.13) / 1e12),
    ("1909.08053 1.2B V100", "dgx2h-v100-32gb", 16, 1536, 40, 1024, 1, 1, 1, 8, 8, 1, "full",
     False, 39.0),
    # 1T: 128 layers, h 25600, 160 heads, t 8, p 64, 3072 GPUs, B 3072 (Table 1); "502
    # petaFLOP/s on 3072 GPUs ... 52% of theoretical peak" (abstract, ../shared/seeds/000):
    # 163 TFLOP/s. b = 1, v = 1 (the scripts' values are not in the reference; v = 2 reads
    # +9.4%). With the TP backward overlap credited it read +7.4% (v = 2: +12%)
    ("2104.04473 1T", "dgx-a100-80gb", 160, 25600, 128, 2048, 8, 64, 3072, 3072, 1, 1,
     "full", False, 163.0),
]


def _predict_row(row):
    name, cluster, heads, h, l, s, t, p, gpus, B, b, v, rc, sp, _ = row
    prof = transformer_profile(name=name, num_layers=l, hidden=h, heads=heads, seq_len=s,
                               vocab=V)
    d = gpus // (t * p)
    cfg = Config(t=t, p=p, d=d, v=v, micro_batch_size=b, num_microbatches=B // (b * d),
                 schedule="interleaved-1f1b" if v > 1 else "1f1b", recompute=rc,
                 sequence_parallel=sp)
    pred = predict(prof, get_cluster(cluster), cfg)
    return pred, published_flops(B, s, l, h, V) / (gpus * pred.step_time_s) / 1e12


def test_calibration_table_within_10_percent():
    lines = [f"{'configuration':<26}{'predicted':>11}{'published':>11}{'error':>9}"
             f"{'step s':>9}{'mem GB':>8}"]
    errors = {}
    for row in ROWS:
        pred, tflops = _predict_row(row)
        err = tflops / row[-1] - 1
        errors[row[0]] = err
        lines.append(f"{row[0]:<26}{tflops:>11.1f}{row[-1]:>11.1f}{err * 100:>8.1f}%"
                     f"{pred.step_time_s:>9.2f}{pred.memory_bytes_per_gpu / 1e9:>8.1f}")
        assert pred.memory_bytes_per_gpu < get_cluster(row[1]).memory_bytes, row[0]
    print("\nTFLOP/s per GPU (96-coefficient FLOPs / GPUs / predicted step time)\n"
          + "\n".join(lines))
    bad = {k: f"{v * 100:.1f}%" for k, v in errors.items() if abs(v) > 0.10}
    assert not bad, f"outside ±10%: {bad}"


def test_175b_recompute_ratio_matches_direction():
    """Selective + SP must beat full recompute by a margin like the published 1.32x."""
    sel, _ = _predict_row(ROWS[3])
    full, _ = _predict_row(ROWS[4])
    ratio = full.step_time_s / sel.step_time_s
    print(f"\n175B full / selective step time: predicted {ratio:.2f}, published "
          f"{18.13 / 13.75:.2f}")
    assert 1.2 < ratio < 1.5


def test_tensor_parallel_across_nodes_collapses():
    """2104.04473 Fig. 13: t=16 on 8-GPU nodes is far slower than t=8 (162B, 64 GPUs)."""
    prof = transformer_profile(num_layers=32, hidden=20480, heads=128, seq_len=2048, vocab=V)
    cl = get_cluster("dgx-a100-80gb")
    res = {}
    for t, p in ((8, 8), (16, 4)):
        cfg = Config(t=t, p=p, d=1, v=1, micro_batch_size=1, num_microbatches=128,
                     schedule="1f1b", recompute="full")
        res[t] = predict(prof, cl, cfg)
    print(f"\n162B: t=8 {res[8].tflops_per_gpu:.0f} vs t=16 {res[16].tflops_per_gpu:.0f} "
          f"TFLOP/s per GPU")
    assert res[16].tflops_per_gpu < 0.6 * res[8].tflops_per_gpu
    assert res[16].tp_comm_s > 5 * res[8].tp_comm_s


def test_interleaving_helps_at_small_batch():
    """2104.04473 Fig. 12: GPT-3 175B, 96 GPUs, t=8, p=12: v=4 beats v=1 more at small B."""
    prof = transformer_profile(num_layers=96, hidden=12288, heads=96, seq_len=2048, vocab=V)
    cl = get_cluster("dgx-a100-80gb")
    gains = {}
    for B in (12 * 8, 12 * 64):
        t_ = {}
        for v, sched in ((1, "1f1b"), (4, "interleaved-1f1b")):
            cfg = Config(t=8, p=12, d=1, v=v, micro_batch_size=1, num_microbatches=B,
                         schedule=sched, recompute="full")
            t_[v] = predict(prof, cl, cfg).step_time_s
        gains[B] = t_[1] / t_[4] - 1
    print(f"\ninterleaving gain: B=96 {gains[96] * 100:.1f}%, B=768 {gains[768] * 100:.1f}%")
    assert gains[96] > 0.03 and gains[96] > 2 * gains[768]


def test_planner_prefers_published_style_plan_for_175b_on_64_gpus():
    prof = transformer_profile(num_layers=96, hidden=12288, heads=96, seq_len=2048, vocab=V)
    plan = solve(prof, "dgx-a100-80gb", gpus=64, global_batch_size=64, t=8, p=8)
    pinned = solve(prof, "dgx-a100-80gb", gpus=64, global_batch_size=64, t=8, p=8, v=3,
                   micro_batch_size=1, recompute="selective", sequence_parallel=True)
    assert plan.predicted.step_time_s <= pinned.predicted.step_time_s

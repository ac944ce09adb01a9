"""`autopar calibrate`'s fits (cost/calibrate.py): pure functions recover the constants that
generated synthetic timings, and ranks are grouped into links by node."""
from __future__ import annotations

import pytest

from autopar.cost.calibrate import (COLLECTIVES, LINK_FITTED, fit_flash, fit_gemm, fit_link,
                                    link_groups)


def test_fit_link_recovers_latency_and_bandwidth_and_leaves_the_pipeline_hop_out():
    lat, bw = 40e-6, 2e9
    factor = {"all_reduce": 1.0, "send_recv": 1.0}   # n = 2: 2(n-1)/n = 1 and 1
    factor.update({name: 0.5 for name in LINK_FITTED if name not in factor})
    rows = {name: [[b, 2, lat + factor[name] * b / bw] for b in (1024, 1 << 16, 1 << 22)]
            for name in LINK_FITTED}
    # the relay's hop pays no wake-up a collective does: its own curve, not the link's fit
    rows["hop"] = [[b, 2, lat / 20 + b / (3 * bw)] for b in (1024, 1 << 16, 1 << 22)]
    assert set(rows) == set(COLLECTIVES)
    got_lat, got_bw = fit_link(rows)
    assert got_lat == pytest.approx(lat, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)


def test_fit_link_takes_the_largest_message_where_the_sizes_do_not_tell_a_bandwidth():
    """Timings that are all latency (a quick calibration's 1 KiB and 256 KiB calls each paying
    ~1 ms of waits) fit a bandwidth no link has (the slope is noise): the largest message's
    time is taken as its transfer instead, a bandwidth it did reach."""
    rows = {name: [[1024, 2, 1.0e-3], [1 << 18, 2, 1.0001e-3]] for name in COLLECTIVES}
    lat, bw = fit_link(rows)
    assert bw == pytest.approx((1 << 18) / 1.0001e-3, rel=1e-9) and lat < 1.1e-3


def test_fit_gemm_and_flash_recover_their_curves():
    peak, half = 8e10, 24.0
    f = lambda x: x / (x + half)  # noqa: E731
    curve = [[m, n, k, peak * f(m) * f(n) * f(k)] for m in (32, 128, 512) for n in (32, 512)
             for k in (64, 1024)]
    got_peak, got_half = fit_gemm(curve)
    assert got_half == pytest.approx(half, rel=0.1) and got_peak == pytest.approx(peak, rel=0.1)
    att = [[L, 0.5 * 1e11 * L / (L + 128), 0.4 * 1e11 * L / (L + 128)] for L in (64, 256, 1024)]
    fit = fit_flash(att, 1e11)
    assert fit["flash_fwd_efficiency"] == pytest.approx(0.5, rel=0.05)
    assert fit["flash_bwd_efficiency"] == pytest.approx(0.4, rel=0.05)
    assert fit["flash_half_len"] == pytest.approx(128, rel=0.1)
    assert fit["flash_half_head_dim"] == 0.0          # no head-dim curve: not modelled


def test_fit_flash_separates_the_head_dim_from_the_length():
    """Rates falling with the key length (half 128) and the head dim (half 24): the length
    curve at head dim 64, the head-dim curve at length 256, fitted jointly."""
    def rate(e, L, D):
        return e * 1e11 * L / (L + 128) * D / (D + 24)
    att = [[L, rate(0.5, L, 64), rate(0.4, L, 64)] for L in (64, 256, 1024)]
    dims = [[256, D, rate(0.5, 256, D), rate(0.4, 256, D)] for D in (16, 32, 64, 128)]
    fit = fit_flash(att, 1e11, dims, head_dim=64)
    assert fit["flash_half_len"] == pytest.approx(128, rel=0.1)
    assert fit["flash_half_head_dim"] == pytest.approx(24, rel=0.1)
    assert fit["flash_fwd_efficiency"] == pytest.approx(0.5, rel=0.05)
    assert fit["flash_bwd_efficiency"] == pytest.approx(0.4, rel=0.05)
    # the same rows fitted as if the length curve were at head dim 16: a different fit
    assert fit_flash(att, 1e11, dims, head_dim=16)["flash_half_head_dim"] != pytest.approx(24)


def test_ranks_are_grouped_into_links_by_node():
    # 2 nodes of 3 ranks: intra = each node's ranks, inter = the i-th rank of every node
    assert link_groups([0, 0, 0, 1, 1, 1]) == {"intra": [[0, 1, 2], [3, 4, 5]],
                                               "inter": [[0, 3], [1, 4], [2, 5]]}
    assert link_groups([0, 1]) == {"intra": [], "inter": [[0, 1]]}    # one rank per node
    assert link_groups([0, 0]) == {"intra": [[0, 1]], "inter": []}    # one machine


def _cpu(**changes):
    from autopar.cost.hardware import Cluster
    return Cluster(name="x", gpus_per_node=2, peak_flops=1e11, memory_bytes=1e10,
                   hbm_bandwidth_Bps=1e10, intra_node_bandwidth_Bps=1e9,
                   intra_node_latency_s=1e-4, inter_node_bandwidth_Bps=1e9,
                   inter_node_latency_s=1e-4, gemm_max_efficiency=1.0, gemm_half_dim=16.0,
                   **changes)


def test_a_measured_curve_prices_its_collective_and_only_that_one():
    from autopar.cost.comm import allgather_s, allreduce_s, p2p_s, reducescatter_s
    from autopar.cost.hardware import CollectiveCurve
    # an all-reduce whose time is not affine in the size (gloo switches algorithms)
    curve = CollectiveCurve(link="intra", kind="all_reduce", ranks=2,
                            bytes=(8.0, 4096.0, 65536.0, 1048576.0),
                            seconds=(5e-4, 1.7e-3, 1.3e-3, 1.4e-3))
    cl = _cpu(collective_curves=(curve,))
    plain = _cpu()
    assert allreduce_s(cl, 4.0, 2, False) == 5e-4                      # below: the floor
    assert allreduce_s(cl, 4096.0, 2, False) == pytest.approx(1.7e-3)  # a point
    mid = 65536.0 + (1048576.0 - 65536.0) / 2
    assert allreduce_s(cl, mid, 2, False) == pytest.approx(1.35e-3)    # linear between
    slope = 1e-4 / (1048576.0 - 65536.0)
    assert allreduce_s(cl, 2 * 1048576.0, 2, False) == pytest.approx(1.4e-3 + slope * 1048576)
    # another kind, link or group size: the link's latency + bytes / bandwidth
    assert allgather_s(cl, 65536.0, 2, False) == allgather_s(plain, 65536.0, 2, False)
    assert reducescatter_s(cl, 65536.0, 2, False) == allgather_s(plain, 65536.0, 2, False)
    assert allreduce_s(cl, 65536.0, 2, True) == allreduce_s(plain, 65536.0, 2, True)
    assert allreduce_s(cl, 65536.0, 4, False) == allreduce_s(plain, 65536.0, 4, False)
    assert p2p_s(cl, 65536.0, False) == p2p_s(plain, 65536.0, False)


def test_a_pipeline_hop_is_priced_from_the_measured_relay_and_ring_steps_from_the_exchange():
    """The runtime's pipeline hop (the receiver blocked on an irecv it posted) is priced from
    calibrate's `hop` curve, not from the blocking exchange ring attention runs (on the 2-vCPU
    host 0.06 ms against 0.4-1.4 ms at 64 KiB); a cluster without a hop curve (files written
    before it) prices the hop as the exchange, as before."""
    from autopar.cost.comm import hop_s, p2p_hop_s, p2p_s
    from autopar.cost.config import Config
    from autopar.cost.hardware import CollectiveCurve
    from autopar.cost.profile import transformer_profile
    sizes = (8.0, 65536.0, 1048576.0)
    exchange = CollectiveCurve(link="intra", kind="send_recv", ranks=2, bytes=sizes,
                               seconds=(8e-4, 1e-3, 2e-3))
    relay = CollectiveCurve(link="intra", kind="hop", ranks=2, bytes=sizes,
                            seconds=(5e-5, 6e-5, 3e-4))
    both, old = _cpu(collective_curves=(exchange, relay)), _cpu(collective_curves=(exchange,))
    assert hop_s(both, 65536.0, False) == pytest.approx(6e-5)
    assert p2p_s(both, 65536.0, False) == pytest.approx(1e-3)       # ring attention's step
    assert hop_s(old, 65536.0, False) == p2p_s(old, 65536.0, False)
    assert hop_s(both, 65536.0, True) == p2p_s(both, 65536.0, True)  # no inter-node curve
    prof = transformer_profile(num_layers=4, hidden=128, heads=4, seq_len=128, vocab=512)
    cfg = Config(t=1, p=2, d=1, micro_batch_size=1, num_microbatches=8)
    act = prof.block.input_bytes    # one micro-batch's activation, t = 1: sent whole
    assert p2p_hop_s(prof, both, cfg) == pytest.approx(hop_s(both, act, False))
    assert p2p_hop_s(prof, old, cfg) == pytest.approx(p2p_s(old, act, False))


def test_pieces_waited_once_pay_one_call_and_a_latency_per_further_piece():
    """The runtime's collective matmul issues a reduction in pieces, asynchronously, and waits
    once: on a measured curve (which holds a blocked call's wake-up) one call of the whole plus
    the link's latency per further piece, not pieces calls (the t = 2 plans of
    plan_vs_measured were priced 74% slow so); on the formulas exactly pieces × (latency +
    bytes / pieces / bandwidth), as before."""
    from autopar.cost.comm import allreduce_s, pieces_s, reducescatter_s
    from autopar.cost.hardware import CollectiveCurve
    curve = CollectiveCurve(link="intra", kind="all_reduce", ranks=2,
                            bytes=(8.0, 65536.0, 1048576.0), seconds=(5e-4, 1.8e-3, 2.1e-3))
    cl, plain = _cpu(collective_curves=(curve,)), _cpu()
    b = 262144.0
    assert pieces_s(cl, allreduce_s, b, 4, 2, False) == pytest.approx(
        allreduce_s(cl, b, 2, False) + 3 * 1e-4)
    assert pieces_s(cl, allreduce_s, b, 4, 2, False) < 4 * allreduce_s(cl, b / 4, 2, False)
    for coll in (allreduce_s, reducescatter_s):
        assert pieces_s(plain, coll, b, 4, 2, False) == pytest.approx(
            4 * coll(plain, b / 4, 2, False), rel=1e-12)
        assert pieces_s(plain, coll, b, 1, 2, False) == coll(plain, b, 2, False)
    assert pieces_s(plain, allreduce_s, b, 4, 1, False) == 0.0      # a group of one


def test_collective_timings_keep_the_rare_long_waits_every_call_pays():
    """`timed_s(typical=True)` (collectives) is the mean call of every batch, so a wait that
    comes every few calls (a VM's timer tick waking a blocked rank) is in it at its rate; the
    best batch (compute) drops it: a call of ~0 s that sleeps 4 ms every 8th call."""
    import time

    import torch

    from autopar.cost.calibrate_compute import timed_s
    calls = [0]

    def fn():
        calls[0] += 1
        if calls[0] % 8 == 0:
            time.sleep(0.004)
    typical = timed_s(fn, torch.device("cpu"), 40, 3, typical=True)
    assert 0.4e-3 < typical < 0.8e-3
    calls[0] = 1      # batches of 5 between the long calls: the best batch holds none
    assert timed_s(fn, torch.device("cpu"), 5, 3) < 0.1e-3


def test_a_collective_is_timed_after_a_burst_of_compute_less_the_burst(monkeypatch):
    """Collectives are issued as training issues them, after some compute, and charged only
    their own part: burst + call less burst alone. Timed by a counting clock (a wall-clock
    sleep of 1 ms overshot the bound on a loaded host): each timed call runs the burst, then
    the collective, in that order, and is charged 3 ms of which the burst alone took 2."""
    import torch

    import autopar.cost.calibrate as C
    order, seen = [], {}

    def timed_s(fn, device, calls, repeats, typical=False):
        seen.update(calls=calls, repeats=repeats, typical=typical)
        for _ in range(calls):
            fn()
        return 3e-3
    monkeypatch.setattr(C, "timed_s", timed_s)
    got = C._after_compute_s(lambda: order.append("call"), lambda: order.append("burst"),
                             2e-3, torch.device("cpu"), 5, 2)
    assert got == pytest.approx(1e-3)
    assert order == ["burst", "call"] * 5 and seen == dict(calls=5, repeats=2, typical=True)
    # a burst timed longer than the pair (noise) leaves a floor, not a negative time
    assert C._after_compute_s(lambda: None, lambda: None, 4e-3, torch.device("cpu"), 1, 1) > 0


def test_a_cpu_gemm_is_timed_cold_with_the_eviction_left_out_of_its_time():
    """On a CPU each timed call of the GEMM curve comes after a write that pushes its operands
    out of the core's cache (`timed_s`'s evict), as a step's GEMMs meet them, and only the call
    is timed: a 2-tick call after a 100-tick write is 2 ticks."""
    import torch

    from autopar.cost.calibrate_compute import timed_s
    ticks, order = [0.0], []

    class Write:
        def fill_(self, _):
            ticks[0] += 100.0
            order.append("write")

    def call():
        ticks[0] += 2.0
        order.append("call")
    assert timed_s(call, torch.device("cpu"), calls=3, repeats=2, clock=lambda: ticks[0],
                   evict=Write()) == 2.0
    assert order == ["call"] + ["write", "call"] * 6   # a warm-up, then a write before each


def test_host_work_keeps_the_best_of_rounds_spread_over_the_calibration():
    """A slow spell that fell on one round of a host measurement is not the hardware's: the
    least seconds and the highest bandwidth of the rounds are kept, each on its own."""
    from autopar.cost.calibrate import _least_host_work
    rounds = [{"checkpoint_op_s": 121e-6, "kernel_launch_s": 6e-6, "hbm_bandwidth_Bps": 24e9},
              {"checkpoint_op_s": 74e-6, "kernel_launch_s": 7e-6, "hbm_bandwidth_Bps": 27e9}]
    assert _least_host_work(rounds) == {"checkpoint_op_s": 74e-6, "kernel_launch_s": 6e-6,
                                        "hbm_bandwidth_Bps": 27e9}


def test_calibrate_keeps_every_collective_curve_and_a_file_round_trips_them(tmp_path):
    from autopar.cost.calibrate import collective_curves
    from autopar.cost.hardware import CollectiveCurve, read_cluster_file, save_cluster
    rows = {"all_reduce": [[8, 2, 4e-4], [8, 2, 6e-4], [4096, 2, 1e-3], [4096, 2, 3e-3]],
            "send_recv": [[8, 2, 1e-4], [4096, 2, 2e-4]]}
    curves = collective_curves("intra", rows, "inter")
    assert curves == [CollectiveCurve(link="inter", kind="all_reduce", ranks=2,
                                      bytes=(8.0, 4096.0), seconds=(5e-4, 2e-3)),
                      CollectiveCurve(link="inter", kind="send_recv", ranks=2,
                                      bytes=(8.0, 4096.0), seconds=(1e-4, 2e-4))]
    cl = _cpu(collective_curves=tuple(curves), tp_row_pieces=4, optimizer_param_s=1e-8)
    assert read_cluster_file(save_cluster(cl, tmp_path / "c.json"))[0] == cl
    with pytest.raises(ValueError, match="ascending"):
        CollectiveCurve(link="intra", kind="all_reduce", ranks=2, bytes=(8.0, 4.0),
                        seconds=(1e-4, 1e-4))
    (tmp_path / "bad.json").write_text((tmp_path / "c.json").read_text().replace(
        '"kind": "all_reduce"', '"kind": "allreduce"'))
    with pytest.raises(ValueError, match="collective_curves.*kind one of"):
        read_cluster_file(tmp_path / "bad.json")


def test_an_eager_runtime_pays_each_op_and_a_full_core_hides_no_communication():
    import dataclasses

    from autopar.cost.compute import block_times_s
    from autopar.cost.profile import transformer_profile
    from autopar.cost.solver import solve
    prof = transformer_profile(num_layers=4, hidden=128, heads=4, seq_len=128, vocab=512)
    prof = dataclasses.replace(prof, block=dataclasses.replace(prof.block, eager_ops=20))
    eager = _cpu(elementwise="eager", kernel_launch_s=5e-6, autograd_op_s=10e-6)
    base = block_times_s(prof, dataclasses.replace(eager, autograd_op_s=0.0, kernel_launch_s=0.0),
                         1, 1, "none", False, False)[0]
    # every op once forward (its dispatch) and once backward (autograd's), per micro-batch,
    # whatever the micro-batch size; a GEMM's own launch stays with the GEMM
    got = block_times_s(prof, eager, 1, 1, "none", False, False)[0]
    gemm_launches = 3 * len(prof.block.gemms) * 5e-6
    assert got - base == pytest.approx(20 * 15e-6 + gemm_launches, rel=1e-6)
    fused = dataclasses.replace(eager, elementwise="fused")
    assert block_times_s(prof, fused, 1, 1, "none", False, False)[0] < got
    # data parallelism: what the schedule hides of the gradient reduction (breadth-first: a
    # chunk's under the next chunks' backward), scaled by the measured overlap
    hides, none = (solve(prof, dataclasses.replace(_cpu(comm_overlap=x), peak_flops=1e9),
                         gpus=2, global_batch_size=4, d=2,
                         micro_batch_size=1, schedule="breadth-first", v=4,
                         zero=0).predicted.dp_comm_s
                   for x in (1.0, 0.0))
    assert none > hides


def test_an_fp32_run_moves_4_byte_activations_gradients_and_weights():
    """Training in fp32 (compile's default; what `autopar tune` measures) holds and sends
    4-byte activations and reduces / gathers 4-byte gradients and weights: the profile's byte
    counts double, the data-parallel and tensor-parallel traffic with them; 16-bit stays."""
    from dataclasses import replace

    from autopar.api import precision_profiles
    from autopar.cost.config import Config
    from autopar.cost.hardware import get_cluster
    from autopar.cost.model import predict
    from autopar.cost.profile import transformer_profile

    half = transformer_profile(num_layers=4, hidden=256, heads=4, seq_len=256, vocab=512)
    full = half.with_training_bytes(4)
    assert full.activation_bytes_per_elem == 4 and full.with_training_bytes(4) is full
    for k in ("act_split_bytes", "act_replicated_bytes", "input_bytes", "other_bytes"):
        assert getattr(full.block, k) == 2 * getattr(half.block, k)
    assert full.block.fused.act_split_bytes == 2 * half.block.fused.act_split_bytes
    assert full.block.fused.calls[0].materialized_bytes == \
        2 * half.block.fused.calls[0].materialized_bytes
    assert full.block.gemms == half.block.gemms and full.with_training_bytes(2) == half
    with pytest.raises(ValueError, match="bytes_per_elem=3"):
        half.with_training_bytes(3)
    a100 = get_cluster("dgx-a100-80gb")
    assert precision_profiles(half, a100, "fp32")["fp32"].activation_bytes_per_elem == 4
    assert precision_profiles(half, a100, "bf16")["bf16"].activation_bytes_per_elem == 2
    # bandwidth-bound links: the communication terms double, compute stays
    slow = replace(a100, name="slow-links",
                   intra_node_bandwidth_Bps=a100.intra_node_bandwidth_Bps / 1000)
    for cfg, term in ((Config(t=1, p=1, d=8, num_microbatches=1), "dp_comm_s"),
                      (Config(t=8, p=1, d=1, num_microbatches=1), "tp_comm_s")):
        h, f = (getattr(predict(prof, slow, cfg), term) for prof in (half, full))
        assert f == pytest.approx(2 * h, rel=0.05), (term, h, f)


def test_a_weight_gradient_reduction_is_per_micro_batch_not_per_sequence():
    """SP's copy_to_tp on a replicated weight (a norm read by sequence shards) all-reduces
    the weight's gradient once per micro-batch whatever its size; an activation's scales."""
    from autopar.cost.comm import inserted_collectives_s
    from autopar.cost.hardware import get_cluster
    from autopar.cost.profile import TPCollective, TPRegionFallback

    cl = get_cluster("dgx-a100-80gb")
    weight = TPRegionFallback(collectives=(TPCollective(kind="all-reduce", elems=1 << 20,
                                                        backward=True, per_sequence=False),))
    act = TPRegionFallback(collectives=(TPCollective(kind="all-reduce", elems=1 << 20,
                                                     backward=True),))
    one, eight = (inserted_collectives_s(cl, weight, 2, b, 2, False) for b in (1, 8))
    assert one == eight and one[0] == 0.0 and one[1] > 0
    a1, a8 = (inserted_collectives_s(cl, act, 2, b, 2, False)[1] for b in (1, 8))
    assert a8 > 4 * a1


def test_context_all_gather_is_priced_as_the_runtime_calls_it():
    """The all-gather method gathers K and V in a call each and reduce-scatters each gradient
    (a step of the GPT at c = 2 runs 16 all-gathers and 16 reduce-scatters: 4 layers × 2
    micro-batches × 2): each call pays its latency, backward at the reduce-scatter's price."""
    from autopar.cost.comm import allgather_s, reducescatter_s
    from autopar.cost.config import Config
    from autopar.cost.exchanges import context_comm_s
    from autopar.cost.hardware import get_cluster
    from autopar.cost.model import rank_profile
    from autopar.cost.profile import transformer_profile

    cl = get_cluster("dgx-a100-80gb")
    prof = transformer_profile(num_layers=4, hidden=256, heads=4, seq_len=256, vocab=512)
    cfg = Config(t=1, p=1, d=1, c=2, micro_batch_size=2)
    rank = rank_profile(prof, cl, cfg)
    kv = cfg.micro_batch_size * rank.block.cp_gather_elems * rank.activation_bytes_per_elem
    fwd, total = context_comm_s(rank, cl, cfg)
    assert fwd == pytest.approx(2 * allgather_s(cl, kv / 2, 2, False))
    assert total == pytest.approx(fwd + 2 * reducescatter_s(cl, kv / 2, 2, False))


def test_a_context_rank_keeps_the_weight_gradient_reductions_whole():
    """Restated for c context ranks, an activation's inserted collective shrinks to the rank's
    tokens; SP's weight-gradient all-reduce does not (the weight is whole on every rank)."""
    from dataclasses import replace

    from autopar.cost.context import context_rank_profile
    from autopar.cost.profile import (TPCollective, TPCorrection, TPRegionFallback,
                                      transformer_profile)

    fix = TPRegionFallback(collectives=(
        TPCollective(kind="all-reduce", elems=256, backward=True, per_sequence=False),
        TPCollective(kind="all-gather", elems=4096, backward=False)))
    prof = replace(transformer_profile(num_layers=2, hidden=256, heads=4, seq_len=256,
                                       vocab=512),
                   tp_fallbacks=(TPCorrection(t=2, sequence_parallel=True, block=fix),))
    got = context_rank_profile(prof, 2).tp_correction(2, True).block.collectives
    assert [x.elems for x in got] == [256, 2048]


def test_one_gpu_keeps_the_base_clusters_links_and_is_refused_without_one(tmp_path):
    """One rank (a single GPU, as the first H100 run had) measures the device and no link:
    `--base CLUSTER` keeps that cluster's links beside the measured device; without it the
    refusal comes before anything is measured (the run's calibrate spawned a second rank on a
    one-GPU machine and failed). A GPU measures at training sizes (the CPU grids' 1024³ GEMM
    was launch-bound there)."""
    import dataclasses

    import torch

    from autopar.cost.calibrate import calibrate, cluster_from_record, grids
    from autopar.cost.hardware import get_cluster
    with pytest.raises(ValueError, match="1 rank measures no link.*--base CLUSTER"):
        calibrate(ranks=1, out=tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()
    peak, half = 7e14, 256.0
    f = lambda x: x / (x + half)  # noqa: E731
    dims, lens, head_dims = grids(torch.device("cuda"), quick=False)
    assert max(dims) >= 8192 and max(lens) >= 8192 and max(head_dims) >= 256
    record = {"measured_at": "2026-11-26T20:31:53+00:00", "hosts": ["gpu"], "world": 1,
              "nodes": 1, "ranks_per_node": 1, "device": "NVIDIA H100", "backend": "nccl",
              "dtype": "bfloat16", "matmul_curve": [[m, n, k, peak * f(m) * f(n) * f(k)]
                                                   for m in dims for n in dims for k in dims],
              "attention_curve": [[L, 0.5 * peak * L / (L + 512), 0.4 * peak * L / (L + 512)]
                                  for L in lens],
              "hbm_bandwidth_Bps": 2.7e12, "kernel_launch_s": 1e-5, "autograd_op_s": 1.7e-5,
              "optimizer_param_s": 4e-11, "collectives": {}, "memory": [85e9, 1e9],
              "memory_source": "memory_bytes: measured", "cores": 16}
    base = get_cluster("dgx-h100-80gb")
    got = cluster_from_record(record, "h100-one", 989e12, base)
    assert (got.intra_node_bandwidth_Bps, got.inter_node_latency_s, got.gpus_per_node,
            got.collective_curves) == (base.intra_node_bandwidth_Bps, base.inter_node_latency_s,
                                       base.gpus_per_node, base.collective_curves)
    assert got.hbm_bandwidth_Bps == 2.7e12 and got.memory_bytes == 85e9
    assert got.gemm_max_efficiency == pytest.approx(peak / 989e12, rel=0.05)
    # flash efficiencies are against the GEMM asymptote (peak · e_max = 7e14 here)
    assert got.flash_fwd_efficiency == pytest.approx(0.5, rel=0.1)
    assert any("dgx-h100-80gb's, as given with --base" in s for s in got.sources)
    with pytest.raises(ValueError, match="--base CLUSTER"):
        cluster_from_record(record, "h100-one", 989e12, None)
    assert dataclasses.replace(got, name=base.name) != base   # the device's numbers are new


def test_gemm_fit_leaves_out_shapes_that_time_their_dispatch():
    """On a GPU a small GEMM step takes its dispatch (launches, the autograd node), whatever
    its FLOPs: fitted with them, the curve's asymptote and half dim go wrong for the large
    shapes that training runs. With the record's own dispatch floor they are left out."""
    from cost.calibrate import dispatch_floor_s
    peak, half, floor = 7e14, 256.0, 60e-6
    f = lambda x: x / (x + half)  # noqa: E731
    dims = (512, 1024, 2048, 4096, 8192)
    curve = [[m, n, k, 6.0 * m * n * k / max(6.0 * m * n * k / (peak * f(m) * f(n) * f(k)),
                                            floor)] for m in dims for n in dims for k in dims]
    record = {"kernel_launch_s": 10e-6, "autograd_op_s": 30e-6}
    assert dispatch_floor_s(record) == pytest.approx(floor)
    got_peak, got_half = fit_gemm(curve, dispatch_floor_s(record))
    assert got_peak == pytest.approx(peak, rel=0.05) and got_half == pytest.approx(half, rel=0.2)
    naive_peak, naive_half = fit_gemm(curve)
    assert abs(naive_peak / peak - 1) > 0.2   # the dispatch-bound shapes mislead a plain fit


def test_an_asynchronous_devices_host_floor_is_read_from_its_smallest_shape():
    """On a GPU a step takes the longer of its host work and its device work, and the host's
    part (a Python backward() a call: 120-190 µs on the H200) is more than the record's
    per-op numbers count (here 60 µs): the grid's smallest shape times it. Fitted with the
    counted floor, the shapes between 120 and 300 µs — still the host's — bent the fit to
    e_max 1.0 and half dim 2048 on the H200 (2026-11-27); a CPU record keeps the counted one
    (its steps are host and device at once: the small shapes are compute there)."""
    from cost.calibrate import dispatch_floor_s
    peak, half, host = 7e14, 64.0, 150e-6
    f = lambda x: x / (x + half)  # noqa: E731
    dims = (512, 1024, 2048, 4096, 8192)
    curve = [[m, n, k, 6.0 * m * n * k / max(6.0 * m * n * k / (peak * f(m) * f(n) * f(k)),
                                            host)] for m in dims for n in dims for k in dims]
    record = {"kernel_launch_s": 10e-6, "autograd_op_s": 30e-6, "matmul_curve": curve,
              "device": "NVIDIA H200"}
    assert dispatch_floor_s(record) == pytest.approx(host)
    got_peak, got_half = fit_gemm(curve, dispatch_floor_s(record))
    assert got_peak == pytest.approx(peak, rel=0.05)
    counted_peak, _ = fit_gemm(curve, 60e-6)
    assert abs(counted_peak / peak - 1) > 0.1   # the counted floor leaves host-bound shapes in
    assert dispatch_floor_s({**record, "device": "cpu"}) == pytest.approx(60e-6)


def test_dispatch_is_measured_on_a_block_op_mix_of_as_many_ops_as_it_divides_by():
    """calibrate's per-op dispatch (`measure_dispatch`) divides the op mix's time by the ops
    `_block_ops` says it dispatches: counted here op by op as the dispatcher sees them (the
    generated chunks' aten overloads, views included, GEMMs none), each on a tensor that
    requires grad."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.cost.calibrate_compute import _block_ops

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))
    forward, ops = _block_ops(torch.float32, torch.device("cpu"))
    with Count() as seen:
        out = forward()
    # the graph's ops; autograd's own detach of an output it saves (the softmax's) aside
    graph_ops = [f for f in seen.ops if f is not torch.ops.aten.detach.default]
    assert len(graph_ops) == ops and len(seen.ops) == ops + 1
    assert not any("mm" in str(f) or "linear" in str(f) for f in graph_ops)
    assert out.requires_grad and out.grad_fn is not None


def test_the_split_backward_costs_its_ops_and_its_measured_share_of_the_compute():
    """interleaved-zb's B/W split: per op (`split_backward_op_s`) and, on a CPU, a share of
    the region's forward + backward (`split_backward_frac`: its backward runs with the graph
    retained; ~0.1 measured here), both host costs a fused GPU stack does not pay."""
    import dataclasses

    from autopar.cost.compute import split_backward_s
    from autopar.cost.profile import transformer_profile
    block = transformer_profile(num_layers=2, hidden=64, heads=4, seq_len=32, vocab=64).block
    per_op = _cpu(elementwise="eager", split_backward_op_s=1e-5)
    both = dataclasses.replace(per_op, split_backward_frac=0.1)
    assert split_backward_s(both, block, 2e-3) - split_backward_s(per_op, block, 2e-3) == \
        pytest.approx(2e-4)
    assert split_backward_s(per_op, block, 2e-3) == split_backward_s(per_op, block, 5e-3) > 0
    assert split_backward_s(dataclasses.replace(both, elementwise="fused"), block, 2e-3) == 0
    with pytest.raises(ValueError, match="split_backward_frac"):
        dataclasses.replace(both, split_backward_frac=-0.1)
    # calibrate's measure since 2026-11-28: per byte of the region's saved activations
    per_byte = dataclasses.replace(per_op, split_backward_s_per_byte=1e-10)
    assert split_backward_s(per_byte, block, 2e-3, 1e6) - split_backward_s(per_op, block, 2e-3,
                                                                          1e6) == \
        pytest.approx(1e-4)
    with pytest.raises(ValueError, match="split_backward_s_per_byte"):
        dataclasses.replace(per_op, split_backward_s_per_byte=-1e-10)


def test_the_split_fit_recovers_its_per_op_and_per_byte_costs():
    """calibrate times the B/W split on GPT blocks at shapes whose ops are alike and whose
    saved bytes differ (`SPLIT_SHAPES`) and fits extra = ops × a + bytes × c: the constants
    that generated the rows come back; where the least-squares pair would put a term below
    zero, that term is 0 and the other fitted alone (never a negative cost)."""
    from autopar.cost.calibrate_compute import fit_split_backward
    a, c = 25e-6, 5e-11
    rows = [(42, nbytes, 42 * a + nbytes * c) for nbytes in (1.1e6, 6.8e6, 2.3e7)]
    assert fit_split_backward(rows) == pytest.approx((a, c), rel=1e-6)
    # extra falling with the bytes: no cost per byte, the ops' share fitted alone
    falling = [(42, 1e6, 2e-3), (42, 1e7, 1.5e-3), (42, 3e7, 1e-3)]
    per_op, per_byte = fit_split_backward(falling)
    assert per_byte == 0.0 and 1e-3 / 42 < per_op < 2e-3 / 42
    assert fit_split_backward([(42, 1e6, -1e-4), (42, 1e7, -2e-4)]) == (0.0, 0.0)


def test_the_split_fit_counts_bytes_and_ops_as_the_pricing_does():
    """calibrate divides the split's cost by the ops and saved bytes of its GPT blocks as a
    CPU plan's pricing counts them (the profile restated to fused attention and eager ops,
    `CostMemo.rank_profile`): the two agree, and the bytes are what autograd itself saves of
    those blocks (no materialized s² scores: the profile as measured holds ~1.4x as many)."""
    import torch

    from autopar import cross_entropy
    from autopar.api import plan_profile
    from autopar.cost.calibrate_compute import _counted
    from autopar.cost.compute import forward_ops
    from autopar.cost.config import Config
    from autopar.cost.hardware import get_cluster
    from autopar.cost.memo import CostMemo
    from autopar.cost.memory import layer_activation_bytes
    from autopar.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32))
    ops, saved = _counted(model, torch.float32, 4)
    _, prof = plan_profile(model, (torch.zeros(1, 32, dtype=torch.long),), cross_entropy,
                           None, "local-cpu", gpu_counts=(1,))
    cfg = Config(t=1, p=2, d=1, v=2, micro_batch_size=4, num_microbatches=4,
                 schedule="interleaved-zb")
    rank = CostMemo().rank_profile(prof.with_training_bytes(4), get_cluster("local-cpu"), cfg)
    assert saved == 2 * layer_activation_bytes(rank, 1, 4, "none", False)
    assert ops == 2 * forward_ops(rank.block)
    x = torch.randn(4, 32, 32, requires_grad=True)
    blocks, held = model.transformer.h, {}
    own = {q.untyped_storage().data_ptr() for q in blocks.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blocks[1](blocks[0](x))
    assert saved == pytest.approx(sum(held.values()), rel=0.1)


def test_gemm_fit_takes_off_the_launches_the_cost_model_adds_apart():
    """A measured GEMM step holds the launches that cost/compute.py `gemm_time_s` adds to
    every GEMM apart from its rate: fitted with them in, a curve priced them twice (small
    shapes slow, the asymptote above the plateau to make up for it). Taken off, the fit
    recovers the rate that generated the steps."""
    peak, half, launches = 1.1e11, 8.0, 12e-6
    f = lambda x: x / (x + half)  # noqa: E731
    dims = (64, 128, 256, 512, 1024)
    curve = [[m, n, k, 6.0 * m * n * k / (6.0 * m * n * k / (peak * f(m) * f(n) * f(k))
                                          + launches)] for m in dims for n in dims for k in dims]
    got_peak, got_half = fit_gemm(curve, priced_s=launches)
    assert got_peak == pytest.approx(peak, rel=0.02) and got_half == pytest.approx(half, rel=0.1)
    naive_peak, naive_half = fit_gemm(curve)
    assert naive_half > 1.3 * half     # the launches read as a slower ramp


def test_collectives_are_timed_in_rounds_over_every_collective_and_size(monkeypatch):
    """Each (collective, size) is timed once per round, rounds over all of them in turn (the
    host's waits drift over seconds: three batches back to back caught one collective at
    one rate and the next at another), its time the mean of its rounds (a relay's: half, a
    round trip being two hops)."""
    import types

    import torch

    from autopar.cost import calibrate as C
    order: list[tuple[str, int]] = []
    fake_dist = types.SimpleNamespace(barrier=lambda: None, new_group=lambda ranks: "g",
                                      get_rank=lambda: 0)
    monkeypatch.setattr(C, "dist", fake_dist)
    monkeypatch.setattr(C, "_burst", lambda device: (lambda: None))
    monkeypatch.setattr(C, "timed_s", lambda *a, **k: 0.0)
    monkeypatch.setattr(C, "_collective_fns", lambda name, nbytes, group, ranks, device:
                        ((name, nbytes), nbytes))

    def timed(fn, burst, burst_s, device, calls, repeats):
        assert repeats == 1
        order.append(fn)
        return 1e-3 * (1 + (len(order) - 1) // len(cases))   # 1, 2, 3 ms: rounds 1, 2, 3
    monkeypatch.setattr(C, "_after_compute_s", timed)
    sizes = C._FULL_MSG_BYTES
    cases = [(name, n) for name in C.COLLECTIVES for n in sizes]
    ticks: list[str] = []
    out = C.measure_collectives({"intra": [[0, 1]]}, torch.device("cpu"), False, ticks.append)
    assert order == cases * 3                       # rounds, not batches back to back
    assert len(ticks) == len(C.COLLECTIVES)         # the progress bar's count, as before
    rows = out["intra"]
    assert rows["all_reduce"] == [[n, 2, pytest.approx(2e-3)] for n in sizes]
    assert rows["hop"] == [[n, 2, pytest.approx(1e-3)] for n in sizes]


def test_a_measured_attention_length_prices_its_own_time_back(monkeypatch):
    """calibrate counts an attention call's FLOPs as the cost model charges them (the causal
    tiles' fraction, `AttentionCall.fwd_flops`), so a cluster fitted to a length prices that
    length's causal call at the time measured. Counted as the exact triangle, a length of 128
    (one 128-tile: the model charges it whole) was priced at 2× its measured time."""
    import dataclasses

    import torch

    from autopar.cost import calibrate_compute as CC
    from autopar.cost.calibrate import fit_flash
    from autopar.cost.compute import fused_attention_time_s
    from autopar.cost.hardware import get_cluster
    from autopar.cost.profile import AttentionCall, causal_tile_fraction
    fwd_s, bwd_s = 1e-3, 2.6e-3
    monkeypatch.setattr(CC, "_batch_calls", lambda *a, **k: 1)
    times = iter([fwd_s, fwd_s + bwd_s] * 4)
    monkeypatch.setattr(CC, "timed_s", lambda *a, **k: next(times))
    heads, dim = CC._CPU_HEADS
    for length in (128, 1024):
        curve = CC.measure_attention((length,), torch.float32, torch.device("cpu"), quick=True)
        peak = 1e15                       # every efficiency under 1 (fit_flash caps it)
        cluster = dataclasses.replace(get_cluster("local-cpu"), peak_flops=peak,
                                      hbm_bandwidth_Bps=1e15, **fit_flash(curve, peak))
        call = AttentionCall(heads=heads, kv_heads=heads, q_len=length, kv_len=length,
                             head_dim=dim, v_head_dim=dim, gemms=(), materialized_bytes=0,
                             active_fraction=causal_tile_fraction(length, length))
        fwd, bwd = fused_attention_time_s(cluster, call, 1, 1)
        launch = cluster.kernel_launch_s
        assert (fwd - launch, bwd - launch) == pytest.approx((fwd_s, bwd_s), rel=1e-6), length

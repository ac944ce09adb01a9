"""`autopar tune`'s refit (autopar/tune_fit.py), pure: the least-squares scales recover how much
slower compute and communication ran than predicted, the refitted cluster prices exactly that,
and Spearman's rank correlation."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.cost.hardware import get_cluster
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve
from autopar.tune_fit import (Scales, Trial, dispatch_seconds, fit_scales, plan_pins,
                              refit_cluster)
from autopar.tuning import spearman

PINS = (dict(d=8), dict(t=8), dict(t=2, d=4), dict(p=2, d=4), dict(t=4, p=2), dict(t=2, p=4))


def _abc(scales):
    """(compute, collectives, p2p): the scales these plans, which price no dispatch, fit."""
    assert scales.dispatch == scales.compute
    return scales.compute, scales.collectives, scales.p2p


def _scales(a, b, c=None, h=None):
    return Scales(compute=a, dispatch=a if h is None else h, collectives=b,
                  p2p=b if c is None else c)


def _plans(cluster, pins_list=PINS):
    prof = transformer_profile(num_layers=8, hidden=512, heads=8, seq_len=256, vocab=2000)
    return [solve(prof, cluster, gpus=8, global_batch_size=32, micro_batch_size=1, **pins)
            for pins in pins_list], prof


def test_refit_recovers_compute_and_communication_scales():
    cluster = get_cluster("h100-eth100g")
    plans, prof = _plans(cluster)
    comm = ("tp_comm_s", "pp_comm_s", "dp_comm_s", "cp_comm_s", "ep_comm_s")
    measured = [1.7 * (pl.predicted.step_time_s - sum(getattr(pl.predicted, k) for k in comm))
                + 2.5 * sum(getattr(pl.predicted, k) for k in comm) for pl in plans]
    trials = [Trial(plan=pl, measured_s=m, measured_memory_bytes=0.0)
              for pl, m in zip(plans, measured)]
    a, b, c = _abc(fit_scales(trials))
    assert a == pytest.approx(1.7, rel=1e-6) and b == pytest.approx(2.5, rel=1e-6) and c == b
    refit = refit_cluster(cluster, _scales(a, b), "test")
    assert refit.gemm_max_efficiency == pytest.approx(cluster.gemm_max_efficiency / 1.7)
    assert refit.intra_node_bandwidth_Bps == pytest.approx(cluster.intra_node_bandwidth_Bps / 2.5)
    assert refit.inter_node_latency_s == pytest.approx(cluster.inter_node_latency_s * 2.5)
    assert "refitted by autopar tune" in refit.sources[-1]
    # the refitted cluster prices every plan closer to what was "measured"
    for pl, m in zip(plans, measured):
        again = solve(prof, refit, gpus=8, global_batch_size=32, **plan_pins(pl))
        assert abs(again.predicted.step_time_s / m - 1) < abs(pl.predicted.step_time_s / m - 1)
        assert abs(again.predicted.step_time_s / m - 1) < 0.1


def test_a_faster_than_predicted_cluster_raises_the_peak_past_an_efficiency_of_one():
    cpu = dataclasses.replace(get_cluster("local-cpu"), gemm_max_efficiency=1.0)
    refit = refit_cluster(cpu, _scales(0.5, 1.0), "test")
    assert refit.gemm_max_efficiency == 1.0 and refit.peak_flops == pytest.approx(
        2 * cpu.peak_flops)
    assert refit.elementwise_efficiency <= 1.0
    assert refit.hbm_bandwidth_Bps * refit.elementwise_efficiency == pytest.approx(
        2 * cpu.hbm_bandwidth_Bps * cpu.elementwise_efficiency)


def test_the_refit_scales_what_calibrate_measured_with_the_rest():
    from autopar.cost.comm import allreduce_s
    from autopar.cost.hardware import CollectiveCurve
    curve = CollectiveCurve(link="intra", kind="all_reduce", ranks=2, bytes=(8.0, 1e6),
                            seconds=(1e-3, 2e-3))
    cpu = dataclasses.replace(get_cluster("local-cpu"), collective_curves=(curve,),
                              optimizer_param_s=1e-8, autograd_op_s=5e-6, checkpoint_op_s=3e-5,
                              split_backward_op_s=4e-6, split_backward_s_per_byte=2e-10)
    refit = refit_cluster(cpu, _scales(1.5, 3.0, h=2.0), "test")
    # measured in real blocks (the optimizer, op recompute's policy, the split's bytes): the
    # compute scale
    assert refit.optimizer_param_s == pytest.approx(1.5e-8)
    assert refit.split_backward_s_per_byte == pytest.approx(3e-10)
    assert refit.checkpoint_op_s == pytest.approx(1.5 * cpu.checkpoint_op_s)
    for host in ("kernel_launch_s", "autograd_op_s", "split_backward_op_s"):   # in isolation
        assert getattr(refit, host) == pytest.approx(2.0 * getattr(cpu, host)), host
    assert refit.split_backward_frac == cpu.split_backward_frac      # a share: as it was
    assert allreduce_s(refit, 5e5, 2, False) == pytest.approx(3 * allreduce_s(cpu, 5e5, 2, False))


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)


def test_one_plan_the_scales_cannot_fit_leaves_the_others_fitted():
    """A plan whose time the cost model misses (here 30% slower than its terms say) must not
    pull the scales off for the rest: the refit is the least absolute relative error."""
    cluster = get_cluster("h100-eth100g")
    plans, _ = _plans(cluster)
    comm = ("tp_comm_s", "pp_comm_s", "dp_comm_s", "cp_comm_s", "ep_comm_s")
    measured = [1.7 * (pl.predicted.step_time_s - sum(getattr(pl.predicted, k) for k in comm))
                + 2.5 * sum(getattr(pl.predicted, k) for k in comm) for pl in plans]
    measured[1] *= 1.3
    trials = [Trial(plan=pl, measured_s=m, measured_memory_bytes=0.0)
              for pl, m in zip(plans, measured)]
    a, b, _ = _abc(fit_scales(trials))
    assert a == pytest.approx(1.7, rel=1e-3) and b == pytest.approx(2.5, rel=1e-3)


def _pipeline_plans(cluster):
    """The PINS plans, the pipelined ones under 1F1B (whose order charges every hop: an
    interleaved group of N > p hides them on a GPU), their profile, and each plan's
    (compute, collectives, pipeline messages) seconds as `fit_scales` splits them."""
    plans, prof = _plans(cluster, PINS[:3] + tuple(dict(pins, schedule="1f1b")
                                                     for pins in PINS[3:]))
    coll = ("tp_comm_s", "dp_comm_s", "cp_comm_s", "ep_comm_s")
    parts = [(pl.predicted.step_time_s - sum(getattr(pl.predicted, k) for k in coll)
              - pl.predicted.pp_comm_s, sum(getattr(pl.predicted, k) for k in coll),
              pl.predicted.pp_comm_s) for pl in plans]
    return plans, prof, parts


def _trials(plans, measured):
    return [Trial(plan=pl, measured_s=m, measured_memory_bytes=0.0)
            for pl, m in zip(plans, measured)]


def test_the_pipeline_messages_get_their_own_scale():
    """The refit scales the pipeline's messages apart from the collectives (what pre-posted
    sends cost drifts on its own): with compute ×1.1, collectives ×0.9 and pipeline messages
    ×0.4 "measured", the three scales come back, and the refitted cluster prices a pipeline
    hop 0.4× and an all-reduce and ring attention's send/recv 0.9×. Asked for one scale (or
    with too few plans), c is b."""
    from autopar.cost.comm import allreduce_s, p2p_hop_s, p2p_s
    from autopar.cost.model import Config
    cluster = get_cluster("h100-eth100g")
    plans, prof, parts = _pipeline_plans(cluster)
    assert sum(1 for *_, pp in parts if pp > 0) >= 2
    measured = [1.1 * x + 0.9 * y + 0.4 * z for x, y, z in parts]
    trials = _trials(plans, measured)
    a, b, c = _abc(fit_scales(trials))
    assert (a, b, c) == pytest.approx((1.1, 0.9, 0.4), rel=1e-4)
    refit = refit_cluster(cluster, _scales(a, b, c), "test")
    assert refit.pipeline_p2p_scale == pytest.approx(c / b)
    cfg = Config.of_plan(plans[3])
    assert p2p_hop_s(prof, refit, cfg) == pytest.approx(c * p2p_hop_s(prof, cluster, cfg))
    assert p2p_s(refit, 5e5, False) == pytest.approx(b * p2p_s(cluster, 5e5, False))
    assert allreduce_s(refit, 5e5, 8, False) == pytest.approx(b * allreduce_s(cluster, 5e5, 8,
                                                                              False))
    _, b1, c1 = _abc(fit_scales(trials, separate_p2p=False))
    assert c1 == b1
    _, b2, c2 = _abc(fit_scales(trials[:4]))            # 4 plans: too few for three scales
    assert c2 == b2
    with pytest.raises(ValueError, match="pipeline_p2p_scale=0"):
        dataclasses.replace(cluster, pipeline_p2p_scale=0.0)


def test_pipeline_messages_fitted_below_the_floor_are_priced_nearly_hidden():
    """Where the plans with pipeline messages are over-priced by more than their messages,
    the unconstrained c is negative; the fit takes its bound, c = P2P_FLOOR (messages nearly
    all hidden behind compute), with a and b fitted again — not c = b, which leaves the
    pipeline plans over-priced (a larger total error). Not 0: the refitted cluster still
    prices a hop, so a second tune on it has the term to fit, and finds the messages' own
    scale again."""
    from autopar.cost.comm import p2p_hop_s
    from autopar.cost.model import Config
    from autopar.tune_fit import P2P_FLOOR
    cluster = get_cluster("h100-eth100g")
    plans, prof, parts = _pipeline_plans(cluster)
    measured = [1.1 * x + 0.9 * y - 0.3 * z for x, y, z in parts]
    trials = _trials(plans, measured)
    a, b, c = _abc(fit_scales(trials))
    assert c == P2P_FLOOR and a > 0 and b > 0

    def error(a, b, c):
        return sum(abs((a * x + b * y + c * z) / m - 1) for (x, y, z), m in zip(parts, measured))
    assert error(a, b, c) < error(*_abc(fit_scales(trials, separate_p2p=False)))
    refit = refit_cluster(cluster, _scales(a, b, c), "test")
    cfg = Config.of_plan(plans[3])                     # p = 2, t = 1: no all-gather
    assert p2p_hop_s(prof, refit, cfg) == pytest.approx(c * p2p_hop_s(prof, cluster, cfg))
    # a second tune on the refitted cluster, its messages measured at 0.4 of the first's
    again, _, parts2 = _pipeline_plans(refit)
    scale = 0.4 / P2P_FLOOR
    a2, b2, c2 = _abc(fit_scales(_trials(again, [x + y + scale * z for x, y, z in parts2])))
    assert (a2, b2, c2) == pytest.approx((1.0, 1.0, scale), rel=1e-3)


def _dispatching_plans():
    """Plans on a cluster that dispatches its ops eagerly (per-op host work priced), at
    micro-batch sizes 1 and 4 (so their dispatch shares differ), their profile, each one's
    `dispatch_seconds` and (kernels, dispatch, collectives + p2p) seconds."""
    from autopar.tune_fit import DISPATCH_WORK_S
    cluster = dataclasses.replace(get_cluster("h100-eth100g"), elementwise="eager",
                                  autograd_op_s=8e-6)
    prof = transformer_profile(num_layers=8, hidden=512, heads=8, seq_len=256, vocab=2000)

    def solve_pins(cl, pins):
        return solve(prof, cl, gpus=8, global_batch_size=32, **pins)
    plans = [solve_pins(cluster, dict(pins, micro_batch_size=b)) for pins in PINS
             for b in (1, 4)]
    coll = ("tp_comm_s", "dp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s")
    parts = []
    for pl in plans:
        h = dispatch_seconds(pl, cluster, solve_pins)
        comm = sum(getattr(pl.predicted, k) for k in coll)
        parts.append((pl.predicted.step_time_s - comm - h, h, comm))
    assert all(getattr(cluster, k) > 0 for k in DISPATCH_WORK_S[:2])
    return cluster, plans, parts, solve_pins


def test_the_host_dispatch_gets_its_own_scale_where_the_plans_tell_it_apart():
    """calibrate times the host's per-op work in isolation; inside a step it may cost several
    times that. Plans whose dispatch shares differ (micro-batches of 1 and 4 sequences) hold
    its scale apart from the kernels': compute ×1.1, dispatch ×3, collectives ×0.9 "measured"
    come back, the refitted cluster prices the dispatch 3× and every plan within 2%; plans
    dispatching alike (one micro-batch size) leave it the compute scale."""
    cluster, plans, parts, solve_pins = _dispatching_plans()
    assert all(h > 0 for _, h, _ in parts)
    measured = [1.1 * k + 3.0 * h + 0.9 * c for k, h, c in parts]
    trials = [Trial(plan=pl, measured_s=m, measured_memory_bytes=0.0, dispatch_s=h)
              for pl, m, (_, h, _) in zip(plans, measured, parts)]
    scales = fit_scales(trials)
    assert (scales.compute, scales.dispatch, scales.collectives) == pytest.approx(
        (1.1, 3.0, 0.9), rel=1e-3)
    refit = refit_cluster(cluster, scales, "test")
    assert refit.autograd_op_s == pytest.approx(3.0 * cluster.autograd_op_s)
    assert refit.kernel_launch_s == pytest.approx(3.0 * cluster.kernel_launch_s)
    for pl, m in zip(plans, measured):
        again = solve_pins(refit, plan_pins(pl)).predicted.step_time_s
        assert abs(again / m - 1) < 0.02, (plan_pins(pl), again, m)
    # measured with the dispatch on the kernels' scale, ±1% noise: a scale of its own would
    # lower the summed error by less than DISPATCH_GAIN, so it is the compute scale
    import random
    rng = random.Random(0)
    same = [dataclasses.replace(tr, measured_s=(1.1 * (k + h) + 0.9 * c) * (
        1 + rng.uniform(-0.01, 0.01))) for tr, (k, h, c) in zip(trials, parts)]
    noisy = fit_scales(same)
    assert noisy.dispatch == noisy.compute and noisy.compute == pytest.approx(1.1, rel=0.02)
    # every plan's dispatch the same share of its kernels: no direction of its own
    alike = fit_scales([dataclasses.replace(tr, dispatch_s=0.2 * k)
                        for tr, (k, _, _) in zip(trials, parts)])
    assert len(trials) >= 5 and alike.dispatch == alike.compute
    assert fit_scales(trials, separate_dispatch=False).dispatch == fit_scales(
        trials, separate_dispatch=False).compute


def _kind_plans():
    """Plans with tensor- and context-parallel collectives among data-parallel and pipeline
    ones, their `solve_pins`, and each one's (kernels, collectives, TP, CP, p2p) seconds as
    `fit_scales` splits them (`part_seconds`)."""
    from autopar.tune_fit import _columns, part_seconds
    cluster = get_cluster("h100-eth100g")
    prof = transformer_profile(num_layers=8, hidden=512, heads=8, seq_len=1024, vocab=2000)

    def solve_pins(cl, pins):
        return solve(prof, cl, gpus=8, global_batch_size=32, **{"micro_batch_size": 1, **pins})
    pins_list = PINS + (dict(c=2, d=4), dict(c=4, d=2), dict(t=2, c=2, d=2), dict(d=4, p=2))
    plans = [solve_pins(cluster, pins) for pins in pins_list]
    trials = [Trial(plan=pl, measured_s=1.0, measured_memory_bytes=0.0,
                    tp_s=part_seconds(pl, cluster, solve_pins, "tp"),
                    cp_s=part_seconds(pl, cluster, solve_pins, "cp")) for pl in plans]
    cols = _columns(trials)
    parts = list(zip(*(cols[k] for k in ("compute", "collectives", "tp", "cp", "p2p"))))
    return cluster, trials, parts, solve_pins


def test_tensor_and_context_parallel_collectives_get_their_own_scales():
    """Calibrate times collectives on idle ranks; inside a step TP's many small reductions and
    the context exchange each cost their own multiple of that. With compute ×1.1, other
    collectives ×0.9, TP ×1.6 and CP ×0.6 "measured", the four come back, the refitted cluster
    prices every plan within 2% (its tp_comm_scale and cp_comm_scale take the kinds' scales
    over the links' 0.9); measured with both on the collectives' scale (±1% noise), they
    stay on it; `separate_kinds=False` keeps them there."""
    import random
    cluster, trials, parts, solve_pins = _kind_plans()
    assert sum(1 for p in parts if p[2] > 0) >= 2 and sum(1 for p in parts if p[3] > 0) >= 2
    # each plan's parts add up to its step: the kind columns are taken out of the others
    for tr, p in zip(trials, parts):
        assert sum(p) == pytest.approx(tr.plan.predicted.step_time_s, rel=1e-9)
    measured = [1.1 * k + 0.9 * (c + z) + 1.6 * tp + 0.6 * cp for k, c, tp, cp, z in parts]
    fitted = fit_scales([dataclasses.replace(tr, measured_s=m)
                         for tr, m in zip(trials, measured)])
    assert (fitted.compute, fitted.collectives, fitted.tp, fitted.cp) == pytest.approx(
        (1.1, 0.9, 1.6, 0.6), rel=1e-3)
    assert "tensor-parallel ×1.60" in str(fitted) and "context-parallel ×0.60" in str(fitted)
    refit = refit_cluster(cluster, fitted, "test")
    assert refit.tp_comm_scale == pytest.approx(1.6 / 0.9, rel=1e-3)
    assert refit.cp_comm_scale == pytest.approx(0.6 / 0.9, rel=1e-3)
    for tr, m in zip(trials, measured):
        again = solve_pins(refit, plan_pins(tr.plan)).predicted.step_time_s
        assert abs(again / m - 1) < 0.02, (plan_pins(tr.plan), again, m)
    rng = random.Random(0)
    alike = [dataclasses.replace(tr, measured_s=(1.1 * k + 0.9 * (c + z + tp + cp)) * (
        1 + rng.uniform(-0.01, 0.01))) for tr, (k, c, tp, cp, z) in zip(trials, parts)]
    noisy = fit_scales(alike)
    assert noisy.tp == noisy.collectives and noisy.cp == noisy.collectives
    assert noisy.collectives == pytest.approx(0.9, rel=0.05)
    assert str(noisy).count("parallel") == 0
    kept = fit_scales([dataclasses.replace(tr, measured_s=m) for tr, m in zip(trials, measured)],
                      separate_kinds=False)
    assert kept.tp == kept.collectives == kept.cp


def test_kind_scales_price_every_collective_of_their_kind():
    """tp_comm_scale multiplies every TP collective a step prices (the blocks', the edges'),
    cp_comm_scale the context exchange; 0 prices them free (tune's `part_seconds`); a
    negative scale is one line."""
    from autopar.cost.exchanges import context_comm_s
    from autopar.cost.model import Config
    cluster, trials, parts, solve_pins = _kind_plans()
    plan = next(tr.plan for tr in trials if tr.plan.t > 1 and tr.plan.c > 1)
    cfg = Config.of_plan(plan)
    prof = transformer_profile(num_layers=8, hidden=512, heads=8, seq_len=1024, vocab=2000)
    from autopar.cost.context import context_rank_profile
    rank = context_rank_profile(prof, cfg.c, cfg.cp_attention)
    fwd, total = context_comm_s(rank, cluster, cfg)
    twice = dataclasses.replace(cluster, cp_comm_scale=2.0)
    assert context_comm_s(rank, twice, cfg) == pytest.approx((2 * fwd, 2 * total))
    step = plan.predicted.step_time_s
    free_tp = solve_pins(dataclasses.replace(cluster, tp_comm_scale=0.0), plan_pins(plan))
    assert free_tp.predicted.tp_comm_s == 0 and free_tp.predicted.step_time_s < step
    with pytest.raises(ValueError, match=r"tp_comm_scale=-1.0: must be >= 0"):
        dataclasses.replace(cluster, tp_comm_scale=-1.0)


def test_candidates_measured_in_passes_of_opposite_order_keep_their_least_time(monkeypatch):
    """measure_candidates one at a time over two passes: compiled in the order 0, 1, 2 then
    2, 1, 0, each released before the next; a candidate's time is its least over the passes
    (a slow spell of the host during one pass does not decide), its memory the first pass's;
    then the contenders (within CONTENDER_MARGIN of the fastest) in two passes more."""
    import gc

    from autopar.tuning import measure_candidates
    # a collection after each released candidate walks the whole test process (~1.5 s each
    # late in the suite); these fake runs leave nothing to collect
    monkeypatch.setattr(gc, "collect", lambda *args: 0)
    times = {(0, 0): 0.30, (1, 0): 0.20, (2, 0): 0.50, (0, 1): 0.10, (1, 1): 0.25,
             (2, 1): 0.40}
    order, released = [], []

    class Run:
        def __init__(self, i, k):
            self.i, self.k = i, k
            self.runner = self

        def time_round(self, steps, warmup):
            return times[(self.i, self.k)]

        def memory_bytes(self):
            return 1000.0 * (self.i + 1) + self.k

        def release_groups(self):
            released.append(self.i)

    def compiled(i, plan):
        order.append(i)
        return Run(i, min(2, (len(order) - 1) // 3))
    out = measure_candidates(["a", "b", "c"], compiled, steps=1, warmup=0, rounds=1,
                             interleaved=False, log=lambda line: None, passes=2)
    # then the contenders (within CONTENDER_MARGIN of the fastest, 0.10): none but candidate
    # 0 itself, so nothing more is measured
    assert order == [0, 1, 2, 2, 1, 0] and released == order
    assert out == [(0.10, 1000.0), (0.20, 2000.0), (0.40, 3000.0)]
    times.update({(0, 1): 0.21, (1, 1): 0.20, (0, 2): 0.19, (1, 2): 0.18, (2, 2): 0.45})
    order.clear(), released.clear()
    out = measure_candidates(["a", "b", "c"], compiled, steps=1, warmup=0, rounds=1,
                             interleaved=False, log=lambda line: None, passes=2)
    # 0 (0.21) and 1 (0.20) are contenders, 2 (0.40) is not: two passes more over 0 and 1
    assert order == [0, 1, 2, 2, 1, 0, 0, 1, 1, 0], order
    assert out == [(0.19, 1000.0), (0.18, 2000.0), (0.40, 3000.0)]
    one = measure_candidates(["a", "b", "c"], compiled, steps=1, warmup=0, rounds=1,
                             interleaved=False, log=lambda line: None)
    assert len(one) == 3 and order[10:] == [0, 1, 2]


def test_a_kind_scale_that_fits_only_its_plans_noise_is_not_taken():
    """Two tensor-parallel plans measured 20% and 5% over the scales every other plan fits
    exactly: a TP scale of their own lowers the fitted plans' summed error by more than
    DISPATCH_GAIN (it fits one of them), but priced from the other plan each is off again —
    the held-out error is not lower, so TP stays on the collectives' scale. With both 20%
    over (a real TP cost), it is taken."""
    import numpy as np
    from autopar.tune_fit import DISPATCH_GAIN, _fit_error, _kinds_apart, _richest_fit
    rng = np.random.default_rng(0)
    n = 10
    cols = {"compute": rng.uniform(0.05, 0.1, n), "dispatch": np.zeros(n),
            "collectives": rng.uniform(0.005, 0.02, n), "p2p": np.zeros(n),
            "tp": np.zeros(n), "cp": np.zeros(n)}
    cols["tp"][:2] = [0.03, 0.04]
    exact = 1.1 * cols["compute"] + 0.9 * (cols["collectives"] + cols["tp"])

    def kinds(over):
        meas = exact.copy()
        meas[:2] *= over
        base = _richest_fit(cols, meas, False, False, (), 50)
        return base, _kinds_apart(cols, meas, base, False, False, ["tp"], 50), meas
    base, fitted, meas = kinds(np.array([1.2, 1.05]))
    alone = _richest_fit(cols, meas, False, False, ("tp",), 50)
    assert _fit_error(cols, meas, alone) < (1 - DISPATCH_GAIN) * _fit_error(cols, meas, base)
    assert fitted == base and fitted["tp"] == fitted["collectives"]
    _, fitted, _ = kinds(np.array([1.2, 1.2]))
    assert fitted["tp"] > 1.5 * fitted["collectives"]


def test_a_bad_passes_count_is_one_line(capsys):
    from autopar.cli import main as cli_main
    from autopar.tuning import tune
    assert cli_main(["tune", "model.py:factory", "--gpus", "2", "--passes", "0"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--passes 0: must be >= 1" in err, err
    with pytest.raises(ValueError, match=r"passes=0: must be an int >= 1"):
        tune(lambda: None, gpus=1, example_inputs=(), global_batch_size=1, passes=0)


def test_plans_measured_far_slower_than_the_refit_prices_them_are_measured_again():
    """`suspects`: a plan measured slower than its refit price by more than twice the median
    |refit error| (and 3%) is measured again; one measured faster, or without a refit price,
    is not (noise only adds time); where every plan fits within the floor, none is."""
    from autopar.tune_fit import suspects
    plan = _plans(get_cluster("h100-eth100g"), (dict(d=8),))[0][0]

    def trials(errors):
        return [Trial(plan=plan, measured_s=1.0, measured_memory_bytes=0.0,
                      refit_s=None if e is None else 1.0 / (1.0 + e)) for e in errors]
    # |errors| 0.01 0.02 0.015 0.2 0.3: median 0.02, the bar 2 x 0.02 = 0.04
    assert suspects(trials([0.01, -0.02, 0.015, 0.2, -0.3, None])) == [3]
    assert suspects(trials([0.001, 0.002, 0.025, None])) == []     # below the 3% floor
    assert suspects(trials([0.05, 0.0])) == []     # two plans: neither exceeds twice their mean
    assert suspects(trials([None, None])) == []

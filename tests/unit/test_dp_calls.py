"""Data-parallel collectives priced per call (cost/dp_terms.py): a layer's share of the call
that holds it, and every call's latency beyond one where nothing overlaps it. Pure: the cost
model on a profile, a preset and a CPU-like cluster with a measured curve."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autopar.cost.comm import allreduce_s
from autopar.cost.config import Config
from autopar.cost.dp_terms import (GradGroup, _layer_sync_s, calls_latency_s,
                                    grad_bucket_calls, grad_reduce_bytes, step_scalars_s)
from autopar.cost.hardware import CollectiveCurve, get_cluster
from autopar.cost.model import config_costs, predict
from autopar.cost.profile import transformer_profile
from autopar.cost.shares import RankParams, rank_params

LAT = 5e-4
PROF = transformer_profile(num_layers=8, hidden=64, heads=4, seq_len=64, vocab=512)


def _curved(overlap: float):
    """2 CPU ranks as calibrate measures them: a small call costs far more than its bytes
    (a 200 KB all-reduce 1.5 ms, ten times its bytes 3 ms), nothing overlaps."""
    curves = tuple(CollectiveCurve(link=link, kind=kind, ranks=2, bytes=(8.0, 2e5, 2e6, 2e7),
                                   seconds=(LAT, 1.5e-3, 3e-3, 1.5e-2))
                   for link in ("intra", "inter")
                   for kind in ("all_reduce", "all_gather", "reduce_scatter"))
    return replace(get_cluster("local-cpu"), collective_curves=curves, comm_overlap=overlap,
                   intra_node_latency_s=LAT, inter_node_latency_s=LAT)


def _cfg(v: int, zero: int = 0, m: int = 1) -> Config:
    return Config(t=1, p=1, d=2, v=v, micro_batch_size=8 // m, num_microbatches=m,
                  schedule="breadth-first" if v > 1 else "1f1b", zero=zero)


def test_one_bucket_is_priced_as_one_call_not_one_per_layer():
    """1F1B reduces the rank's eight layers in one bucket: their gradients are priced as the
    curve's call of all of them, not eight small calls (8 × 1.5 ms against ~3 ms)."""
    cl = _curved(0.0)
    cfg = _cfg(1)
    cc = config_costs(PROF, cl, cfg)
    block_bytes = rank_params(PROF, cfg).block * grad_reduce_bytes(PROF)
    whole = allreduce_s(cl, 8 * block_bytes, 2, False) - LAT
    assert cc.dp_layer_ns * 8 / 1e9 == pytest.approx(whole, rel=1e-3)
    assert whole < 8 * (allreduce_s(cl, block_bytes, 2, False) - LAT) / 2
    # one call: its latency in the edges; on every rank only the step's scalar all-reduces
    assert cc.dp_rank_ns == pytest.approx(step_scalars_s(cl, cfg) * 1e9, abs=1)


@pytest.mark.parametrize("zero,calls", [(0, 8), (1, 16), (2, 16)])
def test_each_call_of_breadth_first_pays_its_latency_where_nothing_overlaps(zero, calls):
    """Breadth-first with eight one-layer chunks: a reduction a chunk (ZeRO-1 its weights'
    all-gather too; ZeRO-2 a gather and a reduce-scatter a chunk, the plan's counts): every
    call's latency beyond one is on the tail, and the step is priced above 1F1B's at the
    same ZeRO level (measured on 2 CPU ranks: +3–5 ms of ~36 at ZeRO-0, +10 ms at ZeRO-2).
    Where collectives overlap compute (a GPU: comm_overlap 1) the latency hides."""
    cl = _curved(0.0)
    bf = config_costs(PROF, cl, _cfg(8, zero))
    scalars = step_scalars_s(cl, _cfg(8, zero))
    assert bf.dp_rank_ns == pytest.approx(((calls - 1) * LAT + scalars) * 1e9, abs=1)
    assert predict(PROF, cl, _cfg(8, zero)).step_time_s > \
        predict(PROF, cl, _cfg(1, zero)).step_time_s
    assert config_costs(PROF, _curved(1.0), _cfg(8, zero)).dp_rank_ns == pytest.approx(
        step_scalars_s(_curved(1.0), _cfg(8, zero)) * 1e9, abs=1)
    assert calls_latency_s(cl, calls, LAT) == pytest.approx((calls - 1) * LAT)


def test_a_linear_link_prices_a_layer_alike_in_any_call():
    """On a preset's link (latency + bytes / bandwidth) a layer's share of a call of k layers
    is its bandwidth time whatever k: the presets' prices do not move."""
    a100 = get_cluster("dgx-a100-80gb")
    params = rank_params(PROF, _cfg(1))
    grp = GradGroup(cluster=a100, size=64, inter=True, sharded_optimizer=False)
    one = _layer_sync_s(grp, None, params)
    for k in (2.0, 8.0, 0.5):
        assert _layer_sync_s(grp, None, params, per_call=k) == pytest.approx(one, rel=1e-9)


def test_every_rank_pays_the_steps_scalar_all_reduces():
    """The runtime all-reduces the loss over the pipeline group (p > 1) and over the c·d
    replicas, and the counted tokens over the replicas, each blocking: every rank's tail pays
    them at the link's price of 8 bytes (on 2 gloo CPU ranks ~0.5 ms each, ~1 ms of a 4-layer
    GPT's d = 2 step, unpriced before); one rank, or t alone, has none."""
    cl = _curved(0.0)
    one = allreduce_s(cl, 8, 2, False)
    for (t, p, d), calls in (((1, 1, 2), 2), ((1, 2, 1), 1), ((2, 1, 1), 0), ((1, 1, 1), 0)):
        cfg = Config(t=t, p=p, d=d, num_microbatches=2)
        assert step_scalars_s(cl, cfg) == pytest.approx(calls * one), (t, p, d)
    assert one > 4e-4                                     # gloo's scalar on the curve


def _runtime_buckets(layers: int, v: int, layer_elems: int, emb: int, head: int) -> int:
    """The buckets autopar.runtime.data_parallel.GradSync builds for a rank's fp32 gradients:
    `v` chunks of layers / v layers (each layer four tensors), the embedding in the first
    chunk, the head in the last (its bucket builder alone: no process group)."""
    from autopar.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradSync
    per = layers // v
    chunks = []
    for c in range(v):
        ts = [torch.empty(layer_elems // 4, device="meta") for _ in range(4 * per)]
        chunks.append(([torch.empty(emb, device="meta")] if c == 0 and emb else []) + ts
                      + ([torch.empty(head, device="meta")] if c == v - 1 and head else []))
    sync = GradSync.__new__(GradSync)
    sync.bucket_bytes, sync._where, sync.buckets = DEFAULT_BUCKET_BYTES, {}, []
    sync._build_buckets(chunks)
    return len(sync.buckets)


@pytest.mark.parametrize("layers,v,layer_elems,emb,head", [
    (4, 1, 200_000, 65_536, 0),          # the 4-layer GPT at width 128: 3.5 MB, 2 buckets
    (4, 1, 50_000, 32_768, 0),           # width 64: under 1 MiB, 1 bucket
    (8, 2, 1_600_000, 1_000_000, 1_000_000),
    (12, 1, 3_000_000, 8_000_000, 8_000_000),
    (8, 8, 100_000, 0, 50_000),          # breadth-first's one-layer chunks: one a chunk
    (6, 3, 400_000, 2_000_000, 100_000),
    (2, 1, 10_000, 500, 300_000)])
def test_zero0_calls_are_the_buckets_the_runtime_builds(layers, v, layer_elems, emb, head):
    """ZeRO-0's all-reduces a step are GradSync's buckets (DDP's: the first at most 1 MiB,
    the rest 25 MiB, never across a chunk), counted as the runtime builds them; the cost
    model's constants are the runtime's. Each call past the first is a latency on a CPU."""
    from autopar.cost.dp_terms import BUCKET_BYTES, FIRST_BUCKET_BYTES
    from autopar.runtime import data_parallel as rt
    assert (FIRST_BUCKET_BYTES, BUCKET_BYTES) == (rt.FIRST_BUCKET_BYTES, rt.DEFAULT_BUCKET_BYTES)
    params = RankParams(block=layer_elems, embedding=emb, head=head)
    assert grad_bucket_calls(params, layers, v, 4) == _runtime_buckets(layers, v, layer_elems,
                                                                       emb, head)

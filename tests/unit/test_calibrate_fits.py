"""`autopar calibrate`'s fits (cost/calibrate.py): pure functions recover the constants that
generated synthetic timings, and ranks are grouped into links by node."""
from __future__ import annotations

import pytest

from autopar.cost.calibrate import COLLECTIVES, fit_flash, fit_gemm, fit_link, link_groups


def test_fit_link_recovers_latency_and_bandwidth():
    lat, bw = 40e-6, 2e9
    factor = {"all_reduce": 1.0, "send_recv": 1.0}   # n = 2: 2(n-1)/n = 1 and 1
    factor.update({name: 0.5 for name in COLLECTIVES if name not in factor})
    rows = {name: [[b, 2, lat + factor[name] * b / bw] for b in (1024, 1 << 16, 1 << 22)]
            for name in COLLECTIVES}
    got_lat, got_bw = fit_link(rows)
    assert got_lat == pytest.approx(lat, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6)


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


def test_ranks_are_grouped_into_links_by_node():
    # 2 nodes of 3 ranks: intra = each node's ranks, inter = the i-th rank of every node
    assert link_groups([0, 0, 0, 1, 1, 1]) == {"intra": [[0, 1, 2], [3, 4, 5]],
                                               "inter": [[0, 3], [1, 4], [2, 5]]}
    assert link_groups([0, 1]) == {"intra": [], "inter": [[0, 1]]}    # one rank per node
    assert link_groups([0, 0]) == {"intra": [[0, 1]], "inter": []}    # one machine

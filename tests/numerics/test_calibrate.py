"""`autopar calibrate` under two launchers on localhost (torchrun --nnodes=2, one process each,
a static rendezvous): the cluster file it writes holds inter-node numbers measured between the
two "nodes", and says what was measured, where and when."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autopar.cost.hardware import read_cluster_file
from autopar.testing import free_port


def _outputs(procs: list, timeout_s: float) -> list[str]:
    """Each launcher's output; past `timeout_s` every launcher is killed and the test fails
    with what each had printed (a run timed out once, 2026-11-27, with nothing to read)."""
    try:
        return [p.communicate(timeout=timeout_s)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [p.communicate()[0][-3000:] for p in procs]
        pytest.fail(f"calibrate under two launchers ran past {timeout_s} s; their output:"
                    + "".join(f"\n--- node {i} ---\n{t}" for i, t in enumerate(tails)))


@pytest.mark.distributed
def test_calibrate_under_two_launchers_measures_the_inter_node_link(tmp_path):
    out, port = tmp_path / "two-nodes.json", free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
         "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
         "-m", "autopar.cli", "calibrate", "--quick", "--name", "two-nodes", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    logs = _outputs(procs, timeout_s=240)
    assert [p.returncode for p in procs] == [0, 0], logs
    assert f"wrote {out}" in logs[0]
    cluster, record = read_cluster_file(out)
    assert cluster.name == "two-nodes" and cluster.gpus_per_node == 1
    assert record["nodes"] == 2 and record["world"] == 2 and record["backend"] == "gloo"
    assert "T" in record["measured_at"] and record["hosts"]
    assert set(record["collectives"]) == {"inter"}        # the only link with two ranks
    for name, rows in record["collectives"]["inter"].items():
        assert rows and all(seconds > 0 for _, _, seconds in rows), name
    lat, bw = record["fits"]["inter"]["latency_s"], record["fits"]["inter"]["bandwidth_Bps"]
    assert (cluster.inter_node_latency_s, cluster.inter_node_bandwidth_Bps) == (lat, bw)
    assert 0 <= lat < 0.5 and 1e5 < bw < 1e12
    assert any(s.startswith("inter_node") and "fitted" in s for s in cluster.sources)
    assert any(s.startswith("intra_node") and "not measured" in s for s in cluster.sources)
    assert 1e7 < cluster.peak_flops < 1e14 and cluster.hbm_bandwidth_Bps > 1e7
    # every collective's curve on the measured link (the unmeasured intra link takes them),
    # and the constants measured beyond the presets'
    kinds = {(c.link, c.kind) for c in cluster.collective_curves}
    assert {(link, kind) for link in ("inter", "intra")
            for kind in record["collectives"]["inter"]} == kinds
    assert 0 <= cluster.comm_overlap <= 1 and cluster.tp_row_pieces == 4
    assert cluster.optimizer_param_s > 0 and cluster.autograd_op_s > 0
    # timed in a fresh process on a CPU, per byte the profile counts saved
    assert cluster.split_backward_frac == 0 and 0 <= cluster.split_backward_s_per_byte < 1e-8
    # recompute op's selective checkpoint, where this torch runs op (0: not measured)
    from autopar.passes.recompute import op_mode_refusal
    assert (cluster.checkpoint_op_s > 0) == (op_mode_refusal() is None)
    # torch.utils.checkpoint's own work per region: host microseconds, not milliseconds
    assert 1e-6 < cluster.checkpoint_region_s < 5e-3

"""Cluster files (cost/hardware.py): every field round-trips, planning with a file equals
planning with the Cluster, a bad file gets one line naming the field, the rule and the fix;
`autopar clusters` lists the presets; hardware reads the file without the calibration harness."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from autopar.cli import main as cli_main
from autopar.cost.hardware import (CLUSTER_NAMES, Cluster, cluster_from_dict, cluster_to_dict,
                                   get_cluster, load_cluster, read_cluster_file, save_cluster)
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve


@pytest.mark.parametrize("name", CLUSTER_NAMES)
def test_every_preset_round_trips_through_a_file(name, tmp_path):
    cluster = get_cluster(name)
    data = cluster_to_dict(cluster)
    assert list(data) == [f.name for f in dataclasses.fields(Cluster)]   # every field
    assert data["sources"] and all(isinstance(s, str) for s in data["sources"])
    path = save_cluster(cluster, tmp_path / "c.json", calibration={"host": "here"})
    assert load_cluster(path) == cluster
    assert read_cluster_file(path)[1] == {"host": "here"}
    assert get_cluster(str(path)) == cluster


def test_new_presets_say_what_is_not_fitted():
    nvl = get_cluster("gb200-nvl72")
    assert nvl.gpus_per_node == 72   # the NVLink domain is the planner's node
    assert get_cluster("mi300x-192gb").gpus_per_node == 8
    eth = get_cluster("h100-eth100g")
    assert eth.inter_node_bandwidth_Bps < get_cluster("dgx-h100-80gb").inter_node_bandwidth_Bps / 3
    for name in ("hgx-b200-180gb", "gb200-nvl72", "mi300x-192gb"):
        assert any("not fitted" in s for s in get_cluster(name).sources), name


def test_planning_with_a_file_equals_planning_with_the_cluster(tmp_path):
    prof = transformer_profile(num_layers=4, hidden=256, heads=4, seq_len=128, vocab=1000)
    cluster = dataclasses.replace(get_cluster("h100-eth100g"), name="my-cluster")
    path = save_cluster(cluster, tmp_path / "my.json")
    by_file = solve(prof, str(path), gpus=16, global_batch_size=64)
    assert by_file == solve(prof, cluster, gpus=16, global_batch_size=64)
    assert by_file.cluster == "my-cluster"


def _bad(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ValueError) as err:
        load_cluster(path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text, text
    return text


def test_a_bad_file_names_the_field_the_rule_and_the_fix(tmp_path):
    good = cluster_to_dict(get_cluster("dgx-a100-80gb"))
    missing = {k: v for k, v in good.items() if k != "peak_flops"}
    assert "'peak_flops' is missing" in _bad(tmp_path, missing)
    assert "must be a finite number >= 0" in _bad(
        tmp_path, {**good, "inter_node_bandwidth_Bps": -1e9})
    assert "inter_node_bandwidth_Bps" in _bad(tmp_path, {**good, "inter_node_bandwidth_Bps": -1})
    text = _bad(tmp_path, {**good, "attention": "sparse"})
    assert "Cluster.attention='sparse'" in text and "'flash'" in text
    assert "not JSON" in _bad(tmp_path, "{\"name\": ")
    assert "'peak_tflops' is not a Cluster field" in _bad(tmp_path, {**good, "peak_tflops": 1})
    assert "must be a number" in _bad(tmp_path, {**good, "peak_flops": "fast"})
    assert "must be positive" in _bad(tmp_path, {**good, "gpus_per_node": 0})
    assert "one JSON object" in _bad(tmp_path, [good])
    # a Cluster built in Python is held to the same: seconds per op never negative
    with pytest.raises(ValueError, match=r"split_backward_op_s=-1e-06: must be >= 0"):
        dataclasses.replace(get_cluster("local-cpu"), split_backward_op_s=-1e-6)
    # fields with a default may be left out of a hand-written file
    short = {k: v for k, v in good.items() if k not in ("kernel_launch_s", "sources")}
    assert cluster_from_dict(short).kernel_launch_s == Cluster.__dataclass_fields__[
        "kernel_launch_s"].default


def test_cli_lists_clusters_and_plans_with_a_file(tmp_path, capsys):
    assert cli_main(["clusters"]) == 0
    out = capsys.readouterr().out
    for name in CLUSTER_NAMES:
        assert name in out
    path = save_cluster(get_cluster("mi300x-192gb"), tmp_path / "mi.json")
    assert cli_main(["clusters", "-v", str(path)]) == 0
    assert "MI300X datasheet" in capsys.readouterr().out
    assert cli_main(["plan", "gpt-1.7b", "--gpus", "8", "--batch", "16", "--seq", "256",
                     "--cluster", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "mi300x-192gb"
    (tmp_path / "broken.json").write_text("[]")
    assert cli_main(["plan", "gpt-1.7b", "--gpus", "8",
                     "--cluster", str(tmp_path / "broken.json")]) == 2
    assert "one JSON object" in capsys.readouterr().err


def test_hardware_reads_the_cluster_file_without_the_calibration_harness():
    code = ("import sys, autopar.cost.hardware as h\n"
            "h.get_cluster('local-cpu')\n"
            "print(sorted(m for m in sys.modules if m in ('autopar.cost.calibrate', "
            "'autopar.testing')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_local_cpu_is_the_file_calibrate_wrote(tmp_path, monkeypatch):
    target = tmp_path / "local-cpu.json"
    monkeypatch.setenv("AUTOPAR_CACHE", str(target))
    default = get_cluster("local-cpu")
    assert any("not run" in s for s in default.sources)   # nothing written yet: defaults
    measured = dataclasses.replace(default, name="this-machine", peak_flops=1.25e11,
                                   sources=("measured by `autopar calibrate` (test)",))
    save_cluster(measured, target)
    assert get_cluster("local-cpu") == dataclasses.replace(measured, name="local-cpu")
    target.write_text('{"matmul_flops_per_s": 1.0}')    # a file from before cluster files
    assert get_cluster("local-cpu") == default

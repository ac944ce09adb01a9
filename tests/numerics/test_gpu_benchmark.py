"""benchmarks/gpu.py's plumbing on CPU (issue 36 Part 1): the call a lent GPU runs, tiny.

The plans are prepared where the solver is; the run then works without ortools (the GPU
image has none), on one process (a group of one) and on gloo ranks sharing one device
(`compile(device=...)`), and writes its JSON and text table. The same script on CUDA is the
GPU test, skipped here with its reason.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
CASES = "single-gpt,multirank-t2,memory-none-mb2,checkpoint-gpt"
PARTS = "single:single-gpt,multirank,calibrate,memory,checkpoint"
# the GPU image has no ortools: block it, so a solver import on the run's path fails here too
NO_ORTOOLS = ("import sys, runpy; sys.modules['ortools'] = None; sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")


def _script():
    """benchmarks/gpu.py as a module of this process (where the solver is: `prepare` and the
    argument checks need no interpreter of their own)."""
    if "autopar_gpu_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("autopar_gpu_benchmark", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module   # its dataclasses look their module up while defined
        spec.loader.exec_module(module)
    return sys.modules["autopar_gpu_benchmark"]


def _run(args: list[str], block_ortools: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable] + (["-c", NO_ORTOOLS] if block_ortools else []) + [str(SCRIPT)]
    out = subprocess.run(cmd + args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_gpu_benchmark_plumbing_on_cpu(tmp_path):
    plans, results = tmp_path / "plans", tmp_path / "out"
    assert _script().main(["prepare", "--device", "cpu", "--quick", "--dir", str(plans),
                           "--cases", CASES]) == 0
    assert sorted(p.name for p in plans.glob("*.json")) == sorted(
        [f"{c}.json" for c in CASES.split(",")] + ["manifest.json"])
    out = _run(["run", "--device", "cpu", "--quick", "--dir", str(plans), "--out",
                str(results), "--parts", PARTS], block_ortools=True)
    got = json.loads((results / "gpu_results.json").read_text())
    rows = {(r["case"], r["variant"]): r for part in got["parts"].values() for r in part}
    failed = {k: r["error"] for k, r in rows.items() if "error" in r}
    assert not failed, failed
    eager = rows[("single-gpt", "autopar eager")]
    plain = rows[("single-gpt", "plain eager")]
    assert eager["step_s"] > 0 and 0 < eager["mfu"] < 1
    assert eager["ratio_vs"]["plain eager"] == pytest.approx(plain["step_s"] / eager["step_s"])
    # autopar's program trains the model the plain loop trains: the same first loss
    assert eager["losses"][0] == pytest.approx(plain["losses"][0], rel=2e-2)
    t2 = rows[("multirank-t2", "gloo ranks sharing cpu")]
    assert t2["equal"] and t2["max_rel_diff"] <= 1e-4
    mem = rows[("memory-none-mb2", "recompute=none mb=2")]
    assert mem["measured_peak_bytes"] > mem["measured_static_bytes"] > 0
    assert mem["predicted_activation_bytes"] > 0
    ckpt = rows[("checkpoint-gpt", "sync vs async save")]
    assert ckpt["bytes_written"] > 0 and ckpt["sync_save_s"] > 0 and len(ckpt["trials"]) == 2
    cal = rows[("calibrate", next(k[1] for k in rows if k[0] == "calibrate"))]
    assert cal["rc"] == 0 and cal["against_preset"]["gemm_max_efficiency"]["measured"] > 0
    text = (results / "gpu_results.txt").read_text()
    assert "[multirank]" in text and "EQUAL to one device" in text
    assert text.strip().splitlines()[-1] in out.stdout


def test_gpu_benchmark_refuses_bad_input(capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["run", "--parts", "single,gpuz", "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--parts 'gpuz': not a part; pick from" in err.strip().splitlines()[-1]
    with pytest.raises(ValueError, match="'single-gpz' is not a prepared single case"):
        _script().part_steps(("single:single-gpz",), {"single-gpt": None})


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here: benchmarks/gpu.py runs on a lent GPU "
                           "(python benchmarks/gpu.py all --quick on the GPU machine)")
def test_gpu_benchmark_quick_on_cuda(tmp_path):
    _run(["all", "--device", "cuda", "--quick", "--dir", str(tmp_path / "p"), "--out",
          str(tmp_path / "o"), "--parts", "single,multirank,memory"])
    got = json.loads((tmp_path / "o" / "gpu_results.json").read_text())
    assert got["parts"]["single"]

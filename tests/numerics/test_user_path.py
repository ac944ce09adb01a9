"""The path a user walks, on CPU ranks from a fresh directory: a `transformers` model file →
`autopar build` → `torchrun launch.py --data tokens.bin` on 4 ranks, checkpointing every step →
one rank killed mid-run → the job relaunched on 2 ranks (launch.py re-plans for 2 with the same
global batch and resumes from the checkpoint, resharded, at the data position it stopped at) →
the weights of an uninterrupted single-device run on the same data."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from autopar.cli import main as cli_main
from autopar.data import BatchShape, TokenFile, TokenFileBatches
from autopar.factory import load_factory
from autopar.plan import Plan

from reference import train, weight_mismatches

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MODEL_FILE = '''
from transformers import LlamaConfig, LlamaForCausalLM

def factory():
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16, use_cache=False)
    return LlamaForCausalLM(config)
'''
STEPS, LR = 8, 1e-3
TRAIN = ["--data", "tokens.bin", "--steps", str(STEPS), "--checkpoint", "ckpt", "--save-every", "1",
         "--lr", str(LR)]


def _run(cmd: list[str], cwd: Path, env: dict, timeout_s: float) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout_s)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout[-4000:]}\n" \
                                f"{out.stderr[-6000:]}"
    return out.stdout


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "prog/launch.py"]


def _worker_pids(job: str, local_rank: int) -> list[int]:
    """The worker processes of the torchrun job tagged `job` with this LOCAL_RANK."""
    want = {f"AUTOPAR_TEST_JOB={job}".encode(), f"LOCAL_RANK={local_rank}".encode()}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:       # gone, or not ours
            continue
        if want <= env:
            pids.append(int(entry.name))
    return pids


def _kill_one_rank_after_first_checkpoint(cmd: list[str], cwd: Path, env: dict) -> str:
    """Start the 4-rank job, SIGKILL local rank 3 once a checkpoint is committed; the log."""
    job = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, cwd=cwd, env=dict(env, AUTOPAR_TEST_JOB=job),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, killed = time.monotonic() + 400, []
    try:
        while proc.poll() is None and time.monotonic() < deadline and not killed:
            if (cwd / "ckpt").is_symlink():         # committed: the link is made last
                for pid in _worker_pids(job, 3):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)
        log = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed, f"no rank was killed (exit {proc.returncode}):\n{log[-4000:]}"
    assert proc.returncode != 0, log[-4000:]           # torchrun reports the lost worker
    return log


def _reference(tmp_path: Path, plan: Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    """launch.py's loop on one device: the factory's model after torch.manual_seed(0), AdamW
    (lr LR, weight decay 0.01), clipping at 1.0, the whole global batch of the token file."""
    torch.manual_seed(0)
    user = load_factory(f"{tmp_path / 'my_model.py'}:factory")
    data = TokenFileBatches(TokenFile(tmp_path / "tokens.bin", dtype="uint16", vocab_size=96),
                            BatchShape(global_batch_size=plan.global_batch_size,
                                       seq_len=plan.seq_len))
    ref = train(user.model, (data.next() for _ in range(STEPS)),
                lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01),
                loss_fn=user.loss(), max_grad_norm=1.0)
    return ref.losses, ref.state, ref.init


def test_transformers_model_build_train_kill_resume_on_fewer_ranks(tmp_path):
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    np.random.default_rng(0).integers(0, 96, 50_000).astype(np.uint16).tofile(
        tmp_path / "tokens.bin")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                           os.environ.get("PYTHONPATH", "")]))
    _run([sys.executable, "-m", "autopar.cli", "build", "my_model.py:factory", "--gpus", "4",
          "--batch", "8", "--seq", "16", "--cluster", "local-cpu", "--out", "prog"],
         tmp_path, env, 400)
    plan = Plan.from_json((tmp_path / "prog" / "plan.json").read_text())
    assert plan.gpus == 4 and plan.global_batch_size == 8

    first = _kill_one_rank_after_first_checkpoint(_torchrun(4) + TRAIN, tmp_path, env)
    assert re.search(r"^step +0/8  loss \d", first, re.M), first[-2000:]

    log = _run(_torchrun(2) + TRAIN + ["--export", "weights.pt", "--losses-out", "losses.json",
                                       "--metrics", "metrics.jsonl"], tmp_path, env, 400)
    assert "re-planned for 2 with the same global batch 8" in log, log[-4000:]
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got["world"] == 2 and 0 < got["start"] < STEPS, got   # resumed mid-run

    _check_metrics(tmp_path / "metrics.jsonl", got, log)
    ref_losses, ref_state, ref_init = _reference(tmp_path, plan)
    # the resumed steps see the batches the uninterrupted run saw at those steps
    torch.testing.assert_close(got["losses"], ref_losses[got["start"]:], rtol=1e-4, atol=1e-5)
    state = torch.load(tmp_path / "weights.pt")
    assert set(state) == set(ref_state)
    # Adam divides by sqrt(v): an element whose gradient is ~0 turns fp32 reduction-order
    # noise (4 and 2 data-parallel replicas vs one device) into a share of one step, so the
    # comparison is reference.weight_mismatches's (the update's agreement, outliers bounded)
    assert not weight_mismatches(state, ref_state, ref_init), \
        weight_mismatches(state, ref_state, ref_init)


def _check_metrics(path: Path, got: dict, log: str) -> None:
    """The resumed job's metrics file: one record a step with every field of the log line,
    tokens/s and MFU consistent with the measured step time; the log line shows them."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(got["start"], STEPS))
    assert [r["loss"] for r in recs] == got["losses"]
    for r in recs:
        assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["mfu_predicted"] * r["step_time_s_predicted"]
                                         / r["step_time_s"])
        assert r["lr"] == LR and r["grad_norm"] > 0 and r["peak_memory_bytes"] > 0
    for field in ("ms/step", "tok/s", "MFU", "(plan ", "lr 0.001", "grad-norm", "peak-mem"):
        assert field in log, (field, log[-2000:])
    assert "launch.py: training" in log and "compiled in" in log


EOD = 95


def _first_loss(tmp_path: Path, model: torch.nn.Module) -> tuple[float, float]:
    """One device's loss on the job's first global batch (4 × 16): with the documents'
    positions and mask, and without."""
    from autopar.documents import doc_ids_from_eod, document_inputs
    from autopar.losses import cross_entropy
    x, y = TokenFileBatches(TokenFile(tmp_path / "tokens.bin", dtype="uint16", vocab_size=96),
                            BatchShape(global_batch_size=4, seq_len=16)).next()
    (ids, pos, mask), _ = document_inputs(x, y, doc_ids_from_eod(x, EOD))
    with torch.no_grad():
        return (float(cross_entropy(model(ids, attention_mask=mask, position_ids=pos), y)),
                float(cross_entropy(model(x), y)))


def test_launch_starts_from_pretrained_weights(tmp_path, monkeypatch):
    """`launch.py --pretrained DIR` (a save_pretrained directory of the same architecture,
    other weights): with no checkpoint to resume, the job starts from those weights — exported
    after one step at learning rate 0 they are the saved ones exactly, not the factory's
    seeded init. The file holds packed documents (`--eod 95`, 15% of the tokens): the step's
    loss at p = 2 (the program built without documents, compiled again with them) is the
    single-device model's given per-document positions and the block mask, not its loss
    without them."""
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 95, 5_000)
    tokens[rng.random(5_000) < 0.15] = EOD
    tokens.astype(np.uint16).tofile(tmp_path / "tokens.bin")
    torch.manual_seed(123)
    pretrained = load_factory(f"{tmp_path / 'my_model.py'}:factory").model
    pretrained.save_pretrained(tmp_path / "released")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                           os.environ.get("PYTHONPATH", "")]))
    # built by the CLI's main in this process (the kill-and-resume test above runs `autopar
    # build` in a fresh interpreter, as a user does): no second interpreter's ~8 CPU-s imports
    monkeypatch.chdir(tmp_path)
    assert cli_main(["build", "my_model.py:factory", "--gpus", "2", "--batch", "4", "--seq",
                     "16", "--cluster", "local-cpu", "--p", "2", "--out", "prog"]) == 0
    log = _run(_torchrun(2) + ["--data", "tokens.bin", "--steps", "1", "--lr", "0",
                               "--weight-decay", "0", "--pretrained", "released",
                               "--export", "weights.pt", "--eod", str(EOD),
                               "--losses-out", "losses.json"], tmp_path, env, 400)
    assert "loaded pretrained weights from released" in log, log[-4000:]
    loss = json.loads((tmp_path / "losses.json").read_text())["losses"][0]
    packed, plain = _first_loss(tmp_path, pretrained)
    assert abs(loss - packed) < 1e-5 < abs(packed - plain), (loss, packed, plain)
    state = torch.load(tmp_path / "weights.pt")
    want = pretrained.state_dict()
    assert set(state) == set(want)
    for key, ref in want.items():
        assert torch.equal(state[key], ref), key

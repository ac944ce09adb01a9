"""Time to train end to end on captured tiny models: parallelize(tokens=...), its bad inputs,
`autopar plan --tokens` and `autopar scale` (table + PNG)."""
from __future__ import annotations

import pytest

import autopar
from autopar.cli import main as cli_main

from models import pass_batch, pass_model

SEQ = pass_batch()[0].shape[1]


def _plan(**kwargs):
    ids, _ = pass_batch(batch=2)
    return autopar.parallelize(pass_model("gpt"), gpus=4, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, cluster="dgx-a100-80gb", **kwargs)


def test_parallelize_tokens_chooses_the_batch_and_reports_time_to_train():
    prog = _plan(tokens=1e8, critical_batch_tokens=64 * SEQ)
    tr = prog.plan.training
    assert tr is not None and tr.critical_batch_source.startswith("given")
    assert tr.batch_tokens == prog.plan.global_batch_size * SEQ
    assert len(tr.trials) > 1            # the batch was chosen among several planned
    assert tr.train_time_s == min(t.train_time_s for t in tr.trials if t.train_time_s)
    text = str(prog.plan)
    assert "time to train" in text and "GPU-hours" in text and "why this batch" in text
    assert autopar.Plan.from_json(prog.plan.to_json()) == prog.plan


def test_parallelize_tokens_estimates_the_critical_batch_from_the_model():
    prog = _plan(tokens=1e8)
    assert "2001.08361" in prog.plan.training.critical_batch_source


def test_parallelize_tokens_with_a_pinned_batch_plans_only_it():
    prog = _plan(tokens=1e8, critical_batch_tokens=64 * SEQ, global_batch_size=8)
    assert prog.plan.global_batch_size == 8
    assert prog.plan.training.batch_reason.startswith("pinned")


def test_plans_without_tokens_have_no_training_estimate():
    assert _plan(global_batch_size=8).plan.training is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(tokens=0), r"tokens=0 must be a positive number"),
    (dict(tokens=-1.0), r"tokens=-1.0 must be a positive number"),
    (dict(tokens=1e9, critical_batch_tokens=SEQ - 1),
     rf"critical_batch_tokens={SEQ - 1} is smaller than one sequence \({SEQ} tokens\)"),
    (dict(critical_batch_tokens=1e6), r"critical_batch_tokens=1000000.0 without tokens="),
])
def test_bad_time_to_train_inputs_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        _plan(**kwargs)
    assert "\n" not in str(info.value)


def _factory(tmp_path):
    f = tmp_path / "mymodel.py"
    f.write_text("from autopar.examples.gpt import GPT, GPTConfig\n"
                 "def build():\n    return GPT(GPTConfig(vocab_size=128, block_size=16, "
                 "n_layer=2, n_head=4, n_embd=64))\n")
    return f"{f}:build"


def test_cli_plan_tokens(tmp_path, capsys):
    assert cli_main(["plan", _factory(tmp_path), "--gpus", "4", "--seq", "16",
                     "--tokens", "1e8", "--critical-batch", "2048"]) == 0
    out = capsys.readouterr().out
    assert "time to train" in out and "critical batch 2,048 tokens" in out


def test_cli_scale_writes_a_png_and_a_table(tmp_path, capsys):
    png = tmp_path / "scale.png"
    assert cli_main(["scale", _factory(tmp_path), "--seq", "16", "--tokens", "1e8",
                     "--critical-batch", "4096", "--gpus-max", "8", "--gpus-min", "2",
                     "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for g in (2, 4, 8):
        assert f"\n{g:>7} |" in out
    # either GPUs stop paying within the sweep, or the table says they still pay at its end
    assert "shortest" in out and ("GPUs stop paying after" in out
                                  or "GPUs still pay at the largest count swept (8)" in out)


def test_cli_scale_bad_tokens_exits_2(tmp_path, capsys):
    assert cli_main(["scale", _factory(tmp_path), "--seq", "16", "--tokens", "0",
                     "--gpus-max", "8"]) == 2
    assert "tokens=0.0 must be a positive number" in capsys.readouterr().err

"""launch.py's learning-rate schedule and step log (autopar.train_log), pure: the schedule's
shape, and a log record's fields, tokens/s and MFU against the step time it was given."""
import dataclasses
import io
import json

import pytest
import torch

from autopar.train_log import StepLog, lr_at
from programs import make_plan


def test_warmup_then_cosine_or_linear_decay_to_the_floor():
    kw = dict(lr=1.0, steps=11, warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_at(s, decay="cosine", **kw) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(10, decay="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(6, decay="linear", **kw) == pytest.approx(0.1 + 0.9 * (1 - 4 / 8))
    assert lr_at(6, decay="cosine", **kw) == pytest.approx(0.55)        # half-way
    assert all(lr_at(s, decay="constant", lr=3e-4, steps=5) == 3e-4 for s in range(5))


def test_step_record_fields_and_consistency(tmp_path):
    base = make_plan(d=2)
    plan = dataclasses.replace(base, predicted=dataclasses.replace(
        base.predicted, step_time_s=0.2, mfu=0.4))
    out = io.StringIO()
    log = StepLog(plan, total_steps=10, out=out, metrics=tmp_path / "m.jsonl")
    rec = log.record(3, loss=2.5, step_time_s=0.25, lr=1e-4, grad_norm=0.5,
                     device=torch.device("cpu"))
    log.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == rec
    tokens = plan.global_batch_size * plan.seq_len
    assert rec["tokens_per_s"] == pytest.approx(tokens / 0.25)
    pred = plan.predicted
    # measured MFU: the plan's model FLOPs over the measured time
    assert rec["mfu"] == pytest.approx(pred.mfu * pred.step_time_s / 0.25)
    line = out.getvalue()
    for part in ("step  3/10", "loss 2.50000", "250 ms/step", "tok/s", "MFU", "(plan ",
                 "lr 0.0001", "grad-norm 0.5", "peak-mem"):
        assert part in line, (part, line)

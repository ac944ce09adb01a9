"""Errors that fit on a screen and one meaning per word (issue 16, items 8 and 9).

Every bad input the issue lists ends in ONE line naming the value, the rule and the fix (a
cause, where there is one, chained on the exception, not printed first): CLI cases through
`autopar.cli.main(argv)` with stderr captured, API cases through the ValueError. Then the
units: "bubble" is one ratio, the same number in the plan, explain() and the timeline's title;
memory is printed in GiB; layer ranges read the same in text and JSON ([first, last), last
exclusive); rank layouts print without a quoted '…' inside a Python list.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.plan import BUBBLE_MEANING, bubble_text

import models
from programs import make_plan

# ---- helpers -------------------------------------------------------------------------------


def _cli_error(capsys, argv: list[str]) -> str:
    """The one line `autopar ARGV` prints on stderr; asserts exit status 2 and nothing else."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autopar: error: ")
    return lines[0]


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg, msg
    return msg


FACTORY = '''
import torch
from autopar.examples.gpt import GPT, GPTConfig

def tiny():
    return GPT(GPTConfig(vocab_size=64, block_size={block}, n_layer=2, n_head=2, n_embd=16))

def linear():
    return torch.nn.Linear(8, 8)
'''


@pytest.fixture
def factory(tmp_path):
    def write(block: int = 1024) -> str:
        path = tmp_path / f"user_model_{block}.py"
        path.write_text(FACTORY.replace("{block}", str(block)))
        return str(path)
    return write


def _ids(seq: int = 8) -> torch.Tensor:
    return torch.zeros(1, seq, dtype=torch.long)


# ---- item 8: CLI flag values ---------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--seq", "0"), ("--gpus", "0"),
                                         ("--p", "0"), ("--micro-batch", "-2")])
def test_cli_counts_below_one_are_refused_not_ignored(capsys, flag, value):
    line = _cli_error(capsys, ["plan", "gpt-1.7b", "--gpus", "8", flag, value]
                      if flag != "--gpus" else ["plan", "gpt-1.7b", flag, value])
    assert f"{flag} {value}: must be a positive integer; pass {flag} 1 or more" in line


@pytest.mark.parametrize("argv, what", [
    (["plan", "gpt-1.7b", "--gpus", "12.5"], "argument --gpus: invalid int value: '12.5'"),
    (["plan", "gpt-1.7b", "--gpus", "8", "--tokens", "abc"], "invalid float value: 'abc'"),
    (["plan", "--gpus", "8"], "the following arguments are required: model"),
    (["plna", "gpt-1.7b"], "invalid choice: 'plna'"),
    (["plan", "gpt-1.7b", "--gpus", "8", "--schedule", "1f2b"], "invalid choice: '1f2b'"),
])
def test_cli_flag_syntax_errors_are_one_line_not_the_usage_block(capsys, argv, what):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert what in lines[0] and lines[0].endswith("--help"), lines[0]


def test_launch_flag_syntax_errors_are_one_line(capsys):
    from autopar.launch import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--data", "x.bin", "--steps", "three"], default_model="m.py:f")
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["launch.py: error: argument --steps: invalid int value: 'three'; "
                     "see launch.py --help"], lines


def test_cli_top_below_one_is_refused(capsys):
    line = _cli_error(capsys, ["plan", "gpt-1.7b", "--gpus", "8", "--explain", "--top", "-1"])
    assert "--top -1: must be a positive integer; pass --top 1 or more" in line


def test_cli_defaults_are_printed_in_the_plan_header(capsys, factory):
    assert main(["plan", f"{factory(1024)}:tiny", "--gpus", "1", "--cluster", "local-cpu"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("defaults you did not set: global batch 1 (--batch), "
                                   "sequence 1024 (--seq)")
    assert main(["plan", f"{factory(1024)}:tiny", "--gpus", "1", "--cluster", "local-cpu",
                 "--batch", "2", "--seq", "8"]) == 0
    assert "defaults you did not set" not in capsys.readouterr().out


def test_cli_default_cluster_is_named_among_the_defaults(capsys, factory):
    assert main(["plan", f"{factory(1024)}:tiny", "--gpus", "1", "--batch", "2",
                 "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "defaults you did not set: cluster dgx-a100-80gb (--cluster)"


def test_cli_default_sequence_is_the_models_context_and_says_so(capsys, factory):
    """Without --seq the sequence is the model's context (16 positions here), not a silent
    1024 that would fail deep inside the capture; the plan header names it as a default."""
    assert main(["plan", f"{factory(16)}:tiny", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "defaults you did not set:" in out and "sequence 16 (--seq)" in out


def test_cli_factory_returning_a_linear_layer(capsys, factory):
    line = _cli_error(capsys, ["plan", f"{factory()}:linear", "--gpus", "2", "--seq", "8"])
    assert "the model is a Linear with no nn.Embedding" in line
    assert "cross_entropy" in line and "return the transformer itself" in line


def test_cli_timeline_into_a_missing_directory(capsys, factory):
    line = _cli_error(capsys, ["timeline", f"{factory()}:tiny", "--gpus", "1", "--seq", "8",
                               "--cluster", "local-cpu", "--out", "/nonexistent/x.png"])
    assert "cannot write /nonexistent/x.png" in line and "does not exist" in line


# ---- item 8: the Python API ----------------------------------------------------------------

@pytest.mark.parametrize("gpus", [True, 0, 2.0])
def test_gpus_must_be_a_positive_int_not_a_bool(gpus):
    with pytest.raises(ValueError) as info:
        autopar.parallelize(models.gpt(seq=8), gpus=gpus, example_inputs=(_ids(),),
                            loss_fn=autopar.cross_entropy)
    assert f"gpus={gpus!r} must be a positive integer" in _one_line(info.value)


def test_pinned_p_beyond_the_layer_count():
    with pytest.raises(ValueError) as info:
        autopar.parallelize(models.gpt(seq=8, layers=2), gpus=4, example_inputs=(_ids(),),
                            loss_fn=autopar.cross_entropy, global_batch_size=4,
                            cluster="local-cpu", p=4)
    msg = _one_line(info.value)
    assert "p=4 pipeline stages but the model has 2 layers" in msg and "pin p <= 2" in msg


@pytest.mark.parametrize("builder", ["gpt", "hf_gpt2"])
def test_sequence_longer_than_the_models_context(builder):
    model = models.BUILDERS[builder](seq=16)
    with pytest.raises(ValueError) as info:
        autopar.parallelize(model, gpus=1, example_inputs=(_ids(32),),
                            loss_fn=autopar.cross_entropy, cluster="local-cpu")
    msg = _one_line(info.value)
    assert "sequence length 32 but the model's context is 16 positions" in msg
    assert "at most 16" in msg


def test_load_plan_on_corrupt_json_names_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"t": 1')
    with pytest.raises(ValueError) as info:
        autopar.load_plan(path)
    msg = _one_line(info.value)
    assert str(path) in msg and "is not valid JSON" in msg and "line 1" in msg
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


@pytest.mark.parametrize("content, what", [('{"t": 1}', "missing field 'stages'"),
                                           ("[1, 2]", "a JSON list, not an object")])
def test_load_plan_on_the_wrong_schema_names_the_file_and_field(tmp_path, content, what):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        autopar.load_plan(path)
    msg = _one_line(info.value)
    assert str(path) in msg and "not an autopar plan" in msg and what in msg
    assert info.value.__cause__ is not None


def test_load_plan_on_a_missing_file(tmp_path):
    with pytest.raises(ValueError) as info:
        autopar.load_plan(tmp_path / "nope.json")
    assert "cannot read" in _one_line(info.value)


def test_timeline_says_how_to_get_matplotlib(monkeypatch, tmp_path):
    from autopar.timeline import plan_timeline
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib fails
    with pytest.raises(ValueError) as info:
        plan_timeline(make_plan(p=2, layers=2), str(tmp_path / "x.png"))
    assert "pip install matplotlib" in _one_line(info.value)
    assert isinstance(info.value.__cause__, ImportError)


def test_matplotlib_is_a_main_dependency():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    main_deps = re.search(r"^dependencies = \[(.*)\]$", text, re.M).group(1)
    assert '"matplotlib"' in main_deps and '"safetensors"' in main_deps


# ---- item 9: one meaning per word and unit -------------------------------------------------

def _plan_with_bubble(fraction: float, **kw):
    plan = make_plan(**kw)
    return dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, bubble_fraction=fraction))


def test_bubble_is_one_number_in_plan_explain_and_timeline(monkeypatch, tmp_path):
    plan = _plan_with_bubble(0.1234, p=2, m=4, layers=4)
    want = bubble_text(0.1234)
    assert want == f"bubble 12.3% ({BUBBLE_MEANING})"
    assert want in str(plan)
    assert want in plan.explain()
    titles = []
    import autopar.timeline as timeline
    monkeypatch.setattr(timeline, "draw_timeline",
                        lambda events, p, path, title="": titles.append(title) or path)
    timeline.plan_timeline(plan, str(tmp_path / "x.png"))
    assert want in titles[0]
    # the simulation's own idle share of this drawing (no p2p) is another number: not shown
    assert "bubble" not in titles[0].replace(want, "")


def test_memory_is_printed_in_gib_only():
    from autopar.examples.gpt import GPT, gpt_preset
    with torch.device("meta"):
        model = GPT(gpt_preset("gpt-1.7b"))
    prog = autopar.parallelize(model, gpus=8, example_inputs=(_ids(2048).to("meta"),),
                               loss_fn=autopar.cross_entropy, global_batch_size=512)
    text = str(prog.plan) + "\n" + prog.plan.explain(top=50)
    assert "GiB" in text
    assert re.search(r"\d GB\b|\bGB usable", text) is None, \
        [line for line in text.splitlines() if re.search(r"\bGB\b", line)]
    assert "GiB usable per GPU" in text        # the solver's rejections, same unit


def test_layer_ranges_read_the_same_in_text_and_json():
    plan = make_plan(p=2, v=2, m=2, schedule="interleaved-1f1b", layers=7)
    text = str(plan)
    assert "[first, last): last exclusive, as in the JSON" in text
    for stage in json.loads(plan.to_json())["stages"]:
        assert f"layers [{stage['first_layer']}, {stage['last_layer']})" in text
    # folded runs of equal chunks print one range over them, same convention
    long = make_plan(p=2, v=4, m=2, schedule="interleaved-1f1b", layers=16)
    stages = json.loads(long.to_json())["stages"]
    assert f"layers [{stages[1]['first_layer']}, {stages[-2]['last_layer']})" in str(long)


@pytest.mark.parametrize("t", [2, 8])
def test_rank_layout_is_readable(t):
    plan = make_plan(t=t, p=2, layers=2)
    line = next(x for x in str(plan).splitlines() if "rank layout" in x)
    assert "'" not in line and "[" not in line.split(";", 1)[1], line
    assert ("pp0/dp0: ranks 0, 1" if t == 2 else "pp0/dp0: ranks 0-7") in line
    assert ("pp1/dp0: ranks 2, 3" if t == 2 else "pp1/dp0: ranks 8-15") in line

"""`autopar build` writes the program of a user's `file.py:factory` (plan.json, chunk sources,
launch.py, run scripts, build.json) from the same planning path as `autopar plan`; the plan
records the model's parameters and compile() refuses another model, naming the first
mismatch in one line."""
from __future__ import annotations

import ast
import json

import pytest

import autopar
from autopar.cli import main as cli_main
from autopar.cost.hardware import cluster_to_dict
from autopar.factory import load_factory

HF_FILE = '''
from transformers import LlamaConfig, LlamaForCausalLM

def factory(layers=4, hidden=32):
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        use_cache=False))

def wider():
    return factory(hidden=48)

def deeper():
    return factory(layers=5)

def raises():
    raise RuntimeError("no GPU here")
'''
ARGS = ["--gpus", "2", "--batch", "4", "--seq", "16", "--cluster", "local-cpu"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("build")
    (d / "my_model.py").write_text(HF_FILE)
    assert cli_main(["build", f"{d / 'my_model.py'}:factory", *ARGS, "--p", "2",
                     "--out", str(d / "prog")]) == 0
    return d


def test_build_writes_the_program_plan_would_print(built, capsys):
    out = built / "prog"
    names = {p.name for p in out.iterdir()}
    assert {"plan.json", "chunk_00.py", "chunk_01.py", "launch.py", "run.sh",
            "run_multinode.sh", "slurm.sbatch", "build.json"} <= names
    plan = autopar.Plan.from_json((out / "plan.json").read_text())
    assert (plan.p, plan.gpus, plan.global_batch_size, plan.seq_len) == (2, 2, 4, 16)
    assert plan.parameters[0] == "model.embed_tokens.weight (64, 32)"
    build = json.loads((out / "build.json").read_text())
    assert build == {"model": f"{(built / 'my_model.py').resolve()}:factory",
                     "pins": {"p": 2}, "precision": "fp32",
                     "cluster": cluster_to_dict(autopar.get_cluster("local-cpu"))}
    for f in ("launch.py", "chunk_00.py", "chunk_01.py"):
        ast.parse((out / f).read_text())
    assert "--model defaults to" in (out / "launch.py").read_text()
    # the same engine as `autopar plan`: the same plan for the same arguments
    capsys.readouterr()
    assert cli_main(["plan", f"{built / 'my_model.py'}:factory", *ARGS, "--p", "2",
                     "--json"]) == 0
    printed = autopar.Plan.from_dict(json.loads(capsys.readouterr().out))
    assert printed == plan


@pytest.mark.parametrize("factory, words", [
    ("wider", ["parameter 'model.embed_tokens.weight' is (64, 48) in the model but (64, 32) "
               "in the plan"]),
    ("deeper", ["the model has parameter 'model.layers.4.self_attn.q_proj.weight'"]),
])
def test_compile_names_the_first_parameter_that_differs_from_the_plan(built, factory, words):
    plan = autopar.Plan.from_json((built / "prog" / "plan.json").read_text())
    user = load_factory(f"{built / 'my_model.py'}:{factory}", device="meta")
    prog = autopar.ParallelProgram(model=user.model, plan=plan, profile=None,
                                   example_inputs=user.inputs(), loss_fn=user.loss(),
                                   example_targets=None, cluster=None)
    with pytest.raises(ValueError) as err:
        prog.compile()                       # refused before any process group is joined
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("compile: the model does not match the plan")
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("argv, words", [
    (["build", "gpt-1.7b", "--gpus", "8", "--out", "{d}/x"], ["preset", "file.py:factory"]),
    (["build", "{d}/my_model.py:factory", *ARGS, "--out", "{d}/my_model.py"],
     ["exists and is not a directory"]),
    (["build", "{d}/my_model.py:factory", *ARGS, "--out", "{d}"],
     ["not an autopar build (no plan.json)"]),
    (["build", "{d}/my_model.py:factory", "--gpus", "2", "--seq", "64", "--out", "{d}/y"],
     ["--seq=64 exceeds", "context of 16"]),
])
def test_build_bad_input_is_one_line(built, capsys, argv, words):
    capsys.readouterr()
    assert cli_main([a.format(d=built) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopar: error:") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("argv, words", [
    (["--data", "random", "--steps", "0"], ["--steps 0: must be a positive integer"]),
    (["--data", "random", "--save-every", "-1"], ["--save-every -1"]),
    (["--data", "random", "--keep", "0"], ["--keep 0: must be a positive integer"]),
    (["--data", "random", "--precision", "bf16"],
     ["chunk_00.py was generated for precision='fp32' but the run asks for precision='bf16'",
      "autopar build --precision bf16"]),
    # checked before the process group and the compile (issue 30)
    (["--data", "random", "--vocab", "100"],
     ["--vocab 100: larger than the model's vocabulary (64", "pass --vocab 64 or less"]),
    (["--data", "{d}/missing.bin"], ["missing.bin", "does not exist"]),
    (["--data", "random", "--eval-data", "{d}/missing.bin"], ["missing.bin"]),
    (["--data", "random", "--pretrained", "{d}/nowhere"], ["is not a directory"]),
    (["--data", "random", "--steps", "4", "--warmup-steps", "4"], ["--warmup-steps 4"]),
    (["--data", "random", "--metrics", "{d}/no/m.jsonl"], ["--metrics", "does not exist"]),
    (["--data", "random", "--lr", "-1"], ["--lr -1.0: must be a finite number >= 0"]),
    (["--data", "random", "--vocab", "0"], ["--vocab 0: must be a positive integer"]),
    (["--data", "random", "--lr", "inf"], ["--lr inf: must be a finite number >= 0"]),
    (["--data", "random", "--weight-decay", "-1"], ["--weight-decay -1.0: must be a finite"]),
    (["--data", "random", "--max-grad-norm", "-1"], ["--max-grad-norm -1.0", "no clipping"]),
    (["--data", "random", "--data-seed", "-3"], ["--data-seed -3: must be >= 0"]),
    (["--data", "random", "--checkpoint", "{d}/my_model.py"], ["is a file; a checkpoint is a"]),
    (["--data", "random", "--export", "{d}/no/x.pt"], ["--export", "does not exist"]),
    (["--data", "random", "--losses-out", "{d}/no/l.json"], ["--losses-out", "does not exist"]),
    (["--data", "random", "--eod", "64"], ["--eod 64: not a token id of the vocabulary [0, 64)"]),
    (["--data", "random", "--model", "{d}/my_model.py:raises"],
     ["raises() raised RuntimeError: no GPU here", "run with --verbose"]),
])
def test_launch_bad_input_is_one_line(built, capsys, argv, words):
    from autopar.launch import main as launch_main
    argv = [a.format(d=built) for a in argv]
    assert launch_main(built / "prog", argv) == 2      # before any process group is joined
    err = capsys.readouterr().err.strip()
    assert err.startswith("launch.py: error:") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)


def test_launch_verbose_shows_the_cause(built, capsys):
    from autopar.launch import main as launch_main
    argv = ["--data", "random", "--model", f"{built}/my_model.py:raises", "--verbose"]
    assert launch_main(built / "prog", argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("launch.py: error: ") and "run with --verbose" not in err
    assert "Traceback" in err and 'raise RuntimeError("no GPU here")' in err


def test_build_for_bf16_records_it_and_launch_runs_it_by_default(built, capsys):
    """`autopar build --precision bf16` writes chunks captured in bf16 (PRECISION, and the
    RMSNorm's fp32 upcast a cast of its own) and build.json's precision, launch.py's default;
    asking launch.py for fp32 is refused in one line before any process group is joined."""
    from autopar.launch import main as launch_main, parse_args
    out = built / "prog_bf16"
    assert cli_main(["build", f"{built / 'my_model.py'}:factory", *ARGS, "--p", "2",
                     "--precision", "bf16", "--out", str(out)]) == 0
    assert json.loads((out / "build.json").read_text())["precision"] == "bf16"
    sources = {f.name: f.read_text() for f in out.glob("chunk_*.py")}
    assert len(sources) > 1 and all("PRECISION = 'bf16'" in s for s in sources.values())
    assert any("torch.bfloat16" in s for s in sources.values())   # the norms' to(input_dtype)
    assert not any("torch.bfloat16" in f.read_text() for f in (built / "prog").glob("chunk_*"))
    assert parse_args(["--data", "random"], "m.py:f", "bf16").precision == "bf16"
    capsys.readouterr()
    assert launch_main(out, ["--data", "random", "--precision", "fp32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "generated for precision='bf16'" in err, err


def test_build_compile_prices_fused_and_makes_launch_compile(built):
    """`autopar build --compile` plans local-cpu with elementwise ops fused (what Inductor
    runs; without it local-cpu prices them eager, as the eager runtime runs them) and records
    compile in build.json, launch.py's default --compile; --no-compile overrides it."""
    from autopar.launch import parse_args
    out = built / "prog_compiled"
    assert cli_main(["build", f"{built / 'my_model.py'}:factory", *ARGS, "--p", "2",
                     "--compile", "--out", str(out)]) == 0
    assert json.loads((out / "build.json").read_text())["compile"] is True
    assert autopar.load_plan(out / "plan.json").predicted.elementwise == "fused"
    assert autopar.load_plan(built / "prog" / "plan.json").predicted.elementwise == "eager"
    assert "compile" not in json.loads((built / "prog" / "build.json").read_text())
    assert parse_args(["--data", "random", "--no-compile"], "m.py:f").compile is False
    assert parse_args(["--data", "random"], "m.py:f").compile is None   # build.json decides


def test_launch_needs_model_without_build_json(tmp_path, capsys):
    from autopar.launch import main as launch_main
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "build.json").write_text("{not json")
    assert launch_main(tmp_path, ["--data", "random"]) == 2
    err = capsys.readouterr().err.strip()
    assert "build.json: not valid JSON" in err and "\n" not in err, err


def test_launch_corrupt_plan_json_is_one_line(built, capsys, tmp_path):
    import shutil
    from autopar.launch import main as launch_main
    prog = tmp_path / "prog"
    shutil.copytree(built / "prog", prog)
    (prog / "plan.json").write_text('{"t": 1,')
    assert launch_main(prog, ["--data", "random"]) == 2   # before any process group is joined
    err = capsys.readouterr().err.strip()
    assert err.startswith("launch.py: error:") and "\n" not in err, err
    assert "plan.json is not valid JSON" in err, err


def test_relaunch_replans_on_the_cluster_the_build_recorded(built):
    """A build carries its cluster (build.json: every field), so launch's re-plan for another
    world size prices the hardware it was planned for — a cluster file's too — not a name."""
    from autopar.launch import _solve
    out = built / "prog"
    build = json.loads((out / "build.json").read_text())
    saved = autopar.load_plan(out / "plan.json")
    mine = dict(build["cluster"], name="my-cluster", gpus_per_node=1)
    user = load_factory(build["model"], device="meta")
    plan = _solve(saved, user, 1, {}, mine)
    assert (plan.cluster, plan.gpus, plan.global_batch_size) == ("my-cluster", 1, 4)
    with pytest.raises(ValueError, match="build.json's cluster: field 'peak_flops' = -1.0"):
        _solve(saved, user, 1, {}, dict(mine, peak_flops=-1.0))


def test_chunk_files_point_at_the_users_source_lines(built):
    """Each statement group of a generated chunk is commented with the model's file:line and
    source text (node.meta["stack_trace"], the innermost frame outside torch)."""
    src = (built / "prog" / "chunk_00.py").read_text()
    comments = [ln.strip() for ln in src.splitlines() if ln.strip().startswith("# ")]
    llama = [c for c in comments if "modeling_llama.py:" in c]
    assert llama, src[:3000]
    assert any("self.embed_tokens(input_ids)" in c for c in llama), llama[:5]
    assert any("in forward:" in c for c in llama)


def test_build_prices_elementwise_ops_as_the_built_program_runs_them():
    """On an H100 a plan priced with the preset's fused elementwise ops ran eager chunks out
    of memory: `build` prices eager unless it compiles the chunks; `plan` keeps the cluster's;
    --elementwise wins over both."""
    from autopar.cli import build_parser, priced_kinds
    ap = build_parser()
    assert priced_kinds(ap.parse_args(["build", "gpt-1.7b", "--gpus", "8", "--out", "x"])) \
        == {"elementwise": "eager"}
    assert priced_kinds(ap.parse_args(["build", "gpt-1.7b", "--gpus", "8", "--out", "x",
                                       "--compile"])) == {"elementwise": "fused"}
    assert priced_kinds(ap.parse_args(["build", "gpt-1.7b", "--gpus", "8", "--out", "x",
                                       "--elementwise", "fused"])) == {"elementwise": "fused"}
    assert priced_kinds(ap.parse_args(["plan", "gpt-1.7b", "--gpus", "8"])) == {}

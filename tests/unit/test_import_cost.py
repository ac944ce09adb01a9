"""What a fresh interpreter pays before it works (issue 28 item 1, the CI suite's time): the
heavy torch subsystems are imported where first used, not by the modules every process loads.
`import autopar` / `autopar.cli` load no torch (the `autopar` command pauses the cyclic
collector before torch loads, autopar/cli.py); a rank (`autopar.launch`, `autopar.compile`)
loads neither torch.distributed.checkpoint (~1 s, only a save or a load needs it) nor
torch.distributed.pipelining (~1.6 s with its torch._dynamo, only the split backward needs it);
the planning path (api, presets, solver) loads neither, nor transformers, matplotlib or rich.
One fresh interpreter checks each stage's sys.modules."""
from __future__ import annotations

import gc
import json
import subprocess
import sys

from autopar import cli

STAGES = [("import autopar; import autopar.cli", ("torch", "transformers")),
          ("import autopar.launch, autopar.compile",
           ("torch.distributed.checkpoint", "torch.distributed.pipelining", "torch._dynamo",
            "transformers")),
          ("import autopar.api, autopar.presets, autopar.cost.solver",
           ("torch.distributed.checkpoint", "torch.distributed.pipelining", "transformers",
            "matplotlib", "rich"))]


def test_fresh_interpreter_imports_heavy_subsystems_only_where_used():
    code = ("import json, sys\nout = []\n"
            + "".join(f"{stmt}\nout.append({list(banned)!r})\n"
                      f"out[-1] = [m for m in out[-1] if m in sys.modules]\n"
                      for stmt, banned in STAGES)
            + "print(json.dumps(out))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=180)
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    for (stmt, _), leaked in zip(STAGES, loaded):
        assert leaked == [], f"`{stmt}` imports {leaked}"


def test_the_command_pauses_the_collector_until_planned_and_embedders_never():
    assert gc.isenabled()
    try:
        cli._pause_collector()
        assert not gc.isenabled()
        cli._resume_collector()
        assert gc.isenabled()
        cli._resume_collector()          # no pause held: nothing to do
        assert gc.isenabled()
        gc.disable()                     # an embedder's own choice is left alone
        cli._pause_collector()
        cli._resume_collector()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
    assert cli.main(["clusters"]) == 0   # main() with an argv list: the collector untouched
    assert gc.isenabled()

"""The runtime depends on data, not on the compiler: autopar.compile hands the Runner its
chunks, parameter table, regime and groups, so no runtime module may import the capture,
passes, cost model, code generator or build (a fresh interpreter checks what gets loaded)."""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import autopar.runtime

COMPILER = ("autopar.build", "autopar.codegen", "autopar.compile", "autopar.passes",
            "autopar.cost", "autopar.report", "autopar.timeline")


def _runtime_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(autopar.runtime.__path__,
                                                        "autopar.runtime."))


def test_runtime_modules_import_nothing_of_the_compiler():
    modules = _runtime_modules()
    assert "autopar.runtime.runner" in modules and "autopar.runtime.regimes.zero3" in modules
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    leaked = [m for m in loaded if m.startswith(COMPILER)]
    assert leaked == [], f"runtime modules pull in compiler modules: {leaked}"
    assert "autopar.runtime.runner" in loaded   # the check saw the runtime itself

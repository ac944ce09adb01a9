"""What a saved program's directory holds, read and written by name: the chunk file names,
build.json (the factory, pins, precision and cluster `autopar build` planned with) and the
precision each chunk was generated for.

The one module both sides import: codegen writes a directory (prog.save), launch and compile
read it. Neither imports the other for these (no import loop: tests/unit/test_import_cycles.py).
"""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

BUILD_FILE = "build.json"


def chunk_file_name(chunk: int, tp_rank: int, t: int) -> str:
    return f"chunk_{chunk:02d}.py" if t == 1 else f"chunk_{chunk:02d}_tp{tp_rank}.py"


def build_info(model: str | None, pins: dict[str, Any], precision: str = "fp32",
               cluster: dict[str, Any] | None = None, documents: Any = None) -> str:
    """The JSON of build.json: the factory `autopar build` was given (absolute path), the
    pins it planned with, the precision its chunks were generated for and the cluster it
    planned for (every field: a re-plan prices the same hardware, a cluster file's too)."""
    if model is not None:
        path, _, fn = model.rpartition(":")
        model = f"{Path(path).resolve()}:{fn}"
    info = {"model": model, "pins": pins, "precision": precision}
    if cluster is not None:
        info["cluster"] = cluster
    if documents is not None:   # the chunks take packed documents' inputs
        info["documents"] = dataclasses.asdict(documents)
    return json.dumps(info, indent=2)


def read_build(program_dir: Path) -> dict[str, Any]:
    """build.json's fields ({} when the directory has none: a program saved by prog.save
    without autopar build's knowledge is still runnable with --model)."""
    file = Path(program_dir) / BUILD_FILE
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc}); rewrite it with autopar build, or "
                         f"delete it and pass --model") from exc


def saved_precision(source: str) -> str:
    """The PRECISION a chunk source was generated for ("fp32" for files written before chunks
    recorded it: those were all captured in fp32)."""
    for line in source.splitlines():
        if line.startswith("PRECISION = "):
            return ast.literal_eval(line[len("PRECISION = "):].strip())
    return "fp32"


def check_saved_precision(directory: str | Path, plan: Any, precision: str) -> None:
    """ValueError (one line) unless every chunk file `prog.save` wrote into `directory` for
    `plan` was generated for `precision`: a graph captured in fp32 cannot tell a norm's fp32
    upcast from its input (so it cannot run in bf16), one captured in bf16 casts to bf16.
    Missing files are left to the loader, which names them."""
    for tp in range(plan.t):
        for c in range(plan.p * plan.v):
            path = Path(directory) / chunk_file_name(c, tp, plan.t)
            saved = saved_precision(path.read_text()) if path.is_file() else precision
            if saved != precision:
                raise ValueError(
                    f"{path} was generated for precision={saved!r} but the run asks for "
                    f"precision={precision!r}; run it with precision={saved!r} (launch.py "
                    f"--precision {saved}), or save it again for {precision} "
                    f"(prog.save(..., precision={precision!r}), autopar build --precision "
                    f"{precision})")

"""Pretrained weights: a `transformers` `save_pretrained` directory into a program under any plan.

`load_pretrained(path, params, regime, groups)` (what Runner.load_pretrained calls) fills this
rank's parameters from the safetensors files of `path`:

  model.safetensors                          one file, or
  model.safetensors.index.json + shards      the index's "weight_map" names each key's file.

Names: the file keys are the user's state-dict keys, the keys `full_state_dict()` returns
(ParamInfo.key and, for tied weights, ParamInfo.aliases: `save_pretrained` writes a tied
tensor once, under either name). Reading: each rank opens only the files holding its keys and
reads, with `safe_open(...).get_slice`, only the rows of its tensor-parallel slice (a fused
q/k/v parameter: the rows of each block it holds), so no rank ever holds more than its own
shard of the model. Values are cast to fp32 (the runtime's master precision); vocabulary
padding rows are zeros, as in a fresh build. The optimizer state is left empty: a fine-tune
starts its optimizer from scratch.

Errors: a key of the model missing from the files, or stored with another shape, is a
ValueError naming the key, both shapes and the fix; every rank checks its own keys, then the
ranks agree on the first problem (one all-gather) and all raise the same one-line error, so no
rank is left waiting in the optimizer regime's collectives.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.params import LocalParams, ParamInfo

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: str | os.PathLike) -> dict[str, Path]:
    """{state-dict key: the safetensors file holding it} of a `save_pretrained` directory."""
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"load_pretrained: {str(root)!r} is not a directory; pass the "
                         f"directory model.save_pretrained() wrote")
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"load_pretrained: {index} is not a safetensors index (a JSON "
                             f"object with a 'weight_map'); re-save the model with "
                             f"save_pretrained()") from exc
        return {key: root / name for key, name in weight_map.items()}
    single = root / SINGLE_FILE
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {key: single for key in f.keys()}
    raise ValueError(f"load_pretrained: {root} holds neither {SINGLE_FILE} nor {INDEX_FILE}; "
                     f"save the model with save_pretrained(dir, safe_serialization=True) "
                     f"(pytorch_model.bin files are not read)")


def _rows(info: ParamInfo, split: Any, tp_rank: int, t: int) -> list[tuple[int, int]] | None:
    """This rank's real (start, stop) ranges along info's split dimension, or None for the
    whole tensor. A fused parameter (blocked) holds a range of every block."""
    if split is None:
        return None
    ps, full = split
    return [(start, min(start + n, full)) for start, n in ps.ranges(tp_rank, t)
            if start < full]


def _read(f: Any, key: str, dim: int | None, rows: list[tuple[int, int]] | None
          ) -> torch.Tensor:
    """The rows `rows` along `dim` of tensor `key` of the open file f (all of it: rows None)."""
    sl = f.get_slice(key)
    if rows is None:
        return sl[:]
    pieces = []
    for start, stop in rows:
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        pieces.append(sl[index])
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def load_pretrained(path: str | os.PathLike, params: LocalParams, regime: Any,
                    groups: Any) -> None:
    """Fill the program's parameters from a `save_pretrained` directory (module docstring).
    Collective: every rank calls it."""
    from safetensors import safe_open

    files = weight_files(path)
    problem = None
    found: dict[str, tuple[str, Path]] = {}     # graph name -> (file key, file)
    for q in params.tensors:
        info = params.infos[q]
        key = next((k for k in (info.key,) + info.aliases if k in files), None)
        if key is None:
            problem = (f"load_pretrained: {path}: the model's parameter {info.key!r} is not "
                       f"in the saved weights; save the same model class and configuration "
                       f"as the one this program was planned from")
            break
        found[q] = (key, files[key])
    if problem is None:
        problem = _check_shapes(path, params, found)
    problems: list[Any] = [None] * groups.world_size if dist.is_initialized() else [problem]
    if dist.is_initialized():
        dist.all_gather_object(problems, problem, group=groups.world)
    first = next((p for p in problems if p), None)
    if first:
        raise ValueError(first)
    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for q, (_key, file) in found.items():
        by_file.setdefault(file, []).append(q)
    for file, qs in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as f:
            for q in qs:
                weights[q] = _local_value(f, found[q][0], params, q, groups)
    regime.load(weights, {})


def _check_shapes(path: Any, params: LocalParams, found: dict[str, tuple[str, Path]]
                  ) -> str | None:
    from safetensors import safe_open

    for q, (key, file) in found.items():
        with safe_open(str(file), framework="pt") as f:
            saved = tuple(f.get_slice(key).get_shape())
        want = tuple(params.infos[q].global_shape)
        if saved != want:
            return (f"load_pretrained: {path}: {key!r} is saved with shape {saved} but the "
                    f"model's is {want}; load weights saved from the same configuration")
    return None


def _local_value(f: Any, key: str, params: LocalParams, q: str, groups: Any) -> torch.Tensor:
    """This rank's local tensor of parameter q (local shape, fp32, padding rows zero)."""
    split = params.splits.get(q) if groups.t > 1 else None
    info = params.infos[q]
    local_shape = tuple(params.tensors[q].shape)
    dim = split[0].dim if split is not None else None
    rows = _rows(info, split, groups.tp_rank, groups.t)
    if info.expert:   # this expert rank's experts along dim 0, then its tensor rows
        value = _read(f, key, 0, [(info.start, info.stop)]).to(torch.float32)
        if rows is not None:
            value = torch.cat([value.narrow(dim, a, b - a) for a, b in rows], dim)
        return value
    value = _read(f, key, dim, rows).to(torch.float32)
    if tuple(value.shape) == local_shape:
        return value
    out = torch.zeros(local_shape, dtype=torch.float32)      # vocabulary padding rows
    out.narrow(dim, 0, value.shape[dim]).copy_(value)
    return out

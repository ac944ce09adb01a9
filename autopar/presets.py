"""Model presets for the command line: the GPT family of the Megatron-LM papers, built on meta.

A preset is the examples' GPT (`autopar.examples.gpt`) with the published dimensions, created on
the meta device so a 1T-parameter model plans on a laptop. `file.py:factory` loads any user
model instead: the factory returns a module, or a (module, example_inputs) pair.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class PresetDefaults:
    """Published training setup of a preset: global batch and GPU count (2104.04473 Table 1)."""
    global_batch_size: int
    gpus: int


# Global batch and GPUs of 2104.04473 Table 1 (and 1909.08053 for the V100 model).
PRESET_DEFAULTS: dict[str, PresetDefaults] = {
    "gpt-1.7b": PresetDefaults(global_batch_size=512, gpus=32),
    "gpt-18b": PresetDefaults(global_batch_size=1024, gpus=256),
    "gpt-39b": PresetDefaults(global_batch_size=1536, gpus=512),
    "gpt-76b": PresetDefaults(global_batch_size=1792, gpus=1024),
    "gpt-145b": PresetDefaults(global_batch_size=2304, gpus=1536),
    "gpt-162b": PresetDefaults(global_batch_size=128, gpus=64),
    "gpt3-175b": PresetDefaults(global_batch_size=1536, gpus=1536),
    "gpt-310b": PresetDefaults(global_batch_size=2160, gpus=1920),
    "gpt-530b": PresetDefaults(global_batch_size=2520, gpus=2520),
    "megatron-1t": PresetDefaults(global_batch_size=3072, gpus=3072),
    "gpt-1.2b-v100": PresetDefaults(global_batch_size=512, gpus=64),
}


def preset_names() -> list[str]:
    return sorted(PRESET_DEFAULTS)


def load_model(spec: str, *, seq_len: int | None = None,
               device: str = "meta") -> tuple[torch.nn.Module, tuple, str, PresetDefaults | None]:
    """Build the model named by `spec` (a preset name or `file.py:factory`).

    Returns (model, example_inputs, display name, preset defaults or None).
    """
    if spec in PRESET_DEFAULTS:
        from autopar.examples.gpt import GPT, gpt_preset
        cfg = gpt_preset(spec)
        seq = seq_len or cfg.block_size
        if seq > cfg.block_size:
            raise ValueError(f"--seq {seq} exceeds the preset {spec}'s context of "
                             f"{cfg.block_size} positions; pass --seq {cfg.block_size} or less")
        with torch.device(device):
            model = GPT(cfg)
        ids = torch.zeros(1, seq, dtype=torch.long, device=device)
        return model, (ids,), spec, PRESET_DEFAULTS[spec]
    if ":" in spec:
        return _load_factory(spec, seq_len=seq_len, device=device) + (None,)
    raise ValueError(f"unknown model {spec!r}: give a preset ({', '.join(preset_names())}) or "
                     f"'path/to/file.py:factory' where factory() returns an nn.Module "
                     f"(or a (module, example_inputs) pair)")


def _load_factory(spec: str, *, seq_len: int | None,
                  device: str) -> tuple[torch.nn.Module, tuple, str]:
    path_s, _, fn_name = spec.rpartition(":")
    path = Path(path_s)
    if not path.is_file():
        raise ValueError(f"model file {path_s!r} (from {spec!r}) does not exist; give "
                         f"'path/to/file.py:factory'")
    mod_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise ValueError(f"{path_s} has no callable {fn_name!r}; define "
                         f"`def {fn_name}(): return model` there")
    with torch.device(device):
        built: Any = factory()
    if isinstance(built, tuple):
        model, inputs = built
        return model, tuple(inputs), f"{path.stem}:{fn_name}"
    ids = torch.zeros(1, seq_len or 1024, dtype=torch.long, device=device)
    return built, (ids,), f"{path.stem}:{fn_name}"

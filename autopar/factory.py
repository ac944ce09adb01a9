"""The user's model factory, `file.py:factory`: one contract for the command line (`autopar
plan | build | timeline`), the generated `launch.py` and the examples.

`factory()` takes no arguments and returns the model, or a dict with the model and, optionally,
what `autopar.parallelize` would otherwise default:

    # my_model.py — a transformers model built from its config (never downloaded)
    from transformers import LlamaConfig, LlamaForCausalLM

    def factory():
        config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                             num_hidden_layers=16, num_attention_heads=16,
                             max_position_embeddings=2048, use_cache=False)
        return LlamaForCausalLM(config)
        # or: return {"model": LlamaForCausalLM(config),
        #             "example_inputs": (torch.zeros(1, 2048, dtype=torch.long),),
        #             "loss_fn": autopar.cross_entropy,          # loss_fn(output, targets)
        #             "example_targets": torch.zeros(1, 2048, dtype=torch.long)}

Defaults, a causal language model's: example inputs are (1, seq) zero token ids, where seq is
`--seq` or the plan's sequence, else the context the model's config declares
(`max_position_embeddings`, `n_positions`, `block_size`); the loss is `autopar.cross_entropy`;
the targets are shaped like the input ids. Planning builds the model under
`torch.device("meta")` (nothing allocated); `launch.py` builds it for real, after seeding torch
with the same seed on every rank, so every rank starts from the same weights.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

FACTORY_KEYS = ("model", "example_inputs", "loss_fn", "example_targets")
CONTRACT = ("return the model, or a dict {'model': model} with optional 'example_inputs', "
            "'loss_fn' and 'example_targets'")
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "block_size", "n_ctx")


@dataclass(frozen=True, kw_only=True)
class UserModel:
    """What a factory returned, checked: the model and the optional pieces (None: default)."""
    model: torch.nn.Module
    example_inputs: tuple | None = None
    loss_fn: Callable | None = None
    example_targets: Any = None
    name: str = "model"

    def inputs(self, *, seq_len: int | None = None, batch: int = 1,
               option: str = "seq_len") -> tuple:
        """Example inputs: the factory's, else (batch, seq) zero token ids. `seq_len` (the
        `--seq` option or the plan's sequence) must agree with the factory's inputs and fit
        the model's context; `option` names it in errors."""
        context = context_length(self.model)
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
            raise ValueError(f"{option}={seq_len!r}: the sequence length must be a positive "
                             f"integer; pass a number of tokens per sequence")
        if self.example_inputs is not None:
            first = self.example_inputs[0]
            have = int(first.shape[1]) if isinstance(first, torch.Tensor) and first.dim() > 1 \
                else None
            if seq_len is not None and have is not None and have != seq_len:
                raise ValueError(
                    f"{option}={seq_len} but {self.name}'s example_inputs have sequence length "
                    f"{have}; drop {option}, or make the factory's example inputs {seq_len} "
                    f"tokens long")
            return self.example_inputs
        seq = seq_len if seq_len is not None else context
        if seq is None:
            raise ValueError(
                f"{self.name}: no sequence length — the factory gives no example_inputs and "
                f"the model has no config.{'/'.join(_CONTEXT_ATTRS)}; pass --seq S (or return "
                f"'example_inputs' from the factory)")
        if context is not None and seq > context:
            raise ValueError(
                f"{option}={seq} exceeds {self.name}'s context of {context} positions "
                f"(its config); pass {option} <= {context}")
        device = _parameter_device(self.model)
        return (torch.zeros(batch, seq, dtype=torch.long, device=device),)

    def loss(self) -> Callable:
        """The factory's loss_fn, else autopar.cross_entropy."""
        if self.loss_fn is not None:
            return self.loss_fn
        from autopar.losses import cross_entropy
        return cross_entropy


def context_length(model: torch.nn.Module) -> int | None:
    """The context (maximum positions) the model's config declares, if any."""
    config = getattr(model, "config", None)
    for attr in _CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _parameter_device(model: torch.nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def load_factory(spec: str, *, device: str | torch.device | None = None) -> UserModel:
    """Import `path/to/file.py:factory`, call it (under `torch.device(device)` when given, e.g.
    "meta" for planning) and check what it returned. ValueError, one line, on any bad input."""
    factory, name = import_function(spec, role="model factory", contract=f"that will {CONTRACT}")
    try:
        if device is None:
            result = factory()
        else:
            with torch.device(device):
                result = factory()
    except Exception as exc:
        raise ValueError(f"{name}() raised {type(exc).__name__}: {_first_line(exc)}; fix the "
                         f"factory") from exc
    return user_model(result, name=name)


def import_function(spec: str, *, role: str, contract: str = "") -> tuple[Callable, str]:
    """(the function `path/to/file.py:name` names, "file:name")."""
    path_s, sep, fn_name = spec.rpartition(":")
    if not sep or not path_s or not fn_name:
        raise ValueError(f"{role} {spec!r}: expected 'path/to/file.py:name' (a Python file, "
                         f"a colon, the name of a function in it)")
    path = Path(path_s)
    if not path.is_file():
        raise ValueError(f"{role} file {path_s!r} (from {spec!r}) does not exist; give "
                         f"'path/to/file.py:name'")
    fn = getattr(_import_file(path), fn_name, None)
    if not callable(fn):
        raise ValueError(f"{path_s} has no function {fn_name!r}; define `def {fn_name}(): ...` "
                         f"there{' ' + contract if contract else ''}")
    return fn, f"{path.stem}:{fn_name}"


def _import_file(path: Path) -> Any:
    """Import the user's file as Python runs a script: its folder first on sys.path, so it can
    import its sibling modules (kept there: the factory may import them when it runs)."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"autopar_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"model file {str(path)!r} cannot be imported as Python; give a .py "
                         f"file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"importing {path} raised {type(exc).__name__}: {_first_line(exc)}; "
                         f"fix the file") from exc
    return module


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def user_model(result: Any, *, name: str = "model") -> UserModel:
    """Check a factory's return value against the contract (module docstring)."""
    if isinstance(result, torch.nn.Module):
        return UserModel(model=result, name=name)
    if not isinstance(result, dict):
        kind = type(result).__name__
        hint = " (the old (model, inputs, loss_fn) tuple is now a dict)" \
            if isinstance(result, tuple) else ""
        raise ValueError(f"{name}() returned a {kind}{hint}; {CONTRACT}")
    unknown = sorted(str(k) for k in result if k not in FACTORY_KEYS)
    if unknown:
        raise ValueError(f"{name}() returned a dict with unknown key(s) {unknown}; the keys "
                         f"are {list(FACTORY_KEYS)} (only 'model' is required)")
    model = result.get("model")
    if not isinstance(model, torch.nn.Module):
        got = "no 'model'" if "model" not in result else f"'model' = a {type(model).__name__}"
        raise ValueError(f"{name}() returned a dict with {got}; {CONTRACT} "
                         f"('model' must be a torch.nn.Module)")
    inputs = result.get("example_inputs")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if inputs is not None:
        if not isinstance(inputs, (tuple, list)) or not inputs:
            raise ValueError(f"{name}() returned example_inputs = a {type(inputs).__name__}; "
                             f"give a non-empty tuple of model inputs, e.g. (input_ids,)")
        inputs = tuple(inputs)
    loss_fn = result.get("loss_fn")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"{name}() returned loss_fn = a {type(loss_fn).__name__}; give a "
                         f"function loss_fn(model_output, targets) -> scalar loss")
    return UserModel(model=model, example_inputs=inputs, loss_fn=loss_fn,
                     example_targets=result.get("example_targets"), name=name)

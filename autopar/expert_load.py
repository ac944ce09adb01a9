"""Measure how unevenly a mixture of experts routes a batch of the user's data, on one device.

`measure_expert_load(model, example_inputs)` captures the whole model (passes/capture.py, every
layer), runs the graph on the inputs with its real weights, and reads each MoE layer's `offs`
(the cumulative rows per expert its grouped matmuls group by: passes/expert_parallel.py
`expert_chains`) — what the routers decided for these tokens. The result is an
`autopar.cost.imbalance.ExpertLoad` of measured rows per expert per layer, which the cost model
prices (the most loaded expert rank's GEMMs and all-to-alls). `autopar plan --data FILE` reads
one example batch of tokens from a flat token file and measures it (`load_from_token_file`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autopar.cost.imbalance import ExpertLoad
from autopar.passes.capture import capture
from autopar.passes.expert_chains import expert_bmm_chains
from autopar.passes.expert_parallel import _offs, expert_chains


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, watch: set[fx.Node]):
        super().__init__(gm)
        self.watch, self.seen = watch, {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.watch:
            self.seen[n] = out.detach().to("cpu", torch.float64)
        return out


def measure_expert_load(model: torch.nn.Module, example_inputs: tuple) -> ExpertLoad:
    """Rows routed to each expert of each MoE layer when `model` runs `example_inputs` on one
    device (module docstring). ValueError for a model on the meta device (no weights to route
    with) or without experts."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("measure_expert_load: the model is on the meta device, so its routers "
                         "cannot run; load its weights (or give moe_imbalance=<factor> instead "
                         "of data to measure)")
    gm = capture(model, tuple(example_inputs)).gm
    offs = [_offs(first) for first, _ in expert_chains(gm)]
    if not offs and expert_bmm_chains(gm):
        raise ValueError(f"measure_expert_load: {type(model).__name__}'s experts run every "
                         f"token (batched matmuls, the router's scores as weights), so each "
                         f"expert rank gets the same rows: no imbalance to measure; plan "
                         f"without --data / moe_imbalance")
    if not offs:
        raise ValueError(f"measure_expert_load: {type(model).__name__} has no mixture of "
                         f"experts (no grouped matmul over 3-D expert weights) to measure; "
                         f"plan without --data / moe_imbalance")
    rec = _Recorder(gm, set(offs))
    with torch.no_grad():
        rec.run(*example_inputs)
    counts = []
    for o in offs:
        cum = rec.seen[o].reshape(-1)
        counts.append(tuple(float(x) for x in torch.diff(cum, prepend=cum.new_zeros(1))))
    rows = int(sum(counts[0]))
    return ExpertLoad(counts=tuple(counts),
                      source=f"measured on {rows} routed rows of the user's data per layer")


def check_before_loading(meta_model: torch.nn.Module, path: str | Path,
                         *, host_bytes: int | None = None) -> None:
    """What `autopar plan --data FILE` checks before it loads the model's real weights: the token
    file opens (exists, whole tokens) and the weights fit this host's available memory (the
    routers run on one device). One-line ValueError naming the value, the rule and the fix."""
    from autopar.data import TokenFile
    vocab = getattr(getattr(meta_model, "config", None), "vocab_size", None)
    if not Path(path).is_file():
        raise ValueError(f"--data {str(path)!r}: no such file; give a flat uint16/uint32 token "
                         f"file (nanoGPT's train.bin) to measure the expert load on, or "
                         f"--moe-imbalance <factor>")
    TokenFile(path, vocab_size=vocab or 2 ** 16)
    need = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    if host_bytes is None:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > host_bytes:
        raise ValueError(f"--data {path}: measuring the expert load runs the model's routers on "
                         f"this host with real weights, {need / 2 ** 30:.1f} GiB, more than its "
                         f"{host_bytes / 2 ** 30:.1f} GiB available memory; pass --moe-imbalance "
                         f"<factor> instead, or measure with a smaller configuration of the "
                         f"model (autopar.expert_load.measure_expert_load)")


def load_from_token_file(model: torch.nn.Module, example_inputs: tuple,
                         path: str | Path) -> ExpertLoad:
    """`measure_expert_load` on the first example-shaped batch of token ids in a flat token
    file (autopar.data.TokenFile; the dtype follows the model's config.vocab_size)."""
    from autopar.data import TokenFile
    ids = example_inputs[0] if example_inputs else None
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("--data: the model's first example input is not token ids; measure "
                         "with autopar.expert_load.measure_expert_load(model, inputs) or pass "
                         "--moe-imbalance <factor>")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    tokens = TokenFile(path, vocab_size=vocab)
    if len(tokens) < ids.numel():
        raise ValueError(f"--data {path}: {len(tokens)} tokens, fewer than one example batch "
                         f"({ids.numel()}); give a longer token file")
    batch = tokens.read(0, ids.numel()).reshape(ids.shape).to(ids.dtype)
    return measure_expert_load(model, (batch,) + tuple(example_inputs[1:]))

"""`Runner`: this rank's share of a parallel program, training one optimizer step at a time.

autopar.compile.compile_program builds it from data (the loaded chunks, the LocalParams
table, the optimizer regime, the process groups, this rank's action list); the runtime never
imports the compiler.

Runner.train_step = one optimizer step:
  1. split this data-parallel replica's batch into num_microbatches micro-batches;
  2. regime.zero_grad(); run the schedule's action list (autopar.runtime.executor): the last
     chunk backpropagates loss/m per micro-batch, so the accumulated gradient is that of the
     replica's mean loss. The executor calls the regime's hooks around the actions (GradSync
     arming before a chunk's last backward, per-chunk reduce-scatters at REDUCE, ZeRO-3
     gathers and releases; see autopar.runtime.regimes);
  3. regime.finish(): gradients averaged over d, tied embedding copies summed over the
     embedding group (Megatron's shared embedding);
  4. regime.clip(max_grad_norm): the single-device global norm (autopar.runtime.clip);
  5. regime.step(); return the global mean loss, the same float on every rank.
Under fp16 the backward multipliers carry the loss scale, and between 3 and 4 the scaler
unscales the gradients and checks them over the world: an inf/nan anywhere skips 4 and 5 on
every rank (autopar.runtime.loss_scale); its state rides in the checkpoint's user_state.

full_state_dict() gathers the single-device state dict on rank 0; save_checkpoint /
load_checkpoint store and restore the program under any plan (autopar.runtime.checkpoint);
load_pretrained reads a `transformers` save_pretrained directory (autopar.runtime.pretrained).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from collections import OrderedDict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import all_gather, all_reduce_
from autopar.runtime.context_shard import ContextShard, context_cut
from autopar.runtime.dist import peer_guard
from autopar.runtime.executor import LoadedChunk, PipelineExecutor
from autopar.runtime.loss_scale import STATE_KEY as SCALER_KEY, LossScaler
from autopar.runtime.params import LocalParams, StateDictSpec
from autopar.runtime.pretrained import load_pretrained
from autopar.runtime.regimes import Regime
from autopar.runtime.shard import gather_unshard
from autopar.schedules import Action


class Runner:
    """This rank's chunks, schedule and optimizer regime; see the module docstring."""

    def __init__(self, *, plan: Any, chunks: dict[int, LoadedChunk], params: LocalParams,
                 regime: Regime, groups: Any, actions: Sequence[Action],
                 state_dict: StateDictSpec, device: torch.device,
                 max_grad_norm: float | None = None, record_timeline: bool = False,
                 scaler: LossScaler | None = None, owns_default_group: bool = True):
        """Built by autopar.compile. Why this size: the compiled program's parts (plan, chunks,
        parameters, regime, groups, actions, state-dict spec, device) and its options.
        owns_default_group: compile created the default process group (from torchrun's
        environment), so close() destroys it; a group the caller made stays theirs."""
        self.plan, self.chunks, self.params, self.regime = plan, chunks, params, regime
        self.scaler = scaler     # fp16's dynamic loss scale (autopar.runtime.loss_scale)
        self.pg, self.device = groups, device
        self._owns_default_group = owns_default_group
        # the data-parallel share this rank loads (its context ranks load the same sequences)
        self.dp_rank, self.dp_size = groups.replica_rank, groups.replicas
        self.max_grad_norm = max_grad_norm
        self._state_dict = state_dict
        self.executor = PipelineExecutor(
            chunks=chunks, actions=list(actions), p=groups.p,
            num_microbatches=plan.num_microbatches, pipeline_ranks=groups.pipeline_ranks,
            pp_rank=groups.pp_rank, p2p_group=groups.pipeline, tensor_group=groups.tensor,
            t=groups.t, tp_rank=groups.tp_rank, record=record_timeline,
            before_action=regime.before_action, after_run=regime.after_run)
        self.steps = 0
        self.last_grad_norm: float | None = None   # before clipping, last step
        self.checkpoint_version: Path | None = None   # the version load_checkpoint read
        # the ignore index of this rank's loss chunk, if it holds one and its loss is a token
        # mean (found once: the same every step)
        last = [ch for ch in chunks.values() if ch.returns_loss]
        self._ignore_index = last[0].loss_ignore_index if last else None

    # ---- training -----------------------------------------------------------------------
    def train_step(self, inputs: Any, targets: torch.Tensor) -> float:
        """One optimizer step on this replica's share; the global mean loss (same everywhere)."""
        mbs = self._microbatches(inputs, targets)
        scales = self._loss_scales(mbs[0][-1].device, targets)
        self.regime.zero_grad()
        losses = self.executor.run(mbs, self._backward_scales(scales))
        self.regime.finish()
        # fp16: unscale; an inf/nan on any rank skips the step on every rank
        if self.scaler is None or self.scaler.unscale(self.regime.optimizer, self.pg.world):
            if self.max_grad_norm is not None:   # the norm before clipping, for the log
                self.last_grad_norm = float(self.regime.clip(self.max_grad_norm))
            self.regime.step()
        if self.scaler is not None:
            self.scaler.update()
        self.steps += 1
        return self._global_loss(losses, scales)

    def eval_loss(self, inputs: Any, targets: torch.Tensor) -> float:
        """The global mean loss of a batch, weights and optimizer state untouched: the
        schedule's forwards alone under no_grad (PipelineExecutor.run_forward). ZeRO-2/3
        gather each chunk's weights in the regime's hooks, planned for the whole step, so there
        this runs the step's forward and backward and discards the gradients (~3x a forward)."""
        mbs = self._microbatches(inputs, targets)
        scales = self._loss_scales(mbs[0][-1].device, targets)
        if self.plan.zero <= 1:
            return self._global_loss(self.executor.run_forward(mbs), scales)
        self.regime.zero_grad()
        losses = self.executor.run(mbs, scales)
        self.regime.finish()          # overlapped reductions complete before the grads go
        self.regime.zero_grad()
        return self._global_loss(losses, scales)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This rank's optimizer (its param_groups carry the learning rate)."""
        return self.regime.optimizer

    def _loss_scales(self, device: torch.device, targets: torch.Tensor) -> list[float] | None:
        """Each micro-batch's backward scale when the loss is a token mean (the last chunk's
        LOSS_IGNORE_INDEX): d·M_i/N, M_i the targets micro-batch i counts (its whole
        sequences: under c each context rank's loss is already their token mean), N the global
        batch's count (all-reduced over the c·d ranks, each replica counted by its c context
        ranks). Averaged over the c·d ranks the step's loss is then the single device's mean
        over every counted token, however unevenly ignored targets fall between micro-batches
        and replicas (1/m each when they count alike). None: another loss (1/m each)."""
        if self._ignore_index is None:
            return None
        m = self.plan.num_microbatches
        counted = (targets.to(device).reshape(m, -1) != self._ignore_index).sum(1)
        total = counted.sum().to(torch.float64)       # a scalar, like the loss's reduction
        if self.pg.d > 1:
            all_reduce_(total, self.pg.data)
        total = float(total) / self.pg.c
        return [self.pg.replicas * float(k) / total if total else float("nan")
                for k in counted.tolist()]

    def _backward_scales(self, scales: list[float] | None) -> list[float] | None:
        """What each micro-batch's loss is multiplied by before its backward: its share of the
        step's loss (default 1/m), times the loss scale under fp16."""
        if self.scaler is None:
            return scales
        m = self.plan.num_microbatches
        return self.scaler.scaled(scales if scales is not None else [1.0 / m] * m)

    def _microbatches(self, inputs: Any, targets: torch.Tensor) -> list[tuple]:
        plan = self.plan
        xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        share = plan.micro_batch_size * plan.num_microbatches
        for name, x in [(f"inputs[{k}]", x) for k, x in enumerate(xs)] + [("targets", targets)]:
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != share:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"train_step: {name} has shape {got}; each data-parallel replica takes "
                    f"global_batch_size/d = {plan.global_batch_size}/{plan.d} = {share} "
                    f"sequences (micro_batch_size {plan.micro_batch_size} × "
                    f"{plan.num_microbatches} micro-batches); pass rows "
                    f"[{share}·dp_rank, {share}·(dp_rank+1)) of the global batch")
        xs = tuple(x.to(self.device) for x in xs)
        targets = targets.to(self.device)
        if self.pg.c > 1:   # this context rank's tokens: chunks i and 2c-1-i of every sequence
            cp = ContextShard(group=self.pg.context, c=self.pg.c, cp_rank=self.pg.cp_rank,
                              seq_len=plan.seq_len)
            xs = tuple(x if _whole_mask(x, plan.seq_len) else context_cut(x, cp) for x in xs)
            targets = context_cut(targets, cp)
        b = plan.micro_batch_size
        return [tuple(x[i * b:(i + 1) * b] for x in xs) + (targets[i * b:(i + 1) * b],)
                for i in range(plan.num_microbatches)]

    def _global_loss(self, losses: list[torch.Tensor], scales: list[float] | None) -> float:
        value = torch.zeros((), dtype=torch.float64)
        if losses:
            scales = scales or [1.0 / len(losses)] * len(losses)
            # a micro-batch that counts no token (scale 0) adds nothing, not its 0/0 mean
            value += sum(x.double().cpu() * w for x, w in zip(losses, scales) if w != 0)
        if self.pg.p > 1:
            all_reduce_(value, self.pg.pipeline)  # only the last stage contributes
        if self.pg.d > 1:
            all_reduce_(value, self.pg.data)
            value /= self.pg.d
        return float(value)

    # ---- inspection ---------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's local parameters (shards when t > 1), each once. Under zero=3 the
        chunk weights are released between steps (0-byte storage): read full_state_dict()."""
        return list(self.params.tensors.values())

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.params.tensors.items())

    def record_timeline(self, on: bool = True) -> None:
        """Record (pipeline rank, action, start_s, end_s) per action in `runner.timeline`."""
        self.executor.record = on

    @property
    def timeline(self) -> list[tuple[int, str, float, float]]:
        return list(self.executor.events)

    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's optimizer-state tensors (Adam's m, v, ...; 1/d under ZeRO-1)."""
        return self.regime.state_bytes()

    # ---- weights and checkpoints ----------------------------------------------------------
    def full_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The single-device model's state dict (user keys, tied weights under every name,
        fp32 master values under bf16), gathered on global rank 0; other ranks return an empty
        dict. Collective: all ranks call it."""
        weights = self.regime.fp32_weights()
        local: dict[str, torch.Tensor] = {}
        experts = sorted(q for q, info in self.params.infos.items() if info.expert)
        if self.pg.dp_rank < self.pg.ep:   # the first expert group: every expert once
            for q in experts:                 # the same order on every rank of the group
                local[q] = _gather_experts(weights[q].detach().cpu(), self.pg.expert)
        if self.pg.dp_rank == 0:
            for ch in self.chunks.values():
                for qual, *_ in ch.module.PARAMETERS.values():
                    if qual not in local:
                        local[qual] = weights[qual].detach().cpu().clone()
                for attr, (qual, *_) in ch.module.BUFFERS.items():
                    local[qual] = getattr(ch.net, attr).detach().cpu().clone()
            for qual in sorted(local):   # the same order on every rank of the tensor group
                if qual in self.params.splits and self.pg.t > 1:
                    split, full = self.params.splits[qual]
                    local[qual] = gather_unshard(local[qual], split, full, self.pg.tensor)
        send = local if (self.pg.dp_rank == 0 and self.pg.tp_rank == 0) else None
        parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(send, parts, dst=0)
        if dist.get_rank() != 0:
            return OrderedDict()
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            if part:
                merged.update(part)
        return self._state_dict.assemble(merged)

    def save_checkpoint(self, path: str | os.PathLike, *, user_state: dict | None = None,
                        keep: int = 1, async_save: bool = False) -> None:
        """Save weights (fp32 masters under bf16), optimizer state and step to `path`,
        atomically (see autopar.runtime.checkpoint), under every plan and ZeRO level: each
        rank writes the pieces it holds. user_state: JSON-serialisable state of the training
        loop (e.g. the data's read position, autopar.data), rank 0's committed with the
        tensors; read it back with autopar.runtime.checkpoint.read_user_state(path). keep:
        the newest versions kept (a load falls back to an older one when the newest is
        damaged). async_save: returns once the pieces are copied to shared host memory; a
        background process of this rank writes and commits them (the next save, a load and close() wait for it).
        Collective: every rank calls it."""
        # imported here (and by load_checkpoint): the checkpoint module loads
        # torch.distributed.checkpoint (~1 s a process), which a run that never saves or
        # resumes does not need
        from autopar.runtime.checkpoint import save_program_checkpoint
        if self.scaler is not None:   # the same on every rank: rank 0's is saved
            user_state = {**(user_state or {}), SCALER_KEY: self.scaler.state_dict()}
        save_program_checkpoint(path, self.params, self.regime, self.pg, self.steps,
                                self.plan.to_json(), user_state, keep=keep,
                                async_save=async_save)

    def wait_for_checkpoint(self) -> None:
        """Block until this rank's background save (if any) is committed."""
        from autopar.runtime.checkpoint import wait_for_save
        wait_for_save()

    def load_checkpoint(self, path: str | os.PathLike, *, weights_only: bool = False) -> int:
        """Load a checkpoint saved under this or any other plan (other t, p, d, v, zero,
        schedule, precision); return its step count. weights_only: load the weights alone —
        the optimizer state is not read and the runner's step count is left as it is (start
        a fine-tune from a trained checkpoint). Keys and full shapes must match this model's:
        otherwise ValueError naming them, on every rank. Collective: every rank calls it."""
        from autopar.runtime.checkpoint import load_program_version, read_user_state
        step, self.checkpoint_version = load_program_version(
            path, self.params, self.regime, self.pg, weights_only=weights_only)
        if not weights_only:
            self.steps = step
            scaler_state = read_user_state(self.checkpoint_version or path).get(SCALER_KEY)
            if self.scaler is not None and scaler_state:   # (none from an fp32/bf16 run)
                self.scaler.load_state_dict(scaler_state)
        return step

    def load_pretrained(self, path: str | os.PathLike) -> None:
        """Load the weights of a `transformers` `save_pretrained` directory (safetensors, one
        file or sharded with model.safetensors.index.json), each rank reading only the slices
        it holds; keys are those of full_state_dict(). The optimizer state stays empty and the
        step count unchanged (see autopar.runtime.pretrained). Collective: every rank calls it."""
        load_pretrained(path, self.params, self.regime, self.pg)

    def release_groups(self) -> None:
        """Destroy the process groups this runner made (not the default group), ending the
        runner but not the job: what `autopar tune` does with a measured candidate on a GPU
        before compiling the next. Collective: every rank calls it at the same point."""
        with peer_guard("the releasing barrier with", self.pg.world):
            dist.barrier(group=self.pg.world)
        self.pg.destroy_subgroups()

    def close(self) -> None:
        """End the job on this rank: wait for every rank, then destroy the process groups if
        autopar created the default one (a default group the caller made before compile stays
        up, with the subgroups autopar added: the caller's destroy_process_group ends them).
        Collective: every rank calls it once, after its last step. The barrier keeps any rank
        from exiting while a peer is still in its last step's collectives or p2p messages (a
        peer that vanishes mid-exchange is a failure of the job); a dead rank is a PeerError."""
        if not dist.is_initialized():
            return
        ckpt = sys.modules.get("autopar.runtime.checkpoint")   # imported by a save or a load
        if ckpt is not None:   # (without one, no writer was started)
            ckpt.close_writer()
        with peer_guard("the closing barrier with", self.pg.world):
            dist.barrier(group=self.pg.world)
        if self._owns_default_group:
            dist.destroy_process_group()


def _whole_mask(x: torch.Tensor, seq_len: int) -> bool:
    """A (B, 1 or heads, T, T) attention mask input (packed documents' block mask): every
    context rank takes it whole and the graph selects its query rows (the sharding engine
    seeds an input split only where its dim 1 is the sequence)."""
    return x.dim() == 4 and tuple(x.shape[2:]) == (seq_len, seq_len) and x.shape[1] != seq_len


def _gather_experts(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The experts of every rank of the expert `group`, concatenated along dim 0 in its rank
    order (rank e holds experts [e·E/ep, (e+1)·E/ep)). Collective over `group`."""
    return all_gather(local, 0, group)

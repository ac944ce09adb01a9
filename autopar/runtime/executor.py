"""Interpret one pipeline rank's action list (autopar.schedules) on the generated chunk modules.

Per step the executor runs, in order, the actions of this rank:
  F c.i      forward of chunk c on micro-batch i; its inputs are chunk c-1's outputs (received
             by RECV_F, or handed over locally when chunk c-1 is on this rank) followed by the
             model inputs / targets the chunk reads; outputs and inputs are kept for backward.
  B c.i      torch.autograd.backward of chunk c's outputs with the gradients chunk c+1 sent
             (the last chunk backpropagates loss / num_microbatches); the gradients of its
             received inputs are kept for SEND_B or handed to chunk c-1 locally.
  SEND_F / RECV_F / SEND_B / RECV_B   blocking send/recv (never batch_isend_irecv: it hangs on
             gloo). With t > 1 each tensor rank sends 1/t of a boundary tensor (they are
             replicated over the tensor group) and the receiver all-gathers over the tensor group
             (the scatter/gather optimisation of 2104.04473 §4.1).
  REDUCE c   no-op here: the runner reduces data-parallel gradients after the schedule.

Gradients accumulate in the parameters over the micro-batches; the caller zeroes them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import recv_tensor, send_tensor
from autopar.schedules import Action


@dataclass
class LoadedChunk:
    """A generated chunk module instantiated on this rank, with its boundary description."""
    index: int
    module: Any                      # the generated Python module (source executed)
    net: torch.nn.Module             # instance of module.CHUNK_CLASS with parameters attached
    recv: list[tuple]                # (name, shape, dtype, requires_grad) from module.RECV
    send: list[tuple]
    model_inputs: list[int]
    returns_loss: bool

    @classmethod
    def from_module(cls, index: int, module: Any, net: torch.nn.Module) -> "LoadedChunk":
        return cls(index=index, module=module, net=net, recv=list(module.RECV),
                   send=list(module.SEND), model_inputs=list(module.MODEL_INPUTS),
                   returns_loss=bool(module.RETURNS_LOSS))


@dataclass
class _Stash:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


@dataclass
class PipelineExecutor:
    """Runs one rank's schedule. `pipeline_ranks[q]` is the global rank of pipeline rank q."""
    chunks: dict[int, LoadedChunk]
    actions: Sequence[Action]
    p: int
    num_microbatches: int
    pipeline_ranks: Sequence[int]
    pp_rank: int
    p2p_group: Any = None
    tensor_group: Any = None
    t: int = 1
    tp_rank: int = 0
    record: bool = False
    async_send: bool = True
    events: list[tuple[int, str, float, float]] = field(default_factory=list)

    def run(self, microbatches: Sequence[tuple]) -> list[torch.Tensor]:
        """Execute the action list on `microbatches` (each (*inputs, targets)); return the
        detached per-micro-batch losses (empty unless this rank holds the last chunk)."""
        self._mbs = microbatches
        self._stash: dict[tuple[int, int], _Stash] = {}
        self._fwd_in: dict[tuple[int, int], list[torch.Tensor]] = {}   # keyed by producer
        self._bwd_in: dict[tuple[int, int], list[torch.Tensor]] = {}   # keyed by producer
        self._bwd_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._pending: list[tuple[Any, torch.Tensor, int]] = []
        self.events = []
        handlers = {"F": self._forward, "B": self._backward, "SEND_F": self._send_f,
                    "RECV_F": self._recv_f, "SEND_B": self._send_b, "RECV_B": self._recv_b,
                    "REDUCE": lambda a: None}
        for action in self.actions:
            start = time.time()
            handlers[action.kind](action)
            if self.record:
                self.events.append((self.pp_rank, str(action), start, time.time()))
        self._wait_sends()
        if self._stash or self._fwd_in or self._bwd_in or self._bwd_out:
            left = sorted(set(self._stash) | set(self._fwd_in) | set(self._bwd_in)
                          | set(self._bwd_out))
            raise RuntimeError(f"executor: the schedule left (chunk, micro-batch) state "
                               f"{left} unused on pipeline rank {self.pp_rank}; the action "
                               f"list is incomplete")
        return [self._losses[i] for i in sorted(self._losses)]

    # ---- compute ------------------------------------------------------------------------
    def _local(self, chunk: int) -> bool:
        return chunk in self.chunks

    def _forward(self, a: Action) -> None:
        ch = self.chunks[a.chunk]
        received = self._fwd_in.pop((a.chunk - 1, a.mb), []) if ch.recv else []
        inputs = []
        for x, spec in zip(received, ch.recv):
            x = x.detach()
            inputs.append(x.requires_grad_(True) if spec[3] else x)
        mb = self._mbs[a.mb]
        out = ch.net(*inputs, *(mb[k] for k in ch.model_inputs))
        outputs = [out] if ch.returns_loss else list(out)
        if ch.returns_loss:
            self._losses[a.mb] = out.detach()
        self._stash[(a.chunk, a.mb)] = _Stash(inputs, outputs)
        if not ch.returns_loss and self._local(a.chunk + 1):
            self._fwd_in[(a.chunk, a.mb)] = [o.detach() for o in outputs]

    def _backward(self, a: Action) -> None:
        ch = self.chunks[a.chunk]
        st = self._stash.pop((a.chunk, a.mb))
        if ch.returns_loss:
            torch.autograd.backward(st.outputs[0] / self.num_microbatches)
        else:
            grads = self._bwd_in.pop((a.chunk + 1, a.mb))
            pairs = [(o, g) for o, g in zip((o for o, s in zip(st.outputs, ch.send) if s[3]),
                                            grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        in_grads = [x.grad if x.grad is not None else torch.zeros_like(x)
                    for x, spec in zip(st.inputs, ch.recv) if spec[3]]
        if a.chunk > 0:
            if self._local(a.chunk - 1):
                self._bwd_in[(a.chunk, a.mb)] = in_grads
            else:
                self._bwd_out[(a.chunk, a.mb)] = in_grads

    # ---- communication ------------------------------------------------------------------
    def _wait_sends(self) -> None:
        from autopar.runtime.collectives import _peer_guard
        for work, _buf, dst in self._pending:
            with _peer_guard(f"send to rank {dst}", self.p2p_group, [dst]):
                work.wait()
        self._pending = []

    def _scatter(self, spec: tuple, numel: int) -> bool:
        """Send 1/t per tensor rank? Only for values replicated over the tensor group."""
        replicated = spec[4] if len(spec) > 4 else True
        return self.t > 1 and replicated and numel % self.t == 0

    def _send(self, tensors: Sequence[torch.Tensor], specs: Sequence[tuple], peer: int) -> None:
        dst = self.pipeline_ranks[peer]
        for x, spec in zip(tensors, specs):
            x = x.detach().contiguous()
            if self._scatter(spec, x.numel()):
                x = x.reshape(-1).chunk(self.t)[self.tp_rank]   # this rank's 1/t slice
            if self.async_send:
                # isend: the sender never blocks (a weaker requirement than the schedule's
                # rendezvous order, so still deadlock-free); completed at the end of the step.
                self._pending.append((dist.isend(x, dst=dst, group=self.p2p_group), x, dst))
            else:
                send_tensor(x, dst, self.p2p_group)

    def _recv(self, specs: Sequence[tuple], peer: int) -> list[torch.Tensor]:
        src = self.pipeline_ranks[peer]
        out = []
        for spec in specs:
            shape, dt = spec[1], getattr(torch, spec[2])
            numel = 1
            for s in shape:
                numel *= s
            if self._scatter(spec, numel):
                part = recv_tensor((numel // self.t,), dt, src, self.p2p_group)
                full = part.new_empty((numel,))
                dist.all_gather_into_tensor(full, part, group=self.tensor_group)
                out.append(full.view(shape))
            else:
                out.append(recv_tensor(tuple(shape), dt, src, self.p2p_group))
        return out

    def _send_f(self, a: Action) -> None:
        self._send(self._stash[(a.chunk, a.mb)].outputs, self.chunks[a.chunk].send, a.peer)

    def _recv_f(self, a: Action) -> None:
        self._fwd_in[(a.chunk, a.mb)] = self._recv(self.chunks[a.chunk + 1].recv, a.peer)

    def _send_b(self, a: Action) -> None:
        specs = [s for s in self.chunks[a.chunk].recv if s[3]]
        self._send(self._bwd_out.pop((a.chunk, a.mb)), specs, a.peer)

    def _recv_b(self, a: Action) -> None:
        specs = [s for s in self.chunks[a.chunk - 1].send if s[3]]
        self._bwd_in[(a.chunk, a.mb)] = self._recv(specs, a.peer)

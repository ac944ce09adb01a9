"""Interpret one pipeline rank's action list (autopar.schedules) on the generated chunk modules.

Per step the executor runs, in order, the actions of this rank:
  F c.i      forward of chunk c on micro-batch i; its inputs are chunk c-1's outputs (received,
             or handed over locally when chunk c-1 is on this rank) followed by the model
             inputs / targets the chunk reads; outputs and inputs are kept for backward.
  B c.i      torch.autograd.backward of chunk c's outputs with the gradients chunk c+1 sent
             (the last chunk backpropagates loss × its micro-batch's scale, 1/num_microbatches
             unless the Runner weighs micro-batches by their counted tokens); the gradients of its
             received inputs are kept for SEND_B or handed to chunk c-1 locally.
  SEND_F / SEND_B   dist.isend (the sender never blocks); a send is forgotten once complete, all
             are waited for at the end of the step. With `async_send` (default) a compute's
             send is issued right after that compute, wherever the list places the SEND (the
             lists place messages for rendezvous semantics by equal chunk times; on an uneven
             cut that can be a compute later, which the consumer then waits for; torch's
             pipelining also sends right after the compute); the SEND action itself then only
             runs its hook (eager_send=False keeps each send at its place: an ablation).
             After SEND_F the sent outputs' data is freed (`release_data`, Megatron-LM's
             deallocate_output_tensor; not for split backwards): their backward needs only
             their grad_fn (`backward_from`).
  RECV_F / RECV_B   with `async_recv` (default) the receive is a dist.irecv into a fresh
             buffer, posted `prefetch` actions before the RECV action (RECV_PREFETCH; None:
             every receive of the step is posted when the step starts), so gloo moves the
             bytes while this rank computes; the buffer is freed with its last use (the
             consuming chunk's backward for an activation); the wait happens where the message
             is first needed, right before the F/B that consumes it, and is what the timeline
             records as the RECV event. With async_recv=False, RECV is a blocking recv at its
             place in the list. Never batch_isend_irecv: it hangs on gloo. Each message has its
             own tag (direction, chunk, micro-batch), so matching never depends on post order.
             With t > 1 each tensor rank sends 1/t of a boundary tensor (they are replicated
             over the tensor group) and the receiver all-gathers over the tensor group after the
             wait (the scatter/gather optimisation of 2104.04473 §4.1).
  W c.i      weight gradients of chunk c on micro-batch i. A list that has W c.i splits that
             backward (zero-bubble schedules, 2401.10241): B c.i then computes only the
             gradients of the received inputs (what chunk c-1 waits for) and records where the
             weights' branches join that path; W c.i resumes from there down to the weights
             (autopar/runtime/split_backward.py: together one backward's work, and gradients
             still accumulate through AccumulateGrad, so the runner's hooks see them).
  REDUCE c   no-op here: the runner's data-parallel reduction is driven by the hooks below.

Hooks (how the runner attaches data-parallel work to the schedule without special cases here):
`before_action(n, action)` runs before actions[n] (before its receive is waited for, outside
its recorded interval) — GradSync arming before a chunk's last B, ZeRO-3 gathers / releases /
reduce-scatters and the wait for a chunk's weights before its F/B; `after_run()` runs after
the last action, before the step's sends are completed.

Deadlock freedom: sends never block and every receive is posted no later than its RECV action,
so a rank only ever waits for a message whose send its peer reaches before needing anything
from this rank at a later point of the global message order (autopar.schedules), which is what
`validate` checks under the stricter rendezvous semantics.

Gradients accumulate in the parameters over the micro-batches; the caller zeroes them.
cost/simulate.py, comm="irecv" (async_recv) or comm="isend" (async_recv=False), times this.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autopar.runtime.dist import peer_guard
from autopar.runtime.split_backward import backward_input, backward_weight
from autopar.schedules import Action, eager_sends


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
    loss_ignore_index: int | None = None   # a token-mean loss's ignored target (module's)
    send_kept: tuple[int, ...] = ()   # sends the chunk also reads: their data stays (SEND_KEPT)

    @classmethod
    def from_module(cls, index: int, module: Any, net: torch.nn.Module) -> "LoadedChunk":
        return cls(index=index, module=module, net=net, recv=list(module.RECV),
                   send=list(module.SEND), model_inputs=list(module.MODEL_INPUTS),
                   returns_loss=bool(module.RETURNS_LOSS),
                   loss_ignore_index=getattr(module, "LOSS_IGNORE_INDEX", None),
                   send_kept=tuple(getattr(module, "SEND_KEPT", ())))


@dataclass
class _Stash:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    released: bool = False   # the outputs' data freed once sent (release_data)


def release_data(outputs: Sequence[torch.Tensor], kept: Sequence[int] = ()) -> bool:
    """Free the data of a chunk's sent outputs (Megatron-LM's deallocate_output_tensor, what
    Llama 3 did): backward needs only their grad_fn, and the send holds its own reference until
    it completes. Outputs that are views or leaves keep their data, and so do those at `kept`
    (the chunk's own nodes read them: autograd may have saved them). True if any was freed."""
    freed = False
    for i, o in enumerate(outputs):
        if o.grad_fn is not None and o._base is None and o.numel() > 1 and i not in kept:
            o.data = torch.empty((1,), dtype=o.dtype, device=o.device)
            freed = True
    return freed


def backward_from(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """torch.autograd.backward without its shape check of outputs against gradients, which
    outputs freed by release_data fail (Megatron-LM's custom_backward: the engine directly)."""
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=tuple(outputs), grad_tensors=tuple(grads), keep_graph=False,
        create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True)


@dataclass
class _Posted:
    """An in-flight receive: one irecv per tensor of the message, into reused buffers."""
    action: Action
    works: list[Any]
    bufs: list[torch.Tensor]          # what arrives (1/t slices where scattered)
    full: list[torch.Tensor | None]   # all-gather target where scattered, else None


# Actions ahead of its RECV at which a receive is posted: enough to overlap the transfer with
# the computes before it (a rank's list alternates computes and messages), few enough that a
# stage holds the buffers of the messages it is about to use, not of the whole step's.
RECV_PREFETCH = 8


def _message_tag(a: Action) -> int:
    """A gloo tag per message (> 0; tag 0 stays free for other p2p users of the group)."""
    return 1 + 2 * (a.chunk + 4096 * a.mb) + (a.kind[-1] == "B")


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
    async_recv: bool = True
    eager_send: bool = True       # async_send: each send right after its compute (ablation)
    prefetch: int | None = RECV_PREFETCH
    before_action: Callable[[int, Action], None] | None = None
    after_run: Callable[[], None] | None = None
    events: list[tuple[int, str, float, float]] = field(default_factory=list)
    _forward_only: bool = field(default=False, init=False)   # run_forward in progress

    def run(self, microbatches: Sequence[tuple],
            loss_scales: Sequence[float] | None = None) -> list[torch.Tensor]:
        """Execute the action list on `microbatches` (each (*inputs, targets)); return the
        detached per-micro-batch losses (empty unless this rank holds the last chunk).
        loss_scales: what each micro-batch's loss is multiplied by before its backward
        (default 1/num_microbatches each)."""
        self._mbs = microbatches
        self._scales = (list(loss_scales) if loss_scales is not None
                        else [1.0 / self.num_microbatches] * len(microbatches))
        self._stash: dict[tuple[int, int], _Stash] = {}
        self._fwd_in: dict[tuple[int, int], list[torch.Tensor]] = {}   # keyed by producer
        self._bwd_in: dict[tuple[int, int], list[torch.Tensor]] = {}   # keyed by producer
        self._bwd_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._pending: list[tuple[Any, torch.Tensor, int]] = []
        self._posted: dict[tuple[str, int, int], _Posted] = {}
        self._weights_due: dict[tuple[int, int], Any] = {}   # B done, W pending
        self.events = []
        handlers = {"F": self._forward, "B": self._backward, "W": self._weight,
                    "SEND_F": self._send_f,
                    "RECV_F": self._recv_f, "SEND_B": self._send_b, "RECV_B": self._recv_b,
                    "REDUCE": _noop}
        actions = self.actions
        recvs, self._split, eager = self._list_facts()
        ahead = recvs if self.async_recv else []
        eager = eager if self.async_send and self.eager_send else {}
        early = set(eager.values())
        nxt, L = 0, len(actions) if self.prefetch is None else self.prefetch
        record, events, pp = self.record, self.events, self.pp_rank
        clock = time.time
        before = self.before_action
        for n, action in enumerate(actions):
            if before is not None:
                before(n, action)
            while nxt < len(ahead) and ahead[nxt] <= n + L:
                self._post(actions[ahead[nxt]])
                nxt += 1
            if action.kind in _NEEDS and self._posted:
                self._ready(action)     # wait outside the compute's recorded interval
            self._reap_sends()
            if n in early:
                continue                # sent right after its compute (eager)
            start = clock()
            handlers[action.kind](action)
            if record and not (self.async_recv and action.kind[:4] == "RECV"):
                events.append((pp, str(action), start, clock()))
            if n in eager:
                send, start = actions[eager[n]], clock()
                handlers[send.kind](send)
                if record:
                    events.append((pp, str(send), start, clock()))
        if self.after_run is not None:
            self.after_run()
        self._wait_sends()
        if (self._stash or self._fwd_in or self._bwd_in or self._bwd_out or self._posted
                or self._weights_due):
            left = sorted(set(self._stash) | set(self._fwd_in) | set(self._bwd_in)
                          | set(self._bwd_out) | {k[1:] for k in self._posted}
                          | set(self._weights_due))
            raise RuntimeError(f"executor: the schedule left (chunk, micro-batch) state "
                               f"{left} unused on pipeline rank {self.pp_rank}; the action "
                               f"list is incomplete")
        return [self._losses[i] for i in sorted(self._losses)]

    def run_forward(self, microbatches: Sequence[tuple]) -> list[torch.Tensor]:
        """The action list's forwards alone, under no_grad: its F, SEND_F and RECV_F actions in
        their order (a subsequence of a deadlock-free list whose sends never block is one too),
        nothing stashed for a backward, no regime hooks (the weights must be whole on the rank:
        zero <= 1). The per-micro-batch losses, as run() returns them (an evaluation)."""
        keep = ("F", "SEND_F", "RECV_F")
        saved = (self.actions, self.before_action, self.after_run)
        self.actions = [a for a in self.actions if a.kind in keep]
        self.before_action = self.after_run = None
        self._forward_only = True
        try:
            with torch.no_grad():
                return self.run(microbatches)
        finally:
            self.actions, self.before_action, self.after_run = saved
            self._forward_only = False

    def _list_facts(self) -> tuple[list[int], frozenset[tuple[int, int]], dict[int, int]]:
        """Of the action list, cached while it is unchanged: the positions of its RECV actions,
        the (chunk, micro-batch) whose backward it splits into B and W, and for each F / B
        whose SEND comes later, the SEND's position (`eager_sends`)."""
        key = tuple(self.actions)
        if getattr(self, "_facts_key", None) != key:
            self._facts_key = key
            self._facts = ([n for n, a in enumerate(key) if a.kind[:4] == "RECV"],
                           frozenset((a.chunk, a.mb) for a in key if a.kind == "W"),
                           eager_sends(key))
        return self._facts

    # ---- compute ------------------------------------------------------------------------
    def _local(self, chunk: int) -> bool:
        return chunk in self.chunks

    def _forward(self, a: Action) -> None:
        ch = self.chunks[a.chunk]
        inputs = []
        if ch.recv:
            received = self._take(self._fwd_in, ("F", a.chunk - 1, a.mb))
            for x, spec in zip(received, ch.recv):
                x = x.detach()
                inputs.append(x.requires_grad_(True) if spec[3] else x)
        mb = self._mbs[a.mb]
        out = ch.net(*inputs, *(mb[k] for k in ch.model_inputs))
        outputs = [out] if ch.returns_loss else list(out)
        if ch.returns_loss:
            self._losses[a.mb] = out.detach()
        if not (self._forward_only and (ch.returns_loss or self._local(a.chunk + 1))):
            self._stash[(a.chunk, a.mb)] = _Stash(inputs, outputs)   # for SEND_F and B
        if not ch.returns_loss and self._local(a.chunk + 1):
            self._fwd_in[(a.chunk, a.mb)] = [o.detach() for o in outputs]

    def _backward(self, a: Action) -> None:
        ch = self.chunks[a.chunk]
        st = self._stash.pop((a.chunk, a.mb))
        if ch.returns_loss:
            outs, grads = [st.outputs[0] * self._scales[a.mb]], [None]
        else:
            got = self._take(self._bwd_in, ("B", a.chunk + 1, a.mb))
            pairs = [(o, g) for o, g in zip((o for o, s in zip(st.outputs, ch.send) if s[3]),
                                            got) if o.requires_grad]
            outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
        if (a.chunk, a.mb) in self._split:
            self._weights_due[(a.chunk, a.mb)] = backward_input(
                outs, grads, st.inputs, list(ch.net.parameters()))
        elif outs and st.released:
            backward_from(outs, grads)
        elif outs:
            torch.autograd.backward(outs, grads)
        in_grads = [x.grad if x.grad is not None else torch.zeros_like(x)
                    for x, spec in zip(st.inputs, ch.recv) if spec[3]]
        if a.chunk > 0:
            if self._local(a.chunk - 1):
                self._bwd_in[(a.chunk, a.mb)] = in_grads
            else:
                self._bwd_out[(a.chunk, a.mb)] = in_grads

    def _weight(self, a: Action) -> None:
        work = self._weights_due.pop((a.chunk, a.mb), None)
        if work is None:
            raise RuntimeError(f"executor: W{a.chunk}.{a.mb} on pipeline rank {self.pp_rank} "
                               f"before its B; the action list is out of dependency order")
        backward_weight(work)

    def _ready(self, a: Action) -> None:
        """Wait for the received message the compute `a` consumes, if one is in flight."""
        msg = ("F", a.chunk - 1, a.mb) if a.kind == "F" else ("B", a.chunk + 1, a.mb)
        posted = self._posted.pop(msg, None)
        if posted is not None:
            local = self._fwd_in if a.kind == "F" else self._bwd_in
            local[msg[1:]] = self._wait_recv(posted)

    def _take(self, local: dict, msg: tuple[str, int, int]) -> list[torch.Tensor]:
        """A message's tensors: handed over locally, received, or waited for now."""
        got = local.pop(msg[1:], None)
        if got is not None:
            return got
        posted = self._posted.pop(msg, None)
        if posted is None:
            raise RuntimeError(f"executor: pipeline rank {self.pp_rank} needs message "
                               f"{msg[0]}{msg[1]}.{msg[2]} but its RECV action has not run; "
                               f"the action list is out of dependency order")
        return self._wait_recv(posted)

    # ---- communication ------------------------------------------------------------------
    def _wait_sends(self) -> None:
        for work, _buf, dst in self._pending:
            with peer_guard(f"send to rank {dst}", self.p2p_group, [dst]):
                work.wait()
        self._pending = []

    def _reap_sends(self) -> None:
        """Forget the sends that completed, so their buffers (a freed output's only remaining
        reference) go now rather than at the end of the step."""
        if self._pending and any(w.is_completed() for w, _, _ in self._pending):
            done = [(w, b, dst) for w, b, dst in self._pending if w.is_completed()]
            for work, _buf, dst in done:
                with peer_guard(f"send to rank {dst}", self.p2p_group, [dst]):
                    work.wait()                 # completed: surfaces a failure, never blocks
            self._pending = [x for x in self._pending if not x[0].is_completed()]

    def _scatter(self, spec: tuple, numel: int) -> bool:
        """Send 1/t per tensor rank? Only for values replicated over the tensor group."""
        replicated = spec[4] if len(spec) > 4 else True
        return self.t > 1 and replicated and numel % self.t == 0

    def _send(self, a: Action, tensors: Sequence[torch.Tensor], specs: Sequence[tuple]) -> None:
        dst = self.pipeline_ranks[a.peer]
        tag = _message_tag(a)
        for x, spec in zip(tensors, specs):
            x = x.detach()
            if not x.is_contiguous():
                x = x.contiguous()
            if self._scatter(spec, x.numel()):
                x = x.reshape(-1).chunk(self.t)[self.tp_rank]   # this rank's 1/t slice
            if self.async_send:
                # isend: the sender never blocks (a weaker requirement than the schedule's
                # rendezvous order, so still deadlock-free); completed at the end of the step.
                with peer_guard("send to", self.p2p_group, [dst]):
                    work = dist.isend(x, dst=dst, group=self.p2p_group, tag=tag)
                self._pending.append((work, x, dst))
            else:
                with peer_guard("send to", self.p2p_group, [dst]):
                    dist.send(x, dst=dst, group=self.p2p_group, tag=tag)

    def _specs(self, a: Action) -> list[tuple]:
        if a.kind[-1] == "F":
            return self.chunks[a.chunk + 1].recv
        return [s for s in self.chunks[a.chunk - 1].send if s[3]]

    def _post(self, a: Action) -> None:
        """Post the irecvs of message `a` (a RECV action) into this executor's buffers."""
        src = self.pipeline_ranks[a.peer]
        tag = _message_tag(a)
        works, bufs, full = [], [], []
        for k, spec in enumerate(self._specs(a)):
            shape, dt = tuple(spec[1]), getattr(torch, spec[2])
            numel = 1
            for s in shape:
                numel *= s
            # a fresh buffer per message, freed with its last use (the consuming chunk's
            # backward for an activation, the backward itself for a gradient), not kept for
            # the next step: what the cost model assumes a stage holds
            if self._scatter(spec, numel):
                full.append(torch.empty(shape, dtype=dt))
                buf = torch.empty((numel // self.t,), dtype=dt)
            else:
                full.append(None)
                buf = torch.empty(shape, dtype=dt)
            with peer_guard("receive from", self.p2p_group, [src]):
                works.append(dist.irecv(buf, src=src, group=self.p2p_group, tag=tag))
            bufs.append(buf)
        self._posted[a.message()] = _Posted(a, works, bufs, full)

    def _wait_recv(self, posted: _Posted, record: bool = True) -> list[torch.Tensor]:
        a = posted.action
        src = self.pipeline_ranks[a.peer]
        start = time.time()
        with peer_guard("receive from", self.p2p_group, [src]):
            for w in posted.works:
                w.wait()
        out = []
        for buf, full in zip(posted.bufs, posted.full):
            if full is not None:
                dist.all_gather_into_tensor(full.view(-1), buf, group=self.tensor_group)
                buf = full
            out.append(buf)
        if record and self.record:
            self.events.append((self.pp_rank, str(a), start, time.time()))
        return out

    def _recv_now(self, a: Action) -> list[torch.Tensor]:
        """async_recv=False: a blocking receive at the RECV action's place."""
        self._post(a)
        return self._wait_recv(self._posted.pop(a.message()), record=False)

    def _send_f(self, a: Action) -> None:
        st = self._stash[(a.chunk, a.mb)]
        self._send(a, st.outputs, self.chunks[a.chunk].send)
        if self._forward_only:      # no backward follows: the send holds what it needs
            del self._stash[(a.chunk, a.mb)]
        elif not self._split:    # (a split backward's B goes through autograd.grad: keep them)
            st.released = release_data(st.outputs, self.chunks[a.chunk].send_kept)

    def _recv_f(self, a: Action) -> None:
        if not self.async_recv:
            self._fwd_in[(a.chunk, a.mb)] = self._recv_now(a)
        elif a.message() not in self._posted:
            self._post(a)

    def _send_b(self, a: Action) -> None:
        specs = [s for s in self.chunks[a.chunk].recv if s[3]]
        self._send(a, self._bwd_out.pop((a.chunk, a.mb)), specs)

    def _recv_b(self, a: Action) -> None:
        if not self.async_recv:
            self._bwd_in[(a.chunk, a.mb)] = self._recv_now(a)
        elif a.message() not in self._posted:
            self._post(a)


_NEEDS = ("F", "B")


def _noop(_a: Action) -> None:
    return None

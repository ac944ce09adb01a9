"""autopar p=2, v=2 interleaved 1F1B vs torch.distributed.pipelining's ScheduleInterleaved1F1B.

Same model (an untied GPT from autopar.examples), same chunks (one block per chunk, embedding
in chunk 0, head + loss in chunk 3), same micro-batches, 2 CPU gloo ranks, timed side by side
in one run. Prints the step-time ratio (target: autopar ≤ 0.9 × torch) and, per rank, the idle
fraction measured from autopar's recorded timeline against the simulator's (cost/simulate.py)
fed with the measured per-chunk forward/backward times and p2p time, for interleaved and 1F1B.

    python benchmarks/pipeline.py [--steps 10] [--layers 4] [--hidden 64] [--timeline out.png]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from autopar.api import ParallelProgram
from autopar.plan import Plan, Prediction, Stage
from autopar.testing import spawn


def make_model(args) -> nn.Module:
    from autopar.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                         n_head=4, n_embd=args.hidden, tie_embeddings=False))


def make_plan(args, schedule: str, v: int) -> Plan:
    p, chunks = 2, 2 * v
    per = args.layers // chunks
    stages = tuple(Stage(chunk=c, rank=c % p, first_layer=c * per, last_layer=(c + 1) * per,
                         embedding=c == 0, head=c == chunks - 1) for c in range(chunks))
    pred = Prediction(step_time_s=0.0, tflops_per_gpu=0.0, mfu=0.0, bubble_fraction=0.0,
                      memory_bytes_per_gpu=0.0, compute_s=0.0, tp_comm_s=0.0, pp_comm_s=0.0,
                      dp_comm_s=0.0, bubble_s=0.0)
    return Plan(t=1, p=p, d=1, v=v, micro_batch_size=args.b, num_microbatches=args.m,
                schedule=schedule, recompute="none", sequence_parallel=False, zero=0,
                stages=stages, predicted=pred, global_batch_size=args.b * args.m,
                seq_len=args.seq, cluster="local-cpu", num_layers=args.layers)


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def data(args, step: int):
    g = torch.Generator().manual_seed(step)
    shape = (args.b * args.m, args.seq)
    return (torch.randint(0, args.vocab, shape, generator=g),
            torch.randint(0, args.vocab, shape, generator=g))


# ---- autopar ------------------------------------------------------------------------------
def run_autopar(args, schedule: str, v: int):
    import torch.distributed as dist
    model = make_model(args)
    plan = make_plan(args, schedule, v)
    ex = torch.zeros(args.b, args.seq, dtype=torch.long)
    prog = ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(ex,),
                           loss_fn=loss_fn, example_targets=ex.clone(), cluster=None)
    runner = prog.compile(timeout_s=120)
    for s in range(2):
        runner.train_step(*data(args, s))
    times = []
    for s in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        runner.train_step(*data(args, s))
        times.append(time.perf_counter() - t0)
    runner.record_timeline(True)
    dist.barrier()
    runner.train_step(*data(args, 0))
    events = [None] * 2
    dist.all_gather_object(events, runner.timeline)
    return statistics.median(times), [e for evs in events for e in evs]


# ---- torch.distributed.pipelining -----------------------------------------------------------
class _Chunk(nn.Module):
    """One pipeline chunk of the GPT: optional embedding, blocks, optional head."""

    def __init__(self, model, blocks, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.transformer.wte, model.transformer.wpe
        self.blocks = nn.ModuleList(blocks)
        if last:
            self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, x):
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def run_torch(args, v: int):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    rank, p = dist.get_rank(), 2
    model = make_model(args)
    chunks = p * v
    per = args.layers // chunks
    h = model.transformer.h
    stages, params = [], []
    for c in range(rank, chunks, p):
        mod = _Chunk(model, [h[i] for i in range(c * per, (c + 1) * per)], c == 0,
                     c == chunks - 1)
        params += list(mod.parameters())
        stages.append(PipelineStage(mod, c, chunks, torch.device("cpu")))
    opt = torch.optim.AdamW(params, lr=3e-4)
    sched = ScheduleInterleaved1F1B(stages, n_microbatches=args.m, loss_fn=loss_fn)

    def step(s):
        x, y = data(args, s)
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()

    for s in range(2):
        step(s)
    times = []
    for s in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- measured vs simulated idle ----------------------------------------------------------
def idle_report(events, schedule_name: str, args, v: int) -> list[tuple[float, float]]:
    from autopar.cost.simulate import simulate
    from autopar.schedules import make_schedule, parse_action
    p = 2
    t0 = min(e[2] for e in events)
    end = max(e[3] for e in events)
    makespan = end - t0
    acts = [(r, parse_action(a), s - t0, e - t0) for r, a, s, e in events]
    C = p * v
    fwd = [statistics.mean([e - s for r, a, s, e in acts if a.kind == "F" and a.chunk == c])
           for c in range(C)]
    bwd = [statistics.mean([e - s for r, a, s, e in acts if a.kind == "B" and a.chunk == c])
           for c in range(C)]
    # The runtime posts sends with isend (never blocking), so the simulator runs with
    # blocking=False; a transfer's cost is the shortest receive (one that did not wait).
    recvs = [e - s for r, a, s, e in acts if a.kind.startswith("RECV")]
    p2p = min(recvs) if recvs else 0.0
    sim = simulate(make_schedule(schedule_name, p, v, args.m), fwd, bwd, p2p_s=p2p,
                   blocking=False)
    out = []
    for r in range(p):
        busy = sum(e - s for rr, a, s, e in acts if rr == r and a.kind in ("F", "B"))
        out.append(((makespan - busy) / makespan, sim.idle_fraction[r]))
    return out


def bench_rank(rank, world, args):
    torch.set_num_threads(1)
    ours, events = run_autopar(args, "interleaved-1f1b", 2)
    ours_1f1b, events_1f1b = run_autopar(args, "1f1b", 1)
    theirs = run_torch(args, 2)
    if rank != 0:
        return None
    return {"ours": ours, "theirs": theirs, "ours_1f1b": ours_1f1b,
            "idle_interleaved": idle_report(events, "interleaved-1f1b", args, 2),
            "idle_1f1b": idle_report(events_1f1b, "1f1b", args, 1),
            "events": events}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--timeline", default=None, help="write the measured interleaved timeline PNG")
    args = ap.parse_args()
    res = spawn(bench_rank, 2, args, timeout_s=600)[0]
    ratio = res["ours"] / res["theirs"]
    print(f"model: GPT {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq "
          f"{args.seq}; p=2, v=2, micro-batch {args.b} × {args.m}; 2 CPU gloo ranks")
    print(f"step time  autopar interleaved-1f1b: {res['ours'] * 1e3:8.2f} ms (median of "
          f"{args.steps})")
    print(f"step time  torch ScheduleInterleaved1F1B: {res['theirs'] * 1e3:8.2f} ms")
    print(f"ratio autopar / torch = {ratio:.3f}  (target <= 0.9: "
          f"{'met' if ratio <= 0.9 else 'NOT met'})")
    for name in ("idle_interleaved", "idle_1f1b"):
        for r, (meas, sim) in enumerate(res[name]):
            rel = (meas - sim) / sim if sim else float("nan")
            print(f"{name[5:]:12s} rank {r}: idle fraction measured {meas:.3f}, simulated "
                  f"{sim:.3f} ({rel:+.0%}; target within ±25%)")
    if args.timeline:
        from autopar.timeline import draw_timeline
        t0 = min(e[2] for e in res["events"])
        draw_timeline([(r, a, s - t0, e - t0) for r, a, s, e in res["events"]], 2,
                      args.timeline, title="autopar interleaved 1F1B (measured)")
        print(f"timeline: {args.timeline}")


if __name__ == "__main__":
    main()

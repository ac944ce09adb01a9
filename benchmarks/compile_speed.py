"""Benchmark: a GPT training step with compiled chunks (`compile(torch_compile=True)`) vs eager.

    python benchmarks/compile_speed.py [--configs 1x1,2x1,1x2] [--hidden 128] [--layers 4]

Each configuration `TxP` (t tensor ranks × p pipeline ranks, gloo on CPU; 1x1 is one rank)
builds two Runners of the same model and plan in the same processes — chunks run eagerly, and
the same chunks compiled by torch.compile (Inductor, C++ kernels on CPU; graph breaks at the
collectives) — then times them in alternating rounds (this host's speed drifts; one process
holds both so they see the same machine): WARMUP steps each first (the compiled one compiles
then: its compile time is printed separately), then --rounds rounds of --steps steps each,
eager and compiled alternating, each round's median step. Every rank runs
torch.set_num_threads(1) (2 cores). Printed: per configuration, compile seconds, the
median step times and, last, the speed-up eager / compiled (goal, issue 28: ≥ 1.15).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from autopar.testing import spawn

WARMUP = 2


def _model(a: argparse.Namespace) -> torch.nn.Module:
    from autopar.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=4,
                         n_embd=a.hidden, tie_embeddings=False))


def _batch(a: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    shape = (a.batch, a.seq)
    return (torch.randint(0, a.vocab, shape, generator=g),
            torch.randint(0, a.vocab, shape, generator=g))


def _runner(a: argparse.Namespace, t: int, p: int, compiled: bool):
    import autopar
    ex = torch.zeros(a.batch // a.microbatches, a.seq, dtype=torch.long)
    prog = autopar.parallelize(_model(a), gpus=t * p, example_inputs=(ex,),
                               loss_fn=autopar.cross_entropy, cluster="local-cpu",
                               global_batch_size=a.batch, t=t, p=p, d=1, v=1,
                               micro_batch_size=a.batch // a.microbatches, schedule="1f1b",
                               recompute="none", zero=0)
    return prog.compile(timeout_s=900, torch_compile=compiled)


def _rank(rank: int, world: int, a: argparse.Namespace, t: int, p: int) -> dict:
    from autopar.runtime.compiled import compile_counts
    torch.set_num_threads(1)
    runners = {"eager": _runner(a, t, p, False), "compiled": _runner(a, t, p, True)}
    warm = {}
    for name, r in runners.items():
        t0 = time.perf_counter()
        for s in range(WARMUP):
            r.train_step(*_batch(a, s))
        warm[name] = time.perf_counter() - t0
    compiled_after_warmup = compile_counts()
    rounds: dict[str, list[float]] = {n: [] for n in runners}
    for i in range(a.rounds):
        for name in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
            times = []
            for s in range(a.steps):
                t0 = time.perf_counter()
                runners[name].train_step(*_batch(a, s))
                times.append(time.perf_counter() - t0)
            rounds[name].append(statistics.median(times))
    return {"warm": warm, "rounds": rounds,
            "counts": (compiled_after_warmup, compile_counts())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="1x1,2x1,1x2", help="TxP list")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    print(f"GPT hidden {a.hidden}, {a.layers} layers, seq {a.seq}, vocab {a.vocab}, batch "
          f"{a.batch} in {a.microbatches} micro-batches; {a.rounds} rounds x {a.steps} steps")
    ratios = {}
    for cfg in a.configs.split(","):
        t, p = (int(x) for x in cfg.split("x"))
        res = spawn(_rank, t * p, a, t, p, timeout_s=1800)[0]
        med = {n: statistics.median(v) for n, v in res["rounds"].items()}
        ratios[cfg] = med["eager"] / med["compiled"]
        print(f"t={t} p={p}: warm-up (2 steps, compile included) eager {res['warm']['eager']:.1f} s, "
              f"compiled {res['warm']['compiled']:.1f} s; step eager {med['eager'] * 1e3:.1f} ms, "
              f"compiled {med['compiled'] * 1e3:.1f} ms; rounds eager "
              f"{[round(x * 1e3, 1) for x in res['rounds']['eager']]}, compiled "
              f"{[round(x * 1e3, 1) for x in res['rounds']['compiled']]}; Dynamo graphs / "
              f"breaks after warm-up and after timing {res['counts']}", flush=True)
    for cfg, r in ratios.items():
        print(f"speed-up eager/compiled {cfg}: {r:.2f}x (goal >= 1.15)")


if __name__ == "__main__":
    main()

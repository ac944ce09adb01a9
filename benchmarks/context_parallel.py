"""Context parallelism c=2 on 2 CPU ranks versus one process, and versus PyTorch's own.

    python benchmarks/context_parallel.py [--seq 2048] [--hidden 64] [--layers 2] [--steps 4]
    python benchmarks/context_parallel.py --choices   # the solver's method at scale, and why

A Llama-style model (autopar.examples.llama: rotary, grouped-query attention) at a sequence
long enough to be attention-bound (attention 4·s²·h FLOPs per layer against 3·2·s·h·(h + 2h_kv)
+ 3·2·s·h·f for the projections: s = 2048 ≫ h = 64). Each variant trains with AdamW through
autopar's runtime (compile + train_step), one process per variant, side by side in one run:

  one process   the plan t = c = p = d = 1 (world 1)
  c = 2         each sequence in 4 chunks, rank i holding chunks i and 3 − i, K/V all-gathered
  c = 2 ring    the same split, K/V blocks passed round the 2 ranks while attending
                (cp_attention="ring", autopar/runtime/ring_attention.py)
  c = 2 all-to-all  the same split, q, k, v traded for heads around attention and the output
                traded back (cp_attention="all-to-all", autopar/runtime/ulysses.py)

It prints the median step time of each, the speed-up, and the bytes autograd saves per rank
for one step's backward (saved-tensor hooks; storages counted once), and the ratio. Then it
tries torch.distributed.tensor.experimental.context_parallel on the same 2 gloo ranks (a
DeviceMesh on "cpu", the sequence buffers sharded along dim 1) and prints its step time, or
the error it raises on CPU / gloo.

--choices plans (on the meta device, nothing run) Llama 3 405B at 131,072 tokens on 16,384
H100 and a multi-head (non-GQA) Llama-style 8B at 65,536 tokens on 64 H100 and at 131,072 on
128 H100 (where a context group may span nodes: the hybrid's case), the method free (the
all-gather pinned too for the 405B, hybrid-ring pinned for the 8B at 131,072: pin-only),
and prints the plan and explain()'s
"Context attention" line (the method and why).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

WARMUP = 1


def _model(a: argparse.Namespace) -> torch.nn.Module:
    from autopar.examples.llama import LlamaStyle, llama_tiny
    torch.manual_seed(0)
    return LlamaStyle(llama_tiny(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers,
                                 n_head=a.heads, n_kv_head=a.kv_heads, n_embd=a.hidden,
                                 ffn_hidden=4 * a.hidden))


def _data(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
    return ids, torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)


class _SavedBytes:
    """Bytes autograd saves for backward while active (each storage once)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        key = x.untyped_storage().data_ptr()
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += x.untyped_storage().nbytes()
        return x

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda x: x)


def _autopar(rank: int, world: int, a: argparse.Namespace, c: int,
             how: str = "all-gather") -> tuple[float, int, float]:
    """(median step s, saved bytes of one step, last loss) of autopar's runtime at c, its
    attention meeting the other rank's K/V by `how` (cp_attention)."""
    import autopar
    torch.set_num_threads(1)
    ids, targets = _data(a)
    prog = autopar.parallelize(_model(a), gpus=world, example_inputs=(ids[:1],),
                               loss_fn=autopar.cross_entropy, global_batch_size=a.batch,
                               cluster="local-cpu", t=1, p=1, d=1, c=c,
                               micro_batch_size=a.batch, recompute="none",
                               cp_attention=how if c > 1 else None)
    runner = prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), timeout_s=600)
    saved = _SavedBytes()
    times, loss = [], 0.0
    for i in range(a.steps + WARMUP):
        t0 = time.perf_counter()
        if i == WARMUP:
            with saved.hooks():
                loss = runner.train_step(ids, targets)
        else:
            loss = runner.train_step(ids, targets)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    runner.close()
    return statistics.median(times), saved.bytes, loss


def _torch_cp(rank: int, world: int, a: argparse.Namespace) -> tuple[str, float]:
    """PyTorch's context_parallel on gloo: ('ok', median step s) or ('error', message)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        model = _model(a)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mesh = init_device_mesh("cpu", (world,))
        ids, targets = _data(a)
        times = []
        for i in range(a.steps + WARMUP):
            x, y = ids.clone(), targets.clone()
            t0 = time.perf_counter()
            with context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1]):
                opt.zero_grad()
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
            opt.step()
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        dist.barrier()
        return "ok", statistics.median(times)
    except Exception as exc:  # noqa: BLE001 - the benchmark reports what torch raises here
        return "error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _choices() -> None:
    """The solver's context attention for two long-context models (module docstring)."""
    import autopar
    from autopar.presets import load_model
    from transformers import LlamaConfig, LlamaForCausalLM
    user, _ = load_model("llama3-405b", seq_len=131072)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=65536, use_cache=False)
    with torch.device("meta"):
        mha = LlamaForCausalLM(cfg)
        cfg.max_position_embeddings = 131072
        mha_long = LlamaForCausalLM(cfg)
    gather = {"cp_attention": "all-gather"}   # the method free before the hybrid was weighed
    cases = (("Llama 3 405B, 131,072 tokens, 16,384 H100", user.model, 131072, 16384, 128, {}),
             ("the same, all-gather pinned", user.model, 131072, 16384, 128, gather),
             ("multi-head Llama-style 8B, 65,536 tokens, 64 H100", mha, 65536, 64, 8, {}),
             ("multi-head Llama-style 8B, 131,072 tokens, 128 H100", mha_long, 131072, 128, 8,
              {}),
             ("the same, hybrid-ring pinned (the ring across nodes)", mha_long, 131072, 128, 8,
              {"cp_attention": "hybrid-ring"}))
    for title, model, seq, gpus, batch, pins in cases:
        ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
        t0 = time.perf_counter()
        plan = autopar.parallelize(model, gpus=gpus, example_inputs=(ids,),
                                   loss_fn=autopar.cross_entropy, global_batch_size=batch,
                                   cluster="dgx-h100-80gb", **pins).plan
        line = next((x.strip() for x in plan.explain().splitlines()
                     if x.strip().startswith("Context attention")), "c = 1: no context split")
        print(f"{title} (planned in {time.perf_counter() - t0:.0f} s)\n  t={plan.t} c={plan.c} ({plan.cp_attention}) p={plan.p} d={plan.d} "
              f"b={plan.micro_batch_size} {plan.schedule} recompute={plan.recompute}, "
              f"{plan.predicted.step_time_s:.2f} s/step"
              f"\n  {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--choices", action="store_true",
                    help="print the solver's context attention at scale instead")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    if a.choices:
        return _choices()
    from autopar.testing import spawn
    one_s, one_bytes, one_loss = spawn(_autopar, 1, a, 1, timeout_s=1200)[0]
    print(f"Llama-style, {a.layers} layers, hidden {a.hidden}, {a.heads} heads ({a.kv_heads} kv), "
          f"sequence {a.seq}, batch {a.batch}; median of {a.steps} steps")
    print(f"  one process        {one_s * 1e3:9.1f} ms/step   saved for backward "
          f"{one_bytes / 2**20:8.1f} MiB   loss {one_loss:.4f}")
    cp_s = None
    for how, label in (("all-gather", "c=2 all-gather"), ("ring", "c=2 ring      "),
                       ("all-to-all", "c=2 all-to-all")):
        res = spawn(_autopar, 2, a, 2, how, timeout_s=1200)
        step_s, saved = max(r[0] for r in res), max(r[1] for r in res)
        cp_s = step_s if cp_s is None else cp_s
        print(f"  {label}     {step_s * 1e3:9.1f} ms/step   saved per rank     "
              f"{saved / 2**20:8.1f} MiB   loss {res[0][2]:.4f}   speed-up "
              f"{one_s / step_s:.2f}x, saved bytes {saved / one_bytes:.2f}x of one process")
    res = spawn(_torch_cp, 2, a, timeout_s=1200)
    status, value = res[0]
    if status == "ok":
        worst = max(r[1] for r in res if r[0] == "ok")
        print(f"  torch context_parallel (gloo)  {worst * 1e3:9.1f} ms/step   autopar c=2 / "
              f"torch: {cp_s / worst:.2f}")
    else:
        print(f"  torch context_parallel does not run on CPU/gloo here: {value}")


if __name__ == "__main__":
    main()

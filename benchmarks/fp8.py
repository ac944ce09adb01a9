"""FP8 training curves against bf16: a tiny GPT on a token file, one CPU rank, 200 steps.

    python benchmarks/fp8.py [--steps 200] [--hidden 64] [--out fp8_curves.png]

The same model (autopar's example GPT, 2 blocks), data (a token file of a learnable stream:
t' = 5t + 3 mod 256, every 8th token random, read by autopar.data) and AdamW run through
parallelize + compile at precision bf16, fp8 (tensorwise) and fp8-rowwise. Prints the losses
every 20 steps and the worst relative gap of each FP8 curve to bf16 over the last 50 steps
(target < 3%), and saves the three curves as a PNG. On CPU, FP8 is emulated by
torch._scaled_mm's reference kernel: this measures numerics, not speed.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

VOCAB, SEQ, BATCH = 256, 32, 16
PRECISIONS = ("bf16", "fp8", "fp8-rowwise")


def _token_file(path: Path) -> None:
    g = np.random.default_rng(0)
    tok = np.zeros(400_000, dtype=np.uint16)
    for i in range(1, len(tok)):
        tok[i] = g.integers(VOCAB) if i % 8 == 0 else (5 * tok[i - 1] + 3) % VOCAB
    tok.tofile(path)


def _train(rank, world, precision, steps, hidden, path):
    import autopar
    from autopar.data import BatchShape, TokenFile, TokenFileBatches
    from autopar.examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=hidden,
                          dropout=0.0))
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    prog = autopar.parallelize(model, gpus=1, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=BATCH,
                               cluster="local-cpu", t=1, p=1, d=1, micro_batch_size=BATCH)
    runner = prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                          max_grad_norm=1.0, precision=precision)
    data = TokenFileBatches(TokenFile(path, vocab_size=VOCAB),
                            BatchShape(global_batch_size=BATCH, seq_len=SEQ))
    losses = []
    for _ in range(steps):
        x, y = data.next()
        losses.append(runner.train_step(x, y))
    runner.close()
    return losses


def main() -> None:
    from autopar.testing import spawn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", default="fp8_curves.png")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        _token_file(path)
        curves = {p: spawn(_train, 1, p, args.steps, args.hidden, str(path),
                           timeout_s=3600)[0] for p in PRECISIONS}
    for step in range(0, args.steps, 20):
        print(f"step {step:4d}  " + "  ".join(f"{p} {curves[p][step]:.4f}" for p in PRECISIONS))
    ref = np.array(curves["bf16"])
    tail = slice(max(0, args.steps - 50), args.steps)
    for p in PRECISIONS[1:]:
        gap = np.abs(np.array(curves[p]) - ref) / ref
        print(f"{p}: worst gap to bf16 over the last 50 steps {gap[tail].max():.2%} "
              f"(all steps {gap.max():.2%}; target < 3%)")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for p in PRECISIONS:
        ax.plot(curves[p], label=p, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"tiny GPT (hidden {args.hidden}), token file: FP8 vs bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

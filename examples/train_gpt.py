"""Train a small character-level GPT on examples/alice.txt with autopar, on CPU ranks.

    torchrun --standalone --nproc-per-node=4 examples/train_gpt.py --t 1 --p 2 --dp 2 --steps 60
    torchrun --standalone --nproc-per-node=4 examples/train_gpt.py --p 2 --dp 2 --steps 120 \
        --resume                        # continue from runs/alice/ckpt where the last run stopped
    python examples/train_gpt.py --t 2 --p 2 --d 2 ...   # (--d is fine outside torchrun)

Rank 0 plans (t, p, d pinned, the rest solved for this machine), every rank compiles the same
plan; each step trains on a global batch of random windows of the text (each data-parallel
rank takes its rows). A progress bar (tqdm if installed, else plain lines) shows the loss of
every step; a checkpoint is saved every --save-every steps (sharded, atomic) and --resume
continues from it — under the same or another (t, p, d). At the end rank 0 gathers the
single-device weights (runner.full_state_dict()) into the plain model and samples some text.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.examples.gpt import GPT, GPTConfig
from autopar.runtime.dist import init_distributed

CORPUS = Path(__file__).resolve().parent / "alice.txt"


def load_corpus(path: Path = CORPUS) -> tuple[torch.Tensor, list[str]]:
    """(token ids, vocabulary): one token per distinct character, in sorted order."""
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), chars


def batch(data: torch.Tensor, step: int, global_batch: int, seq: int, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step `step`: random windows (inputs, next-character targets)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (global_batch,), generator=g)
    x = torch.stack([data[s:s + seq] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + seq + 1] for s in starts.tolist()])
    return x, y


def make_model(vocab: int, args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)            # the same initial weights on every rank
    return GPT(GPTConfig(vocab_size=vocab, block_size=args.seq, n_layer=args.layers,
                         n_head=args.heads, n_embd=args.hidden))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # --t/--p/--d, also spelled --tp/--pp/--dp: torchrun's own parser rejects a bare `--d`
    # after the script name as an ambiguous abbreviation of its --duplicate-* options
    ap.add_argument("--t", "--tp", dest="t", type=int, default=1, help="tensor-parallel degree")
    ap.add_argument("--p", "--pp", dest="p", type=int, default=1,
                    help="pipeline-parallel degree")
    ap.add_argument("--d", "--dp", dest="d", type=int, default=None,
                    help="data-parallel degree (default: the remaining ranks)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--checkpoint", default="runs/alice/ckpt", help="checkpoint path")
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=int, default=200, help="characters to sample at the end")
    return ap.parse_args()


def plan_on_rank0(model: GPT, world: int, args: argparse.Namespace) -> autopar.Plan:
    """Rank 0 solves the plan; every rank gets the same one (broadcast as JSON)."""
    box = [None]
    if dist.get_rank() == 0:
        example = torch.zeros(1, args.seq, dtype=torch.long)
        prog = autopar.parallelize(model, gpus=world, example_inputs=(example,),
                                   loss_fn=autopar.cross_entropy, global_batch_size=args.batch,
                                   cluster="local-cpu", t=args.t, p=args.p, d=args.d,
                                   zero=args.zero)
        box[0] = prog.plan.to_json()
    dist.broadcast_object_list(box, src=0)
    return autopar.Plan.from_json(box[0])


class Progress:
    """tqdm on rank 0 when installed, else one printed line per step."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.enabled, self.bar = enabled, None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, loss: float, step_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", s_per_step=f"{step_s:.2f}")
            self.bar.update(1)
            self.bar.write(f"step {step:5d}  loss {loss:.4f}")
        else:
            print(f"step {step:5d}  loss {loss:.4f}  ({step_s:.2f} s)", flush=True)

    def write(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@torch.no_grad()
def sample(model: GPT, chars: list[str], prompt: str, n: int, seq: int) -> str:
    model.eval()
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([[index.get(c, 0) for c in prompt]], dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        logits = model(ids[:, -seq:])[:, -1, :]
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=g)
        ids = torch.cat([ids, nxt], dim=1)
    return "".join(chars[i] for i in ids[0].tolist())


def main() -> int:
    args = parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    data, chars = load_corpus()
    model = make_model(len(chars), args)
    plan = plan_on_rank0(model, world, args)
    if rank == 0:
        print(plan, flush=True)
    example = torch.zeros(plan.micro_batch_size, args.seq, dtype=torch.long)
    prog = autopar.parallelize(model, gpus=world, example_inputs=(example,),
                               loss_fn=autopar.cross_entropy, cluster="local-cpu", plan=plan)
    runner = prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                          max_grad_norm=args.max_grad_norm, precision=args.precision)
    start = 0
    if args.resume and os.path.exists(args.checkpoint):
        start = runner.load_checkpoint(args.checkpoint)
    elif rank == 0:
        Path(args.checkpoint).parent.mkdir(parents=True, exist_ok=True)
    bar = Progress(start, args.steps, enabled=rank == 0)
    if start:
        bar.write(f"resumed from {args.checkpoint} at step {start}")
    share = plan.global_batch_size // plan.d
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        x, y = batch(data, step, plan.global_batch_size, args.seq, args.seed)
        lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
        loss = runner.train_step(x[lo:hi], y[lo:hi])
        bar.update(step, loss, time.perf_counter() - t0)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            runner.save_checkpoint(args.checkpoint)
            bar.write(f"saved checkpoint {args.checkpoint} (step {step + 1})")
    bar.close()
    state = runner.full_state_dict()
    if rank == 0 and args.sample > 0:
        model.load_state_dict(state)
        print("\n--- sample ---\n" + sample(model, chars, "Alice ", args.sample, args.seq))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

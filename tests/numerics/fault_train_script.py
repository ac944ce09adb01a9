"""Run under torchrun (2 ranks) by tests/numerics/test_fault.py: train STEPS steps of a d=2
ZeRO-1 plan, checkpointing after every step and resuming from the checkpoint at start. On the first attempt
(TORCHELASTIC_RESTART_COUNT=0) rank 1 dies after the training of step KILL_STEP, before that
step's checkpoint; torchrun --max-restarts=1 restarts both ranks, which resume.

    python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 \
        tests/numerics/fault_train_script.py CKPT OUT_DIR KILL_STEP
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: programs.py
from programs import STEPS, make_data, make_plan, make_program, with_zero  # noqa: E402


def main() -> None:
    ckpt, out, kill_step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    plan = with_zero(make_plan(d=2, m=2, layers=2), 1)
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), timeout_s=30)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start = runner.load_checkpoint(ckpt) if os.path.exists(ckpt) else 0
    rank = torch.distributed.get_rank()
    share = plan.global_batch_size // plan.d
    losses = []
    for step, (x, y) in enumerate(make_data(plan, vocab)[start:STEPS], start=start):
        lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
        losses.append(runner.train_step(x[lo:hi], y[lo:hi]))
        if attempt == 0 and rank == 1 and step == kill_step:
            os._exit(7)              # dies mid-run: step `kill_step` trained but not saved
        runner.save_checkpoint(ckpt)
    state = runner.full_state_dict()
    if rank == 0:
        torch.save(state, out / "final_state.pt")
        (out / f"attempt{attempt}.json").write_text(json.dumps({"start": start,
                                                                "losses": losses}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

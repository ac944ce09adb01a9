"""Everything a GPU can tell autopar, in one call (issue 36): results as JSON + a text table.

A GPU is lent to this project only now and then, so what it can tell is ready to run at once:

    # on the CPU side (ortools is here): plan every case, write them into a folder
    python benchmarks/gpu.py prepare --dir gpu_run
    # on the GPU machine, one call (its image has torch + CUDA but no ortools: the plans travel;
    # a 15-minute lease: calibrate first, while the device is empty (it records what is
    # already in use as the reserve: 8.8 GB after the single part on the first H100 run), then
    # what matters most, and a deadline so the call ends with its results)
    # (`python3 -m pip`: the image's bare `pip` belongs to another interpreter; the checkout
    # on PYTHONPATH is not enough, autopar.cost lives in ./cost by the editable install's map)
    python3 -m pip install -q --no-deps --no-build-isolation -e . && \\
        AUTOPAR_CKPT_DIR=/dev/shm python3 benchmarks/gpu.py run --dir gpu_run --out $OUT \\
        --deadline-s 420 --parts calibrate,checkpoint,single:single-gpt,memory,profile
    # times on the H100 (2026-11-27): calibrate 20 s, checkpoint ~3 min (0.35B GPT: ~5 GB a
    # save, even into /dev/shm), profile 51 s, a memory row ~4 s, single ~2 min a model
    # (the H200, same day: calibrate 25 s, checkpoint ~2 min, 12 memory rows 41 s, single-gpt
    # 115 s, single-llama 165 s; a lent machine started in ~30 s). On an H200 prepare with
    # --cluster dgx-h200-141gb. The device tool copies untracked files git does not ignore:
    # where gpu_run/ is ignored (.git/info/exclude), name it in the call's carry list.
    # Not yet run on a GPU (fixed after the H200 run): calibrate's host floor and 16K-token
    # attention rows, recompute op on the image's torch 2.11 — first, next time:
    #   --parts calibrate,memory:memory-op-mb1+memory-op-mb2+memory-op-mb4,single:single-gpt
    # both in one process, e.g. the plumbing on CPU (tests/numerics/test_gpu_benchmark.py, CI):
    python benchmarks/gpu.py all --device cpu --quick --out /tmp/gpu_quick

What `run` measures (each part isolated: a part that fails is recorded with its one-line
reason and the rest still run; `--parts` picks some):

1. `single`: the generated program on one device (t = p = d = 1, a process group of one:
   NCCL on CUDA), bf16 with fp32 masters, SDPA attention, on a ~1.3B GPT (24 layers, hidden
   2048, 16 heads, sequence 2048) and an unmodified `transformers` Llama of similar size,
   eager and (when `compile(torch_compile=True)` exists) with compiled chunks; side by side
   with a plain hand-written loop on the same model, data and micro-batches (bf16 autocast,
   fused AdamW, torch.compile'd): the median step time of each, the ratio plain / autopar
   (goal ≥ 0.97) and MFU (model FLOPs as the plan counts them over the device's bf16 peak of
   the plan's cluster; goal ≥ 45% on H100).
2. `multirank`: the multi-rank paths with several processes sharing the one device (gloo;
   `compile(device=...)` puts every rank on it): t = 2, p = 2, c = 2 (ring attention) and
   ep = 2 plans in fp32, each's losses against the single-device run of the same model and
   data; what gloo cannot run on CUDA tensors is recorded by name (the exception's line).
3. `calibrate`: `autopar calibrate` on the device (GEMM curve, attention, bandwidth) written as
   a cluster file, beside the preset's constants.
4. `memory`: the peak allocated bytes of a step (torch.cuda.max_memory_allocated; on CPU the
   profiler's tensor bytes) against the plan's predicted memory — the static part (weights,
   gradients, optimizer) and the activations separately — for recompute none / selective /
   full / op and micro-batch 1, 2, 4; and two steps' median time against the predicted step
   (eager chunks, priced eager: what each recompute mode costs).
5. `checkpoint`: a ~0.35B GPT's synchronous save against an asynchronous one while training
   goes on (issue 27: the stall ≤ 20% of the synchronous save's time), the staging buffer
   pinned or not, and each save loaded back on the device equal to what was saved, bit for bit.
6. `profile`: one eager step of the `single` plans under torch.profiler: the device's busy
   time against the step's wall time, and the kernels that take it (where a measured step
   parts from the predicted one), the table into OUT/profile-CASE.txt.

`--quick` shrinks every model to a few layers of width 64 (the plumbing, not the numbers).
The results: OUT/gpu_results.json (every number) and OUT/gpu_results.txt (the table, also
printed last).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

PARTS = ("single", "multirank", "calibrate", "memory", "checkpoint", "profile")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK")
SEED = 1234


# ---------------------------------------------------------------------------------------------
# the cases: models and the plans prepared for them
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """The model and batch sizes of one run: full (the issue's) or --quick (the plumbing)."""
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int
    global_batch: int
    mem_layers: int       # the memory sweep's GPT (12 layers of the single part's width)
    small_hidden: int     # the multi-rank models
    small_seq: int
    steps: int            # timed steps (after warm-up)
    ckpt_layers: int = 2  # the checkpoint part's GPT (width ckpt_hidden): ~0.35B, ~5.6 GB of
    ckpt_hidden: int = 64  # fp32 masters + AdamW to save (the 1.3B's 21 GB would take minutes)

    @staticmethod
    def pick(quick: bool) -> "Sizes":
        if quick:
            return Sizes(layers=2, hidden=64, heads=4, seq=32, vocab=128, ffn=176,
                         global_batch=4, mem_layers=2, small_hidden=32, small_seq=16, steps=2)
        return Sizes(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304, ffn=5504,
                     global_batch=16, mem_layers=12, small_hidden=256, small_seq=256, steps=10,
                     ckpt_layers=24, ckpt_hidden=1024)


def gpt(s: Sizes, layers: int | None = None, hidden: int | None = None,
        seq: int | None = None, vocab: int | None = None) -> torch.nn.Module:
    from autopar.examples.gpt import GPT, GPTConfig
    h = hidden or s.hidden
    return GPT(GPTConfig(vocab_size=vocab or s.vocab, block_size=seq or s.seq,
                         n_layer=layers or s.layers, n_head=max(2, h // 128) if hidden else s.heads,
                         n_embd=h, dropout=0.0, bias=True, tie_embeddings=True))


def hf_llama(s: Sizes) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32000 if s.vocab > 1000 else s.vocab, hidden_size=s.hidden,
        intermediate_size=s.ffn, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.heads, max_position_embeddings=s.seq, tie_word_embeddings=False,
        attn_implementation="sdpa"))


def hf_mixtral(s: Sizes) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM
    h = s.small_hidden
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=s.vocab if s.vocab < 1000 else 1024, hidden_size=h, intermediate_size=2 * h,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=s.small_seq,
        router_jitter_noise=0.0, attn_implementation="sdpa"))


def build_model(name: str, s: Sizes, device: str = "cpu",
                init: str | None = None) -> torch.nn.Module:
    """Every case's model, built from a seed on `device` (the same weights on every rank);
    `init` draws the weights on another device first (a GPU draws 1.3B weights in a second,
    a CPU in half a minute) and moves them, ties kept."""
    if init is not None and init != device:
        return build_model(name, s, init).to(device)
    torch.manual_seed(SEED)
    with torch.device(device):
        if name == "gpt":
            return gpt(s)
        if name == "llama":
            return hf_llama(s)
        if name == "small_gpt":
            return gpt(s, layers=4, hidden=s.small_hidden, seq=s.small_seq,
                       vocab=min(s.vocab, 1024))
        if name == "mem_gpt":
            return gpt(s, layers=s.mem_layers)
        if name == "mixtral":
            return hf_mixtral(s)
        if name == "ckpt_gpt":
            return gpt(s, layers=s.ckpt_layers, hidden=s.ckpt_hidden)
    raise ValueError(f"gpu.py: unknown model {name!r}")


def seq_of(name: str, s: Sizes) -> int:
    return s.small_seq if name in ("small_gpt", "mixtral") else s.seq


def vocab_of(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "vocab_size", 0) or getattr(cfg, "vocab", 0) or
               model.lm_head.weight.shape[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One plan to prepare: the model, the pins, the part that runs it."""
    key: str
    part: str
    model: str
    gpus: int
    pins: dict
    cluster: str
    elementwise: str | None = None   # the cluster's, else priced as the rows run (eager)


def cases(s: Sizes, cluster: str) -> list[Case]:
    # micro-batches of 4 x 2048 tokens: the free plan's 16 (one micro-batch) did not fit an
    # H100's 80 GB, for the plain loop either (first run, 2026-11-26: activations ~2x priced)
    one_device = dict(t=1, p=1, d=1, c=1, zero=0, micro_batch_size=4)
    # the single and profile parts run the same plans
    out = [Case(key=f"{part}-{m}", part=part, model=m, gpus=1, cluster=cluster,
                pins=one_device) for part in ("single", "profile") for m in ("gpt", "llama")]
    multi = {"t2": dict(t=2, p=1, d=1, c=1, sequence_parallel=False),
             "p2": dict(t=1, p=2, d=1, c=1, schedule="1f1b"),
             "c2-ring": dict(t=1, p=1, d=1, c=2, cp_attention="ring"),
             "d2": dict(t=1, p=1, d=2, c=1, zero=1)}
    out += [Case(key=f"multirank-{k}", part="multirank", model="small_gpt", gpus=2,
                 cluster=cluster, pins=v) for k, v in multi.items()]
    out.append(Case(key="multirank-ep2", part="multirank", model="mixtral", gpus=2,
                    cluster=cluster, pins=dict(t=1, p=1, d=2, c=1, ep=2, zero=1)))
    # the memory rows run eager chunks: priced so (the preset's fused accounting is what
    # compiled chunks keep: 34.2 GiB predicted against 35.1 measured, eager 38.7 against 38.8)
    out += [Case(key=f"memory-{r}-mb{mb}", part="memory", model="mem_gpt", gpus=1,
                 cluster=cluster, elementwise="eager",
                 pins=dict(t=1, p=1, d=1, c=1, zero=0, recompute=r, micro_batch_size=mb))
            for r in ("none", "selective", "full", "op") for mb in (1, 2, 4)]
    out.append(Case(key="checkpoint-gpt", part="checkpoint", model="ckpt_gpt", gpus=1,
                    cluster=cluster, pins=dict(t=1, p=1, d=1, c=1, zero=1, micro_batch_size=4)))
    return out


def prepare(directory: Path, s: Sizes, cluster: str, keep: tuple[str, ...] = ()) -> dict:
    """Plan every case (or those named in `keep`) on the meta device (this side has the
    solver) into directory/."""
    import autopar
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"sizes": dataclasses.asdict(s), "cluster": cluster, "cases": {}}
    for case in cases(s, cluster):
        if keep and case.key not in keep:
            continue
        with torch.device("meta"):
            model = build_model(case.model, s, "meta")
        seq = seq_of(case.model, s)
        batch = {"memory": 4, "checkpoint": 8}.get(case.part, s.global_batch)
        example = torch.zeros(1, seq, dtype=torch.long, device="meta")
        cluster = case.cluster if case.elementwise is None else dataclasses.replace(
            autopar.get_cluster(case.cluster), elementwise=case.elementwise)
        prog = autopar.parallelize(model, gpus=case.gpus, example_inputs=(example,),
                                   loss_fn=autopar.cross_entropy, global_batch_size=batch,
                                   cluster=cluster, **case.pins)
        (directory / f"{case.key}.json").write_text(prog.plan.to_json())
        manifest["cases"][case.key] = dataclasses.asdict(case)
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


# ---------------------------------------------------------------------------------------------
# running one program
# ---------------------------------------------------------------------------------------------

def batches(plan: Any, vocab: int, seq: int, steps: int, device: str) -> list[tuple]:
    gen = torch.Generator().manual_seed(SEED + 1)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, vocab, (plan.global_batch_size, seq + 1), generator=gen)
        out.append((tok[:, :-1].contiguous().to(device), tok[:, 1:].contiguous().to(device)))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _compile_kwargs(torch_compile: bool) -> dict:
    from autopar.compile import compile_program
    import inspect
    if torch_compile:
        if "torch_compile" not in inspect.signature(compile_program).parameters:
            raise NotImplementedError("compile(torch_compile=True) is not in this autopar")
        return {"torch_compile": True}
    return {}


def autopar_runner(plan: Any, model: torch.nn.Module, seq: int, *, precision: str,
                   device: str, lr: float, torch_compile: bool = False) -> Any:
    import autopar
    example = torch.zeros(1, seq, dtype=torch.long)
    prog = autopar.parallelize(model, gpus=plan.gpus, example_inputs=(example,),
                               loss_fn=autopar.cross_entropy, cluster=plan.cluster, plan=plan)
    fused = device.startswith("cuda")
    opt = (lambda ps: torch.optim.AdamW(ps, lr=lr, fused=True)) if fused else \
        (lambda ps: torch.optim.AdamW(ps, lr=lr))
    return prog.compile(optimizer=opt, precision=precision, device=device,
                        **_compile_kwargs(torch_compile))


def time_steps(step: Callable[[Any, Any], float], data: list[tuple], warmup: int,
               device: str) -> tuple[list[float], list[float]]:
    """Run step over data; the losses of every step and the times of those after warm-up."""
    losses, times = [], []
    for i, (x, y) in enumerate(data):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(float(step(x, y)))
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return losses, times


def plain_step(model: torch.nn.Module, plan: Any, *, device: str, lr: float,
               bf16: bool, compiled: bool) -> Callable[[Any, Any], float]:
    """The hand-written loop a user would write: the plan's micro-batches accumulated, bf16
    autocast, fused AdamW (on CUDA), the model torch.compile'd."""
    import autopar
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.startswith("cuda"))
    fwd = torch.compile(model) if compiled else model
    m, mb = plan.num_microbatches, plan.micro_batch_size
    dtype = torch.bfloat16 if bf16 else torch.float32

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(m):
            xs, ys = x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]
            with torch.autocast(device_type=torch.device(device).type, dtype=dtype,
                                enabled=bf16):
                loss = autopar.cross_entropy(fwd(xs), ys) / m
            loss.backward()
            total += loss.detach()
        opt.step()
        return float(total)
    return step


def _group_of_one(device: str) -> None:
    """A default process group of one (NCCL on CUDA), as torchrun would make it."""
    import torch.distributed as dist
    from autopar.testing import free_port
    if dist.is_initialized():
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kwargs = {"device_id": torch.device(device)} if device.startswith("cuda") else {}
    dist.init_process_group(backend, **kwargs)


def measured_mfu(plan: Any, step_s: float) -> float:
    """MFU at the measured step time, with the model FLOPs the plan counts (its predicted
    MFU scaled by predicted over measured time: the same FLOP definition as the plan)."""
    return plan.predicted.mfu * plan.predicted.step_time_s / step_s


# ---------------------------------------------------------------------------------------------
# the parts
# ---------------------------------------------------------------------------------------------

class Rows(list):
    """A part's rows, written out as each one lands (a call stopped at its time limit keeps
    what it measured); a row that would start past the deadline is recorded as skipped."""

    def __init__(self, save: Callable[[], None], deadline: float):
        super().__init__()
        self.save, self.deadline = save, deadline

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()

    def run(self, key: str, label: str, fn: Callable[[], dict]) -> dict:
        if self.left_s() <= 0:
            row = {"case": key, "variant": label, "skipped": "past --deadline-s"}
        else:
            row = _guard(key, label, fn)
            _free()
        self.append(row)
        self.save()
        return row

    def skip(self, key: str, label: str, why: str) -> None:
        self.append({"case": key, "variant": label, "skipped": why})


def _free() -> None:
    """Drop the last measurement's program, so the next one (or calibrate's process) finds
    the device's memory free."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def part_single(plans: dict, keys: list[str], s: Sizes, device: str, quick: bool,
                rows: Rows) -> None:
    _group_of_one(device)
    compile_skip = quick and device == "cpu"
    for key in keys:
        plan = plans[key]
        name = key.split("-", 1)[1]
        seq = seq_of(name, s)
        data = batches(plan, vocab_of(build_model(name, s, "meta")), seq, s.steps + 2, device)
        # eager first: the program on this device at all, then the compiled pair
        for label, compiled, plain in (("autopar eager", False, False),
                                       ("plain eager", False, True),
                                       ("autopar compiled", True, False),
                                       ("plain torch.compile", True, True)):
            if compiled and compile_skip:
                rows.skip(key, label, "--quick on cpu: torch.compile takes minutes here")
            elif plain:
                rows.run(key, label, lambda label=label, compiled=compiled: _single_plain(
                    label, key, plan, name, s, device, data, True, compiled))
            else:
                rows.run(key, label, lambda label=label, compiled=compiled: _single_autopar(
                    label, key, plan, name, s, device, data, compiled))
        _ratios(rows, key)
        rows.save()


def _single_autopar(label: str, key: str, plan: Any, name: str, s: Sizes, device: str,
                    data: list, compiled: bool) -> dict:
    model = build_model(name, s, "cpu", init=device)
    runner = autopar_runner(plan, model, seq_of(name, s), precision="bf16",
                            device=device, lr=1e-4, torch_compile=compiled)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    losses, times = time_steps(runner.train_step, data, 2, device)
    return _timing_row(key, label, plan, losses, times, device)


def _single_plain(label: str, key: str, plan: Any, name: str, s: Sizes, device: str,
                  data: list, bf16: bool, compiled: bool) -> dict:
    model = build_model(name, s, device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    step = plain_step(model, plan, device=device, lr=1e-4, bf16=bf16, compiled=compiled)
    losses, times = time_steps(step, data, 2, device)
    return _timing_row(key, label, plan, losses, times, device)


def _timing_row(key: str, label: str, plan: Any, losses: list, times: list,
                device: str) -> dict:
    med = statistics.median(times)
    row = {"case": key, "variant": label, "step_s": med, "steps_s": times,
           "losses": losses, "mfu": measured_mfu(plan, med),
           "predicted_step_s": plan.predicted.step_time_s}
    if device.startswith("cuda"):
        row["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return row


def _ratios(rows: list[dict], key: str) -> None:
    """plain / autopar for the matching variants (eager with eager, compiled with compiled)."""
    by = {r["variant"]: r for r in rows if r["case"] == key and "step_s" in r}
    for a, p in (("autopar eager", "plain eager"), ("autopar compiled", "plain torch.compile"),
                 ("autopar compiled", "plain eager"), ("autopar eager", "plain torch.compile")):
        if a in by and p in by:
            by[a].setdefault("ratio_vs", {})[p] = by[p]["step_s"] / by[a]["step_s"]


def _guard(key: str, label: str, fn: Callable[[], dict]) -> dict:
    """Run one measurement; a failure becomes a row with its one-line reason."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - each part reports, the rest still runs
        return {"case": key, "variant": label, "error": _one_line(exc),
                "traceback": traceback.format_exc(limit=8)}


def _one_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {line}"


def _rank_losses(rank: int, world: int, plan_json: str, model_name: str, sizes: dict,
                 device: str, steps: int) -> list[float]:
    """One of several ranks sharing `device`: train the plan, return the losses."""
    import autopar
    s = Sizes(**sizes)
    plan = autopar.Plan.from_json(plan_json)
    model = build_model(model_name, s, "cpu")
    runner = autopar_runner(plan, model, seq_of(model_name, s), precision="fp32",
                            device=device, lr=1e-3)
    data = batches(plan, vocab_of(model), seq_of(model_name, s), steps, device)
    share = plan.global_batch_size // plan.d
    out = []
    for x, y in data:
        lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
        out.append(runner.train_step(x[lo:hi], y[lo:hi]))
    runner.close()
    return out


def single_device_losses(plan: Any, model_name: str, s: Sizes, device: str,
                         steps: int) -> list[float]:
    """The reference: the plain model on one device, fp32, AdamW, the whole global batch."""
    import autopar
    model = build_model(model_name, s, "cpu").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for x, y in batches(plan, vocab_of(model), seq_of(model_name, s), steps, device):
        opt.zero_grad()
        loss = autopar.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def part_multirank(plans: dict, keys: list[str], s: Sizes, device: str, quick: bool,
                   rows: Rows) -> None:
    from autopar.testing import spawn
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    steps = 3
    for key in keys:
        plan = plans[key]
        name = "mixtral" if key.endswith("ep2") else "small_gpt"
        if device.startswith("cuda") and (plan.p > 1 or plan.cp_attention == "ring"):
            rows.skip(key, "gloo ranks sharing " + device, "gloo cannot send CUDA tensors "
                      "point to point (`writev … Bad address`, H100 2026-11-26): needs NCCL, "
                      "one GPU per rank")
            continue

        def go(plan=plan, name=name, key=key) -> dict:
            got = spawn(_rank_losses, plan.gpus, plan.to_json(), name, dataclasses.asdict(s),
                        device, steps, timeout_s=max(30, min(900, rows.left_s())))[0]
            ref = single_device_losses(plan, name, s, device, steps)
            worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, ref))
            return {"case": key, "variant": "gloo ranks sharing " + device, "losses": got,
                    "reference": ref, "max_rel_diff": worst, "equal": worst <= 1e-4}
        rows.run(key, "gloo ranks sharing " + device, go)


COMPARED = ("peak_flops", "gemm_max_efficiency", "gemm_half_dim", "hbm_bandwidth_Bps",
            "elementwise_efficiency", "flash_fwd_efficiency", "flash_bwd_efficiency",
            "flash_half_len", "flash_half_head_dim", "memory_bytes")


def part_calibrate(plans: dict, keys: list[str], s: Sizes, device: str, quick: bool,
                   rows: Rows, out: Path, cluster: str) -> None:
    """`autopar calibrate` on this device, as a user runs it, into
    out/calibrated_cluster.json, beside the preset the plans were made for."""
    rows.run("calibrate", "autopar calibrate",
             lambda: _calibrate_row(out, device, quick, cluster, rows.left_s()))


def _calibrate_row(out: Path, device: str, quick: bool, cluster: str, left_s: float) -> dict:
    from autopar.cost.hardware import get_cluster
    preset = get_cluster(cluster)
    target = out / "calibrated_cluster.json"
    cmd = [sys.executable, "-m", "autopar.cli", "calibrate", "--out", str(target),
           "--name", f"{cluster}-calibrated"]
    if device.startswith("cuda"):
        cmd += ["--precision", "bf16", "--peak-tflops", f"{preset.peak_flops / 1e12:g}",
                "--base", cluster]   # one GPU measures no link: the preset's links are kept
    else:
        cmd += ["--ranks", "2"]
    if quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    # not under torchrun: the group of one this process made must not look like a launcher's
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env,
                         timeout=max(30, min(900, left_s)))
    row = {"case": "calibrate", "variant": " ".join(cmd[2:]), "rc": res.returncode,
           "seconds": time.perf_counter() - t0, "output_tail": (res.stdout + res.stderr)[-3000:]}
    if res.returncode == 0 and target.exists():
        row["cluster"] = json.loads(target.read_text())
        got = get_cluster(str(target))
        row["against_preset"] = {k: {"preset": getattr(preset, k, None),
                                     "measured": getattr(got, k, None)} for k in COMPARED}
    else:
        row["error"] = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return row


def part_memory(plans: dict, keys: list[str], s: Sizes, device: str, quick: bool,
                rows: Rows) -> None:
    _group_of_one(device)
    for key in keys:
        rows.run(key, "peak bytes", lambda plan=plans[key], key=key:
                 _memory_row(key, plan, s, device))


def _memory_row(key: str, plan: Any, s: Sizes, device: str) -> dict:
    model = build_model("mem_gpt", s, "cpu", init=device)
    runner = autopar_runner(plan, model, s.seq, precision="bf16", device=device, lr=1e-4)
    data = batches(plan, vocab_of(model), s.seq, 5, device)
    for x, y in data[:2]:                      # the optimizer state exists after a step
        runner.train_step(x, y)
    _, times = time_steps(runner.train_step, data[2:4], 0, device)
    x, y = data[4]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        runner.train_step(x, y)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        from autopar.testing import peak_tensor_bytes
        static = sum(t.numel() * t.element_size() for t in _live_state(runner))
        _, grown, _ = peak_tensor_bytes(lambda: runner.train_step(x, y))
        peak = static + grown
    step_s = statistics.median(times)
    mem = plan.predicted.memory
    predicted_static = mem.weights_bytes + mem.gradients_bytes + mem.optimizer_bytes
    predicted_act = mem.activations_bytes + mem.recompute_bytes
    return {"case": key, "variant": f"recompute={plan.recompute} mb={plan.micro_batch_size}",
            "measured_peak_bytes": peak, "measured_static_bytes": static,
            "measured_activation_bytes": peak - static,
            # two steps' median wall time (eager chunks, priced eager): the recompute's price
            "measured_step_s": step_s, "predicted_step_s": plan.predicted.step_time_s,
            "predicted_static_bytes": predicted_static,
            "predicted_activation_bytes": predicted_act,
            "predicted_total_bytes": mem.total_bytes - mem.other_bytes,
            "total_error": (predicted_static + predicted_act) / peak - 1,
            "activation_error": predicted_act / max(1, peak - static) - 1}


def _live_state(runner: Any) -> list[torch.Tensor]:
    """The tensors a rank holds between steps: parameters, their gradients, optimizer state."""
    seen, out = set(), []
    for p in runner.parameters():
        for t in (p, p.grad):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    opt = getattr(runner.regime, "optimizer", None)
    for state in (opt.state.values() if opt is not None else ()):
        for t in state.values():
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def part_checkpoint(plans: dict, keys: list[str], s: Sizes, device: str, quick: bool,
                    rows: Rows) -> None:
    """Issue 27 on a GPU: a synchronous save against an asynchronous one (pinned host staging,
    the writer process) while training goes on: the stall, against the goal ≤ 20% of the
    synchronous save's time (on the 2-core CPU host the writer had no idle core)."""
    _group_of_one(device)
    for key in keys:
        rows.run(key, "sync vs async save", lambda key=key: _checkpoint_row(
            key, plans[key], s, device))


def _checkpoint_row(key: str, plan: Any, s: Sizes, device: str) -> dict:
    import tempfile
    model = build_model("ckpt_gpt", s, "cpu", init=device)
    runner = autopar_runner(plan, model, s.seq, precision="bf16", device=device, lr=1e-4)
    data = batches(plan, vocab_of(model), s.seq, 4, device)

    def steps(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for i in range(n):
            runner.train_step(*data[i % len(data)])
        _sync(device)
        return time.perf_counter() - t0
    steps(2)
    step_s = steps(3) / 3
    with tempfile.TemporaryDirectory(dir=os.environ.get("AUTOPAR_CKPT_DIR")) as tmp:
        syncs = []
        for i in range(3):                       # the first makes the version directory
            t0 = time.perf_counter()
            runner.save_checkpoint(f"{tmp}/sync")
            syncs.append(time.perf_counter() - t0)
        sync_s = statistics.median(syncs[1:])
        written = sum(f.stat().st_size for f in Path(tmp, "sync").rglob("*") if f.is_file())
        runner.save_checkpoint(f"{tmp}/async", async_save=True)   # starts the writer
        runner.wait_for_checkpoint()
        n = max(3, int(3 * sync_s / step_s) + 1)   # steps overlapping the write
        trials = []
        for _ in range(2):
            before = steps(n)
            t0 = time.perf_counter()
            runner.save_checkpoint(f"{tmp}/async", async_save=True)
            block = time.perf_counter() - t0
            steps(n)
            runner.wait_for_checkpoint()
            with_save = time.perf_counter() - t0
            after = steps(n)
            trials.append((block, with_save - (before + after) / 2))
        equal = {kind: _guarded_reload(runner, f"{tmp}/{kind}", kind == "async", steps)
                 for kind in ("sync", "async")}
    from autopar.runtime import ckpt_writer
    pinned = ckpt_writer.WRITER._pinned
    runner.close()
    stall = statistics.median(t[1] for t in trials)
    return {"case": key, "variant": "sync vs async save", "step_s": step_s,
            "bytes_written": written, "sync_save_s": sync_s,
            "async_block_s": statistics.median(t[0] for t in trials), "async_stall_s": stall,
            "stall_over_sync": stall / sync_s, "overlapped_steps": n, "trials": trials,
            "reload_equal": equal, "staging_pinned": pinned}


def _guarded_reload(runner: Any, path: str, async_save: bool, steps: Callable) -> Any:
    """`_reloads_equal`, or its failure's one line (the timings above it stay in the row: the
    H100 run of 2026-11-27 lost its stall to a reload that failed)."""
    try:
        return _reloads_equal(runner, path, async_save, steps)
    except Exception as exc:  # noqa: BLE001 - recorded, the row keeps its timings
        return f"FAILED: {_one_line(exc)}"


def _reloads_equal(runner: Any, path: str, async_save: bool, steps: Callable) -> bool:
    """Save (sync or async) from the device, train a step (the state moves), load the save
    back: every weight and optimizer tensor equal to the saved ones, bit for bit."""
    runner.save_checkpoint(path, async_save=async_save)
    if async_save:
        runner.wait_for_checkpoint()
    saved = {k: t.cpu().clone() for k, t in _keyed_state(runner).items()}
    steps(1)
    runner.load_checkpoint(path)
    now = _keyed_state(runner)
    return saved.keys() == now.keys() and all(
        a.dtype == now[k].dtype and torch.equal(a, now[k].cpu()) for k, a in saved.items())


def _keyed_state(runner: Any) -> dict[str, torch.Tensor]:
    """The weights and optimizer state by a key that survives a load (the optimizer's state
    is rebuilt in another order): the parameter's place, and the state's name."""
    out = {f"param{i}": p.detach() for i, p in enumerate(runner.parameters())}
    opt = getattr(runner.regime, "optimizer", None)
    if opt is not None:
        place = {id(p): i for i, p in enumerate(
            p for g in opt.param_groups for p in g["params"])}
        for p, state in opt.state.items():
            for name, t in state.items():
                if isinstance(t, torch.Tensor):
                    out[f"opt{place[id(p)]}.{name}"] = t.detach()
    return out


def part_profile(plans: dict, keys: list[str], s: Sizes, device: str, quick: bool,
                 rows: Rows, out: Path) -> None:
    _group_of_one(device)
    for key in keys:
        rows.run(key, "one eager step profiled", lambda key=key: _profile_row(
            key, plans[key], s, device, out))


def _profile_row(key: str, plan: Any, s: Sizes, device: str, out: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile
    name = key.split("-", 1)[1]
    model = build_model(name, s, "cpu", init=device)
    runner = autopar_runner(plan, model, seq_of(name, s), precision="bf16", device=device,
                            lr=1e-4)
    data = batches(plan, vocab_of(model), seq_of(name, s), 3, device)
    for x, y in data[:2]:
        runner.train_step(x, y)
    _sync(device)
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        runner.train_step(*data[2])
        _sync(device)
    wall = time.perf_counter() - t0
    runner.close()
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, attr, 0), reverse=True)[:30]
    # kernels only: CUPTI's "Command Buffer Full" marks the host waiting on a full launch
    # queue (196 ms of the Llama's step on the H100, 2026-11-27), not device work
    busy_us = sum(getattr(e, attr, 0) for e in events
                  if not e.key.startswith("Command Buffer Full") and (
                      not cuda or "CUDA" in str(getattr(e, "device_type", ""))))
    (out / f"{key}.txt").write_text(events.table(sort_by=attr, row_limit=40) + "\n")
    return {"case": key, "variant": "one eager step profiled", "wall_s": wall,
            "device_busy_s": busy_us / 1e6, "predicted_step_s": plan.predicted.step_time_s,
            "top": [{"name": e.key[:90], "calls": e.count, "self_s": getattr(e, attr, 0) / 1e6}
                    for e in top]}


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------

def table(results: dict) -> str:
    lines = [f"autopar on {results['device_name']} ({results['device']}), torch "
             f"{results['torch']}, {results['date']}"]
    for part in PARTS:
        rows = results["parts"].get(part)
        if rows is None:
            continue
        lines.append(f"\n[{part}]")
        for r in rows:
            lines.append("  " + _row_text(part, r))
    return "\n".join(lines)


def _row_text(part: str, r: dict) -> str:
    head = f"{r['case']:<24} {r.get('variant', ''):<28}"
    if "error" in r:
        return f"{head} FAILED: {r['error']}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if part == "single":
        ratios = " ".join(f"{k}: {v:.3f}×" for k, v in r.get("ratio_vs", {}).items())
        return (f"{head} {r['step_s'] * 1e3:9.1f} ms/step  MFU {r['mfu'] * 100:5.1f}%  "
                f"(predicted {r['predicted_step_s'] * 1e3:.1f} ms)  {ratios}")
    if part == "multirank":
        return f"{head} max rel. loss diff {r['max_rel_diff']:.2e}  " \
               f"{'EQUAL' if r['equal'] else 'DIFFERENT'} to one device"
    if part == "memory":
        g = 2 ** 30
        return (f"{head} peak {r['measured_peak_bytes'] / g:7.3f} GiB vs predicted "
                f"{(r['predicted_static_bytes'] + r['predicted_activation_bytes']) / g:7.3f} "
                f"({r['total_error'] * 100:+.0f}%); activations {r['measured_activation_bytes'] / g:.3f}"
                f" vs {r['predicted_activation_bytes'] / g:.3f} ({r['activation_error'] * 100:+.0f}%)"
                + (f"; step {r['measured_step_s'] * 1e3:.0f} ms vs predicted "
                   f"{r['predicted_step_s'] * 1e3:.0f}" if "measured_step_s" in r else ""))
    if part == "profile":
        tops = "; ".join(f"{t['name'][:40]} {t['self_s'] * 1e3:.0f} ms" for t in r["top"][:4])
        return (f"{head} wall {r['wall_s'] * 1e3:.0f} ms, device busy "
                f"{r['device_busy_s'] * 1e3:.0f} ms (predicted {r['predicted_step_s'] * 1e3:.0f}"
                f" ms): {tops}")
    if part == "checkpoint":
        return (f"{head} {r['bytes_written'] / 2 ** 30:.2f} GiB: sync save "
                f"{r['sync_save_s']:.2f} s; async blocks {r['async_block_s']:.2f} s, stall "
                f"{r['async_stall_s']:.2f} s = {r['stall_over_sync'] * 100:.0f}% of sync "
                f"(goal ≤ 20%) over {r['overlapped_steps']} steps of {r['step_s'] * 1e3:.0f} ms; "
                f"staging {'pinned' if r.get('staging_pinned') else 'pageable'}; reloaded "
                f"equal: {r.get('reload_equal')}")
    vs = "  ".join(f"{k} {v['measured']:.3g} (preset {v['preset']:.3g})"
                   for k, v in r.get("against_preset", {}).items()
                   if isinstance(v["measured"], (int, float))
                   and isinstance(v["preset"], (int, float)))
    return f"{head} rc={r.get('rc')} in {r.get('seconds', 0):.0f} s  {vs}"


def part_steps(parts: tuple[str, ...], plans: dict) -> list[tuple[str, list[str]]]:
    """`--parts` as (part, its cases) in the order given: `single` runs every single-* case,
    `single:single-gpt` only that one (`+` joins several), so one call can run the cases that
    matter most first and a part's rest last."""
    steps = []
    for entry in parts:
        part, _, only = entry.partition(":")
        mine = sorted(k for k in plans if k.startswith(part + "-"))
        keys = [k for k in only.split("+") if k] or mine
        bad = [k for k in keys if k not in mine]
        if part not in PARTS or bad:
            raise ValueError(f"--parts {entry!r}: " + (f"{part!r} is not a part; pick from "
                             f"{', '.join(PARTS)}" if part not in PARTS else
                             f"{bad[0]!r} is not a prepared {part} case; pick from "
                             f"{', '.join(mine)} (or prepare it)"))
        steps.append((part, keys))
    return steps


def run(directory: Path, out: Path, device: str, quick: bool, parts: tuple[str, ...],
        deadline_s: float = 1e9) -> dict:
    import autopar
    start = time.perf_counter()
    manifest = json.loads((directory / "manifest.json").read_text())
    s = Sizes(**manifest["sizes"])
    plans = {k: autopar.Plan.from_json((directory / f"{k}.json").read_text())
             for k in manifest["cases"]}
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() \
        or platform.machine()
    results = {"device": device, "device_name": name, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": quick,
               "cluster": manifest["cluster"], "parts": {}, "part_seconds": {}}

    def save() -> None:
        (out / "gpu_results.json").write_text(json.dumps(results, indent=1, default=str))

    runners = {"single": part_single, "multirank": part_multirank, "memory": part_memory,
               "checkpoint": part_checkpoint,
               "profile": lambda *a: part_profile(*a, out),
               "calibrate": lambda *a: part_calibrate(*a, out, manifest["cluster"])}
    for part, keys in part_steps(parts, plans):
        t0 = time.perf_counter()
        rows = Rows(save, start + deadline_s)
        rows.extend(results["parts"].get(part, []))
        results["parts"][part] = rows
        try:
            runners[part](plans, keys, s, device, quick, rows)
        except Exception as exc:  # noqa: BLE001 - each part reports, the rest still run
            rows.append(_guard(part, "whole part", lambda: (_ for _ in ()).throw(exc)))
        seconds = results["part_seconds"].get(part, 0.0) + time.perf_counter() - t0
        results["part_seconds"][part] = seconds
        print(f"[{part}] {'+'.join(keys) or part} done in {time.perf_counter() - t0:.0f} s",
              flush=True)
        save()
    text = table(results)
    (out / "gpu_results.txt").write_text(text + "\n")
    print(text)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("command", choices=["prepare", "run", "all"])
    ap.add_argument("--dir", default="gpu_run", help="where the prepared plans are")
    ap.add_argument("--out", default="gpu_out", help="where the results go")
    ap.add_argument("--device", default=None, help="cuda where there is one, else cpu; plans "
                    "are made for dgx-h100-80gb unless --device cpu is given")
    ap.add_argument("--quick", action="store_true", help="tiny models: the plumbing only")
    ap.add_argument("--cluster", default=None,
                    help="the cluster the plans are made for (default: dgx-h100-80gb, "
                         "local-cpu with --device cpu)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts, in the "
                    "order to run, from " + ", ".join(PARTS) + "; PART:CASE+CASE runs only "
                    "those cases (e.g. single:single-gpt,calibrate,single:single-llama)")
    ap.add_argument("--deadline-s", type=float, default=1e9, dest="deadline_s",
                    help="no measurement starts after this many seconds of `run` (each is "
                    "recorded as skipped), so a call with a time limit ends with its results")
    ap.add_argument("--cases", default="", help="comma-separated case names (e.g. "
                    "single-gpt,multirank-t2,memory-none-mb2) to keep; default: every case")
    a = ap.parse_args(argv)
    parts = tuple(p for p in a.parts.split(",") if p)
    bad = [p for p in parts if p.partition(":")[0] not in PARTS]
    if bad:
        ap.error(f"--parts {bad[0]!r}: not a part; pick from {', '.join(PARTS)}")
    asked = a.device
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: torch sees no CUDA device here; run on the GPU machine "
                 f"or pass --device cpu")
    device = "cuda:0" if a.device == "cuda" else a.device
    # `prepare` on the CPU side (no --device) plans for the GPU; --device cpu: for this host
    cluster = a.cluster or ("local-cpu" if asked == "cpu" else "dgx-h100-80gb")
    s = Sizes.pick(a.quick)
    keep = tuple(k for k in a.cases.split(",") if k)
    known = {c.key for c in cases(s, cluster)}
    if any(k not in known for k in keep):
        ap.error(f"--cases {next(k for k in keep if k not in known)!r}: not a case; pick from "
                 f"{', '.join(sorted(known))}")
    if a.command in ("prepare", "all"):
        made = prepare(Path(a.dir), s, cluster, keep)
        print(f"prepared {len(made['cases'])} plans in {a.dir}/", flush=True)
    if a.command in ("run", "all"):
        try:
            run(Path(a.dir), Path(a.out), device, a.quick, parts, a.deadline_s)
        except ValueError as exc:
            ap.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

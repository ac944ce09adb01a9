"""Tiny parallel programs for the runtime tests: a hand-made Plan, the ParallelProgram of a
models.runtime_model under it, its data, the Runner trained on gloo ranks, and the check of
that run against the same model trained on one device (reference.train): losses and
full_state_dict at rtol 1e-4 / atol 1e-5. Module level: spawned ranks import it by name."""
from __future__ import annotations

import time
from typing import Callable

import torch

from autopar.api import ParallelProgram
from autopar.plan import Plan, Prediction, Stage
from autopar.testing import spawn

from models import RUNTIME_VOCAB, runtime_model, token_batches
from reference import Trained, assert_weights_match, optimizer_state_bytes, train

STEPS = 3
SEQ = 8
LR = 3e-4  # AdamW default of compile(); 3 steps move weights by ~1e-3 ≫ atol
MAX_NORM = 1.0
TRAINING_LR = 1e-3   # check_training's AdamW (with weight decay 0.1)
# bf16 tolerance: the loss is itself a bf16 number (8 significant bits: for a loss in [4, 8)
# one ulp is 2^-5 = 0.031), and the parallel run sums micro-batches and replicas in another
# order than the single-device run, so losses agree to ~1 bf16 ulp: rtol 2^-7 (two ulps).
# Weights are the fp32 masters; AdamW (lr 1e-3) moves them by <= ~1e-3 per step whatever the
# gradient rounding, so the masters agree to atol 3e-3 after 3 steps.
BF16_LOSS_RTOL = 2.0 ** -7
BF16_WEIGHT_ATOL = 3e-3
# When an element is past BF16_WEIGHT_ATOL (Adam amplifying bf16 rounding on a near-zero
# gradient), the rest of the tensor's update must agree within this fraction of its norm:
# bf16's unit roundoff is 2^-8 = 0.39% per operation, and the summation orders differ, so the
# fp32 bound (reference.UPDATE_RTOL, 0.5%) is missed by bf16 noise alone (0.52% measured on an
# AMD EPYC host: hf_llama's embedding at t=2); 1% still fails a learning rate 2% off.
BF16_UPDATE_RTOL = 1e-2
# The median over tensors of each tensor's update error (reference.median_update_error): bf16
# noise 0.3 - 0.8% on the tiny GPT and Llama-style models (their masters perturbed by 1e-6, a
# stand-in for another summation order), a learning rate 2% off 2.1%. Checked where the plan
# splits no matmul (t = c = 1: data, pipeline, ZeRO): at t = 2 the row-parallel partial sums
# are rounded to bf16 before their all-reduce and the median tensor's update is 1.8 - 2.9% off
# the single device's (measured on test_mixed_precision's t = 2 models), as far as a 2% learning
# rate: there the update scale below is what catches a learning-rate error.
BF16_MEDIAN_UPDATE_RTOL = 1.4e-2
# The updates' least-squares scale against the reference's (reference.update_scale), checked at
# every plan, t = 2 included: bf16 noise leaves it within 0.19% of 1 (0.02 - 0.13% on
# test_mixed_precision's plans, t = 2 and ZeRO-3 t = 2 d = 2 among them; 0.19% on a perturbed
# single-device GPT), a learning rate 2% off moves it 1.97 - 2.0%.
BF16_UPDATE_SCALE_RTOL = 5e-3


def loss_fn(output, targets):
    from autopar.losses import cross_entropy
    return cross_entropy(output, targets)


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def make_plan(*, t=1, p=1, d=1, v=1, b=2, m=2, schedule="1f1b", layers=2,
              split: list[int] | None = None) -> Plan:
    """A hand-made plan; `split` gives the layer count of each of the p·v chunks."""
    chunks = p * v
    if split is None:
        base, extra = divmod(layers, chunks)
        split = [base + (c < extra) for c in range(chunks)]
    stages, first = [], 0
    for c, n in enumerate(split):
        stages.append(Stage(chunk=c, rank=c % p, first_layer=first, last_layer=first + n,
                            embedding=c == 0, head=c == chunks - 1))
        first += n
    pred = Prediction(step_time_s=1.0, tflops_per_gpu=0.0, mfu=0.0, bubble_fraction=0.0,
                      memory_bytes_per_gpu=0.0, compute_s=1.0, tp_comm_s=0.0, pp_comm_s=0.0,
                      dp_comm_s=0.0, bubble_s=0.0)
    return Plan(t=t, p=p, d=d, v=v, micro_batch_size=b, num_microbatches=m, schedule=schedule,
                recompute="none", sequence_parallel=False, zero=0, stages=tuple(stages),
                predicted=pred, global_batch_size=b * m * d, seq_len=SEQ, cluster="local-cpu",
                num_layers=layers)


def adamw_decayed(params):
    return torch.optim.AdamW(params, lr=TRAINING_LR, weight_decay=0.1)


def with_zero(plan: Plan, zero: int) -> Plan:
    return Plan.from_dict({**plan.to_dict(), "zero": zero})


def make_data(plan: Plan, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of random tokens (seed 1234)."""
    return token_batches(vocab, (plan.global_batch_size, SEQ), STEPS, seed=1234)


def make_program(name: str, plan: Plan) -> tuple[ParallelProgram, int]:
    """(program, vocab) of models.runtime_model(name) under `plan`."""
    model = runtime_model(name, plan.num_layers)
    ex = torch.zeros(plan.micro_batch_size, SEQ, dtype=torch.long)
    return ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(ex,),
                           loss_fn=loss_fn, example_targets=ex, cluster=None), RUNTIME_VOCAB


def train_steps(runner, plan: Plan, batches) -> list[float]:
    """runner.train_step on this data-parallel rank's share of each global batch."""
    share = plan.global_batch_size // plan.d
    lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
    return [runner.train_step(x[lo:hi], y[lo:hi]) for x, y in batches]


def failed_step(runner, x, y) -> tuple[str, str, float] | None:
    """(exception type, message, seconds until raised) of runner.train_step(x, y); None if
    the step succeeds (the tests of a peer dying mid-step)."""
    t0 = time.monotonic()
    try:
        runner.train_step(x, y)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks its kind
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


def train_rank(rank: int, world: int, name: str, plan: Plan, optimizer: Callable = adamw,
               max_grad_norm: float | None = MAX_NORM, precision: str = "fp32",
               batches: list | None = None, program_dir: str | None = None):
    """On each rank: (losses, full_state_dict, optimizer-state bytes) after STEPS steps (on
    make_data's batches, or the given global batches; the chunks generated in memory, or read
    from program_dir, written by prog.save)."""
    prog, vocab = make_program(name, plan)
    runner = prog.compile(optimizer=optimizer, max_grad_norm=max_grad_norm,
                          precision=precision, timeout_s=60, program_dir=program_dir)
    losses = train_steps(runner, plan, batches or make_data(plan, vocab))
    return losses, runner.full_state_dict(), runner.optimizer_state_bytes()


def train_single_device(name: str, plan: Plan, optimizer: Callable = adamw,
                        batches: list | None = None, **kwargs) -> Trained:
    """reference.train of the model make_program(name, plan) holds, on make_data(plan) (or
    the given global batches); kwargs: train's (max_grad_norm, precision, keep_states)."""
    return train(runtime_model(name, plan.num_layers),
                 batches or make_data(plan, RUNTIME_VOCAB), optimizer, loss_fn=loss_fn, **kwargs)


def check_trained(results: list, ref: Trained, init: dict[str, torch.Tensor]) -> None:
    """Every rank's losses (results[r][0]) and rank 0's full_state_dict (results[0][1])
    equal the single-device `ref` (rtol 1e-4 / atol 1e-5), and training moved some weight
    away from `init` (so the comparison can fail)."""
    for r, (losses, *_) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} losses: {m}")
    state = results[0][1]
    assert any(not torch.equal(init[k], state[k]) for k in init)   # training moved weights
    assert_weights_match(state, ref.state, init)   # robust to AdamW's amplified rounding


def check_against_reference(name: str, plan: Plan, timeout_s: float = 240.0,
                            batches: list | None = None) -> None:
    """The Runner under `plan` (AdamW lr LR, clipping at MAX_NORM) equals one device, on
    make_data's batches or the given global batches."""
    results = spawn(train_rank, plan.gpus, name, plan, batches=batches, timeout_s=timeout_s)
    ref = train_single_device(name, plan, batches=batches, max_grad_norm=MAX_NORM)
    check_trained(results, ref, runtime_model(name, plan.num_layers).state_dict())
    assert all(r[1] == {} for r in results[1:])


def run_cases(rank: int, world: int, fn: Callable, cases: list[tuple]) -> list:
    """fn(rank, world, *args, **kwargs) of each (label, args, kwargs) case in turn on this
    rank's process group (spawn_cases' target); a case that raises is named in the error."""
    out = []
    for label, args, kwargs in cases:
        try:
            out.append(fn(rank, world, *args, **kwargs))
        except Exception as exc:
            raise RuntimeError(f"case {label} raised on rank {rank}: {exc!r}") from exc
    return out


def spawn_cases(fn: Callable, world: int, cases: dict[str, tuple[tuple, dict]],
                case_timeout_s: float = 90.0) -> dict[str, list]:
    """{label: per-rank results} of fn(rank, world, *args, **kwargs) for every case (label ->
    (args, kwargs)), all on ONE spawn of `world` ranks, in turn: no fork, process group or
    cold caches per case. The deadline is 120 s + case_timeout_s per case."""
    jobs = [(label, args, kwargs) for label, (args, kwargs) in cases.items()]
    per_rank = spawn(run_cases, world, fn, jobs, timeout_s=120 + case_timeout_s * len(jobs))
    return {label: [res[j] for res in per_rank] for j, label in enumerate(cases)}


def train_cases(cases: dict[str, tuple], optimizer: Callable = adamw,
                case_timeout_s: float = 90.0) -> dict[str, list]:
    """{label: per-rank train_rank results} of every case (label -> (name, plan) or (name,
    plan, global batches)): ONE spawn per world size among the plans trains its cases in turn
    (spawn_cases), a fresh compile() each."""
    results: dict[str, list] = {}
    for world in sorted({c[1].gpus for c in cases.values()}):
        results.update(spawn_cases(train_rank, world, {
            label: ((c[0], c[1]), dict(optimizer=optimizer, batches=c[2] if len(c) > 2 else None))
            for label, c in cases.items() if c[1].gpus == world}, case_timeout_s))
    return results


def check_case(label: str, case: tuple, results: list, optimizer: Callable = adamw) -> None:
    """check_against_reference's check of one case of train_cases (`results`: its per-rank
    results) against its own single-device run; the assertion names `label`."""
    name, plan = case[:2]
    try:
        ref = train_single_device(name, plan, optimizer, batches=case[2] if len(case) > 2
                                  else None, max_grad_norm=MAX_NORM)
        check_trained(results, ref, runtime_model(name, plan.num_layers).state_dict())
        assert all(r[1] == {} for r in results[1:]), "ranks > 0 returned weights"
    except AssertionError as exc:
        raise AssertionError(f"case {label}: {exc}") from exc


class TrainedCases:
    """The cases of a test module (label -> train_cases' case), trained a world size at a time
    the first time a test asks for one of them; `check(label)` is check_case of that case. Held
    by a module-scoped fixture, it lets each test keep its name and its own reference check
    while one spawn per world size trains every case."""

    def __init__(self, cases: dict[str, tuple], case_timeout_s: float = 90.0) -> None:
        self.cases, self.case_timeout_s = cases, case_timeout_s
        self.results: dict[str, list] = {}

    def __getitem__(self, label: str) -> list:
        if label not in self.results:
            world = self.cases[label][1].gpus
            self.results.update(train_cases(
                {k: c for k, c in self.cases.items()
                 if c[1].gpus == world and k not in self.results},
                case_timeout_s=self.case_timeout_s))
        return self.results[label]

    def check(self, label: str) -> None:
        check_case(label, self.cases[label], self[label])


def check_cases_against_reference(cases: dict[str, tuple], optimizer: Callable = adamw) -> None:
    """check_against_reference of every case (label -> (name, plan) or (name, plan, global
    batches)) trained by train_cases, each against its own single-device run at the same
    tolerances; every differing case is named in the assertion."""
    results = train_cases(cases, optimizer)
    failures = []
    for label, case in cases.items():
        try:
            check_case(label, case, results[label], optimizer)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, f"{len(failures)} of {len(cases)} cases differ from one device:\n" + \
        "\n".join(failures)


def check_training(name: str, plan: Plan, *, max_norm: float | None = None,
                   precision: str = "fp32", timeout_s: float = 300.0,
                   program_dir: str | None = None):
    """The Runner under `plan` (AdamW lr TRAINING_LR, weight decay 0.1, clipping at max_norm
    if given, `precision`; its chunks read from program_dir if given) equals one device
    trained the same way: fp32 at rtol 1e-4 / atol 1e-5, bf16 against a single-device bf16
    run at BF16_LOSS_RTOL / BF16_WEIGHT_ATOL; (per-rank results, the reference's
    optimizer-state bytes)."""
    results = spawn(train_rank, plan.gpus, name, plan, adamw_decayed, max_norm, precision,
                    program_dir=program_dir, timeout_s=timeout_s)
    return results, compare_training(name, plan, results, max_norm=max_norm,
                                     precision=precision)


def sgd_momentum(params):
    """SGD with momentum for bf16 comparisons of models whose tensors see few tokens (experts):
    AdamW's normalised step turns bf16 rounding of their near-zero gradients into lr-sized
    moves (tests/numerics/test_expert_parallel_program.py's _optim), SGD keeps it in
    proportion."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def compare_training(name: str, plan: Plan, results: list, *, max_norm: float | None = None,
                     precision: str = "fp32", optimizer: Callable = adamw_decayed) -> int:
    """check_training's comparison of per-rank train_rank `results` (trained with
    `optimizer`, max_norm and precision: a spawn_cases case may train them) against one
    device; the reference's optimizer-state bytes."""
    ref = train_single_device(name, plan, optimizer, max_grad_norm=max_norm,
                              precision=precision)
    if max_norm is not None:  # the check can fail: clipping really changed the gradients
        assert min(ref.grad_norms) > 2 * max_norm, ref.grad_norms
    tol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(rtol=BF16_LOSS_RTOL,
                                                                       atol=0.0)
    for r, (losses, _, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), **tol,
                                   msg=lambda m: f"rank {r} losses: {m}")
    state = results[0][1]
    wtol = dict(rtol=1e-4, atol=1e-5) if precision == "fp32" else dict(
        rtol=0, atol=BF16_WEIGHT_ATOL, update_rtol=BF16_UPDATE_RTOL,
        median_update_rtol=BF16_MEDIAN_UPDATE_RTOL if plan.t == plan.c == 1 else None,
        update_scale_rtol=BF16_UPDATE_SCALE_RTOL)
    init = runtime_model(name, plan.num_layers).state_dict()
    assert_weights_match(state, ref.state, init, **wtol)
    assert any(not torch.equal(init[k].float(), state[k].float()) for k in ref.state)
    return optimizer_state_bytes(ref.optimizer)

"""Multi-process gloo numerics: the parallel program trained for 3 AdamW steps equals the
single-device model trained on the same data (losses and full_state_dict, rtol 1e-4/atol 1e-5).
Also the bad-input errors of compile/train_step and a peer dying mid-step."""
from __future__ import annotations

import copy
import os
import time

import hf_zoo
import pytest
import torch

from autopar.api import ParallelProgram
from autopar.plan import Plan, Prediction, Stage
from autopar.testing import SpawnError, spawn

pytestmark = pytest.mark.distributed

STEPS = 3
SEQ = 8
LR = 3e-4  # AdamW default of compile(); 3 steps move weights by ~1e-3 ≫ atol
MAX_NORM = 1.0


# ---- models -------------------------------------------------------------------------------
def make_model(name: str, layers: int) -> tuple[torch.nn.Module, int]:
    """(model, vocab) built with seed 0, the same in every process."""
    torch.manual_seed(0)
    if name == "gpt":
        from autopar.examples.gpt import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2,
                             n_embd=32)), 64
    if name == "gpt-untied":
        from autopar.examples.gpt import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=32,
                             tie_embeddings=False)), 64
    if name == "llama":
        from autopar.examples.llama import LlamaStyle, llama_tiny
        return LlamaStyle(llama_tiny(n_layer=layers, vocab_size=64, n_embd=32, ffn_hidden=48,
                                     block_size=16)), 64
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=layers, n_head=2,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg), 64
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=16)
        return LlamaForCausalLM(cfg), 64
    if name == "hf-falcon":   # fused qkv grouped per kv head (new decoder architecture)
        return hf_zoo.hf_falcon(layers), 64
    if name == "hf-bloom":    # ALiBi: one bias tensor read by every layer
        return hf_zoo.hf_bloom(layers), 64
    raise ValueError(name)


def loss_fn(output, targets):
    from autopar.losses import cross_entropy
    return cross_entropy(output, targets)


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


def make_data(plan: Plan, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    shape = (plan.global_batch_size, SEQ)
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(STEPS)]


def make_program(name: str, plan: Plan) -> tuple[ParallelProgram, int]:
    model, vocab = make_model(name, plan.num_layers)
    ex = torch.zeros(plan.micro_batch_size, SEQ, dtype=torch.long)
    return ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(ex,),
                           loss_fn=loss_fn, example_targets=ex, cluster=None), vocab


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR)


# ---- single device reference ------------------------------------------------------------
def reference(name: str, plan: Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, vocab = make_model(name, plan.num_layers)
    opt = _optimizer(model.parameters())
    losses = []
    for x, y in make_data(plan, vocab):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- rank function ----------------------------------------------------------------------
def train_rank(rank: int, world: int, name: str, plan: Plan, program_dir: str | None = None):
    prog, vocab = make_program(name, plan)
    kw = {"program_dir": program_dir} if program_dir else {}
    runner = prog.compile(optimizer=_optimizer, max_grad_norm=MAX_NORM, timeout_s=60, **kw)
    share = plan.global_batch_size // plan.d
    losses = []
    for x, y in make_data(plan, vocab):
        lo, hi = runner.dp_rank * share, (runner.dp_rank + 1) * share
        losses.append(runner.train_step(x[lo:hi], y[lo:hi]))
    return losses, runner.full_state_dict()


def check_against_reference(name: str, plan: Plan, timeout_s: float = 240.0) -> None:
    results = spawn(train_rank, plan.gpus, name, plan, timeout_s=timeout_s)
    ref_losses, ref_state = reference(name, plan)
    for r, (losses, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} losses: {m}")
    state = results[0][1]
    assert list(state) == list(ref_state), "full_state_dict keys differ from the model's"
    moved = 0
    for key, ref in ref_state.items():
        torch.testing.assert_close(state[key], ref, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=key: f"{k}: {m}")
    # the check can fail: training moved the weights away from their initial values
    init, _ = make_model(name, plan.num_layers)
    for key, value in init.state_dict().items():
        moved += int(not torch.equal(value, state[key]))
    assert moved > 0
    assert all(r[1] == {} for r in results[1:])


# ---- numerics ---------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_p2(schedule):
    check_against_reference("gpt", make_plan(p=2, m=4, schedule=schedule, layers=2))


def test_gpt_p2_interleaved_v2():
    check_against_reference("gpt", make_plan(p=2, v=2, m=4, schedule="interleaved-1f1b",
                                             layers=4))


def test_gpt_p2_interleaved_zero_bubble_v2():
    """B / W split backwards (tied embeddings: chunk 0's backward is all W)."""
    check_against_reference("gpt", make_plan(p=2, v=2, m=4, schedule="interleaved-zb",
                                             layers=4))


def test_gpt_p2_zero_bubble_v1_uneven():
    """v = 1 is ZB-H1 on the 1F1B order; 3 layers over 2 stages."""
    check_against_reference("gpt", make_plan(p=2, m=3, schedule="interleaved-zb", layers=3))


def test_llama_p2_d2_interleaved_zero_bubble():
    """Data-parallel buckets armed before the last W (weight gradients accumulate there)."""
    check_against_reference("llama", make_plan(p=2, d=2, v=2, m=2, schedule="interleaved-zb",
                                               layers=4))


def test_gpt_uneven_chunks_3_layers_p2():
    check_against_reference("gpt", make_plan(p=2, m=3, schedule="1f1b", layers=3))


def test_gpt_p2_interleaved_head_only_last_chunk():
    """The planner's layout may leave the last chunk with the head + loss alone (a tied one:
    its weight is the embedding's, on the other pipeline rank)."""
    check_against_reference("gpt", make_plan(p=2, v=2, m=4, schedule="interleaved-1f1b",
                                             layers=4, split=[1, 2, 1, 0]))


def test_llama_p2_embedding_only_first_chunk():
    check_against_reference("llama", make_plan(p=2, m=2, schedule="1f1b", layers=2,
                                               split=[0, 2]))


def test_gpt_p2_d2():
    check_against_reference("gpt", make_plan(p=2, d=2, m=2, schedule="1f1b", layers=2))


def test_gpt_d2_only():
    check_against_reference("gpt", make_plan(d=2, m=2, layers=2))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_p4(schedule):
    check_against_reference("gpt", make_plan(p=4, m=4, schedule=schedule, layers=4))


@pytest.mark.slow
def test_gpt_p4_interleaved_uneven():
    # 9 layers over p·v = 8 chunks (one chunk gets two), m=5 not a multiple of p
    check_against_reference("gpt", make_plan(p=4, v=2, m=5, schedule="interleaved-1f1b",
                                             layers=9), timeout_s=400)


def test_llama_p2():
    check_against_reference("llama", make_plan(p=2, m=2, schedule="1f1b", layers=2))


def test_untied_gpt_p2_breadth_first():
    check_against_reference("gpt-untied", make_plan(p=2, v=2, m=2, schedule="breadth-first",
                                                    layers=4))


@pytest.mark.slow
def test_hf_gpt2_p2():
    pytest.importorskip("transformers")
    check_against_reference("hf-gpt2", make_plan(p=2, m=2, schedule="1f1b", layers=2))


@pytest.mark.slow
def test_hf_llama_p2():
    pytest.importorskip("transformers")
    check_against_reference("hf-llama", make_plan(p=2, m=2, schedule="1f1b", layers=2))


@pytest.mark.slow
def test_hf_falcon_t2_p2_interleaved():
    pytest.importorskip("transformers")
    check_against_reference("hf-falcon", make_plan(t=2, p=2, v=2, m=2,
                                                   schedule="interleaved-1f1b", layers=4))


@pytest.mark.slow
def test_hf_bloom_p2_uneven():
    pytest.importorskip("transformers")
    check_against_reference("hf-bloom", make_plan(p=2, m=2, schedule="1f1b", layers=3))


# ---- bad input --------------------------------------------------------------------------
def _compile_rank(rank, world, plan):
    prog, _ = make_program("gpt", plan)
    try:
        prog.compile(timeout_s=30)
    except ValueError as exc:
        return str(exc)
    return None


def test_world_size_mismatch_is_a_clear_error():
    plan = make_plan(p=2, m=2, layers=2)
    messages = spawn(_compile_rank, 3, plan, timeout_s=120)
    for msg in messages:
        assert msg is not None and "WORLD_SIZE=3" in msg and "t·p·d" in msg


def test_too_few_microbatches_is_a_clear_error(monkeypatch):
    plan = make_plan(p=2, m=2, layers=2)
    plan = Plan.from_dict({**plan.to_dict(), "num_microbatches": 1, "global_batch_size": 2})
    monkeypatch.setenv("WORLD_SIZE", "2")
    prog, _ = make_program("gpt", plan)
    with pytest.raises(ValueError, match=r"num_microbatches=1 < p=2"):
        prog.compile()


def test_v_larger_than_layers_allow_is_a_clear_error(monkeypatch):
    plan = make_plan(p=2, v=2, m=2, schedule="interleaved-1f1b", layers=2,
                     split=[1, 1, 0, 0])
    monkeypatch.setenv("WORLD_SIZE", "2")
    prog, _ = make_program("gpt", plan)
    with pytest.raises(ValueError, match=r"p·v = 2·2 = 4 chunks but the model has 2 layers"):
        prog.compile()


def _after_one_step(plan, timeout_s):
    """A GPT runner for `plan` that has taken one step, and that step's batch."""
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(timeout_s=timeout_s)
    x, y = make_data(plan, vocab)[0]
    runner.train_step(x, y)
    return runner, x, y


def _dying_rank(rank, world, plan):
    runner, x, y = _after_one_step(plan, timeout_s=20)
    if rank == 1:  # die in the middle of step 2: after the first forward
        ex = runner.executor
        regime_hook, done = ex.before_action, []

        def die_after_first_forward(n, action):   # the executor's public per-action hook
            if "F" in done:
                os._exit(3)
            done.append(action.kind)
            if regime_hook is not None:
                regime_hook(n, action)
        ex.before_action = die_after_first_forward
    t0 = time.monotonic()
    try:
        runner.train_step(x, y)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


def test_dead_peer_raises_peer_error_naming_it():
    plan = make_plan(p=2, m=4, layers=2)
    results = spawn(_dying_rank, 2, plan, timeout_s=150, allow_exit=[1])
    assert results[1] is None  # rank 1 died
    kind, message, elapsed_s = results[0]
    assert kind == "PeerError", message
    assert "rank 1" in message
    assert elapsed_s < 20 + 10  # within the configured timeout (20 s), not a hang


def _closing_rank(rank, world, plan):
    import torch.distributed as dist
    runner, _, _ = _after_one_step(plan, timeout_s=30)
    if rank == 1:
        time.sleep(1.5)       # the last rank to finish
    t0 = time.monotonic()
    runner.close()
    return time.monotonic() - t0, dist.is_initialized()


def _dead_before_close(rank, world, plan):
    runner, _, _ = _after_one_step(plan, timeout_s=20)
    if rank == 1:
        os._exit(3)
    try:
        runner.close()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def test_close_with_a_dead_rank_raises_peer_error_naming_it():
    results = spawn(_dead_before_close, 2, make_plan(p=2, m=2, layers=2), timeout_s=150,
                    allow_exit=[1])
    kind, message = results[0]
    assert kind == "PeerError" and "rank 1" in message, message


def test_close_waits_for_every_rank_then_destroys_the_groups():
    plan = make_plan(p=2, m=2, layers=2)
    (waited_s, still_up), (_, still_up_1) = spawn(_closing_rank, 2, plan, timeout_s=150)
    assert waited_s > 1.0          # rank 0 left only after rank 1 arrived
    assert not still_up and not still_up_1


# ---- with tensor parallelism (passes/tensor_parallel.py) ----------------------------------
def test_gpt_t2_p2():
    check_against_reference("gpt", make_plan(t=2, p=2, m=2, schedule="1f1b", layers=2),
                            timeout_s=400)


@pytest.mark.slow
def test_llama_t2_p2_interleaved():
    check_against_reference("llama", make_plan(t=2, p=2, v=2, m=2, schedule="interleaved-1f1b",
                                               layers=4), timeout_s=400)


@pytest.mark.slow
def test_llama_t2_p2_interleaved_zero_bubble():
    """Tensor-parallel collectives sit on the input-gradient path: B runs them, W none. The
    edge chunks hold no layers: the vocab-parallel embedding alone (its backward is all W) and
    the vocab-parallel head + cross-entropy alone."""
    check_against_reference("llama", make_plan(t=2, p=2, v=2, m=2, schedule="interleaved-zb",
                                               layers=4, split=[0, 2, 2, 0]))


def test_gpt_t2_p2_d2():
    check_against_reference("gpt", make_plan(t=2, p=2, d=2, m=2, schedule="1f1b", layers=2),
                            timeout_s=600)


def test_llama_t2_p2_partial_sum_crosses_the_cut():
    # the tensor-parallel pass leaves the residual as a partial sum at the cut: each tensor
    # rank must send its own value whole (no scatter/gather of a non-replicated value)
    check_against_reference("llama", make_plan(t=2, p=2, m=2, schedule="1f1b", layers=2),
                            timeout_s=400)

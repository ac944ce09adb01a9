"""Context parallelism on gloo ranks equals one device (issue 15): losses and full_state_dict
after 3 AdamW steps (clipped at 1.0) at rtol 1e-4 / atol 1e-5, for c = 2 alone and with the
other degrees, on the examples' GPT (learned positions, is_causal attention) and Llama-style
model (rotary tables sliced from buffers, grouped-query attention), each sequence cut into
2c chunks (rank i holds chunks i and 2c−1−i)."""
from __future__ import annotations

import pytest
import torch

from autopar.plan import Plan
from autopar.testing import spawn
from models import runtime_model
from programs import (MAX_NORM, SEQ, adamw, check_against_reference,
                      check_cases_against_reference, check_trained, check_training, make_plan,
                      train_rank, train_single_device)


def with_c(plan: Plan, c: int, **over) -> Plan:
    return Plan.from_dict({**plan.to_dict(), "c": c, **over})


# Each test below trains its cases in turn on one spawn per world size
# (programs.check_cases_against_reference), each against its own single-device run.

def test_c2_equals_one_device():
    check_cases_against_reference({n: (n, with_c(make_plan(), 2)) for n in ("gpt", "llama_style")})


def test_c2_d2_zero1_equals_one_device():
    check_cases_against_reference({n: (n, with_c(make_plan(d=2), 2, zero=1))
                                   for n in ("gpt", "llama_style")})


@pytest.mark.timeout(900)
def test_c2_p2_every_schedule_equals_one_device():
    """Every pipeline schedule: the K/V all-gathers run inside each chunk's forward, their
    reduce-scatters inside its backward (B, and W's weight gradients apart under zero-bubble)."""
    schedules = [("interleaved-1f1b", 2), ("gpipe", 1), ("1f1b", 1), ("breadth-first", 2),
                 ("interleaved-zb", 2)]
    check_cases_against_reference({
        f"{schedule}-v{v}": ("llama_style", with_c(make_plan(p=2, v=v, m=2, schedule=schedule,
                                                             layers=4), 2))
        for schedule, v in schedules})


def test_c2_recompute_equals_one_device():
    check_cases_against_reference({mode: ("llama_style", with_c(make_plan(), 2, recompute=mode))
                                   for mode in ("selective", "full", "op")})


def test_c2_t2_equals_one_device():
    check_against_reference("llama_style", with_c(make_plan(t=2), 2))


# (name, ep): Mixtral at c = 2 alone; OLMoE and Qwen2-MoE at c = 2 × ep = 2 (the same local
# routing, its rows then sent to the experts' rank); Mixtral at c = 2 × ep = 2 with its router
# loss is tests/numerics/test_router_loss.py's (the suite's time budget: the other three
# pairings, and c = 2 with t = 2 + SP, d = 2 ZeRO-3 or p = 2, were checked by hand)
MOE = (("hf_mixtral", 1), ("hf_olmoe", 2), ("hf_qwen2_moe", 2))


@pytest.mark.timeout(900)
def test_c2_unmodified_transformers_models_equal_one_device():
    """Llama (its DynamicCache's empty concatenation, rotary from position ids = arange(T)),
    Mistral (a causal sliding-window mask of 4 over 8 tokens, built by transformers from
    arange(T)) and GPT-NeoX (partial rotary, parallel attention + MLP); and mixtures of experts
    (Mixtral, OLMoE, Qwen2-MoE with its shared expert, `MOE`): each rank routes its own tokens
    (sorted by expert among themselves, its counts the grouped matmuls' offsets), with ep = 2
    sent to the experts' rank by all-to-all over the 2 context ranks."""
    cases = {n: (n, with_c(make_plan(), 2)) for n in ("hf_llama", "hf_mistral", "hf_neox")}
    cases.update({f"{n}-ep{ep}": (n, with_c(make_plan(), 2, ep=ep)) for n, ep in MOE})
    check_cases_against_reference(cases)


ARCHITECTURES = ("hf_gpt2", "hf_falcon", "hf_falcon_mq", "hf_gptj", "hf_bloom", "hf_olmo2",
                 "hf_qwen3", "hf_phi3", "hf_gemma", "hf_phi", "hf_opt", "hf_bigcode",
                 "torch_encoder")


ARCHITECTURE_CASES = [(name, 1, False) for name in ARCHITECTURES] + [
    ("hf_falcon_mq", 2, False), ("hf_phi3", 2, False), ("hf_bigcode", 2, False),
    ("hf_bloom", 2, False), ("hf_gpt2", 2, True), ("hf_opt", 2, True)]


@pytest.mark.timeout(1200)
def test_c2_every_decoder_architecture_equals_one_device():
    """Every decoder we build, each writing attention and positions its own way, found
    through propagation: Conv1D's addmm on merged (B·T, C) tokens (GPT-2), k / v heads indexed
    out of a fused projection and broadcast (Falcon, multi-query Falcon-7B), interleaved rotary
    through stack + flatten (GPT-J), ALiBi from the mask's cumsum added by baddbmm (BLOOM), q / k
    norms over all heads (OLMo-2, Qwen3), fused qkv (Phi-3), partial rotary with parallel
    blocks (Phi), learned positions at an offset and (B·T, C) hidden states (OPT), multi-query
    inside a fused c_attn (GPT-BigCode), and nn.MultiheadAttention's (T·B, E) with a float
    causal mask (PyTorch's encoder); t = 2 on fused and multi-query layouts, and GPT-2 with
    sequence parallelism on its (B·T, C) rows (the tensor-parallel cut per row of T tokens
    becomes a cut per row of the rank's T/c), and OPT with sequence parallelism: its residual
    adds on (B·T, C) rows reduce-scatter the row-parallel sum per row of T/c tokens."""
    check_cases_against_reference({
        f"{name}-t{t}" + "-sp" * sp: (name, with_c(make_plan(t=t), 2, sequence_parallel=sp))
        for name, t, sp in ARCHITECTURE_CASES if name != "torch_encoder"})


def test_c2_torch_encoder_equals_one_device():
    """PyTorch's encoder (nn.MultiheadAttention's (T·B, E) with a float causal mask; one of
    ARCHITECTURES, apart for its optimizer)."""
    plan = with_c(make_plan(), 2)
    # MultiheadAttention's key bias shifts every score of a query alike, which softmax ignores:
    # its gradient is 0 up to rounding (~1e-9), and AdamW's normalisation turns that noise
    # into lr-sized steps of arbitrary sign on any run that sums in another order; plain SGD
    # (lr 0.1) keeps it at rest and still moves every other weight by ~1e-3
    results = spawn(train_rank, plan.gpus, "torch_encoder", plan, sgd, timeout_s=240)
    ref = train_single_device("torch_encoder", plan, sgd, max_grad_norm=MAX_NORM)
    check_trained(results, ref, runtime_model("torch_encoder", plan.num_layers).state_dict())


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_mistral_window_is_shorter_than_the_sequence():
    """The Mistral check above can fail: its window changes the output at this length."""
    from models import hf_mistral
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    windowed = hf_mistral(layers=2, ffn=48, sliding_window=4)
    torch.manual_seed(0)
    full = hf_mistral(layers=2, ffn=48, sliding_window=None)
    assert (windowed(ids).logits - full(ids).logits).abs().max() > 1e-3


def _checkpoint_rank(rank, world, plan, path, load, start, stop):
    """Compile under `plan`, optionally load `path`, train steps [start, stop), save if not
    loading; (steps loaded, losses)."""
    from programs import make_data, make_program, train_steps
    prog, vocab = make_program("gpt", plan)
    runner = prog.compile(optimizer=adamw, max_grad_norm=MAX_NORM, timeout_s=60)
    loaded = runner.load_checkpoint(path) if load else None
    losses = train_steps(runner, plan, make_data(plan, vocab)[start:stop])
    if not load:
        runner.save_checkpoint(path)
    return loaded, losses


def test_checkpoint_saved_under_c2_loads_under_d2_and_back(tmp_path):
    """Checkpoints work across c like across d: saved after step 1 under c=2, resumed under
    d=2 (and under c=2 again), the next steps' losses are the uninterrupted single-device
    ones (Adam's state restored too: otherwise step 3 would differ)."""
    from autopar.testing import spawn
    from programs import train_single_device
    path = str(tmp_path / "ckpt")
    saver = with_c(make_plan(b=2, m=1, layers=2), 2)          # global batch 2
    ref = train_single_device("gpt", saver, max_grad_norm=MAX_NORM).losses
    res = spawn(_checkpoint_rank, 2, saver, path, False, 0, 1, timeout_s=300)
    torch.testing.assert_close(res[0][1], ref[:1], rtol=1e-4, atol=1e-5)
    for plan in (make_plan(d=2, b=1, m=1, layers=2), saver):
        assert plan.global_batch_size == saver.global_batch_size
        out = spawn(_checkpoint_rank, 2, plan, path, True, 1, 3, timeout_s=300)
        for step, losses in out:
            assert step == 1
            torch.testing.assert_close(losses, ref[1:], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(900)
def test_c2_t2_sequence_parallel_equals_one_device():
    """Each context rank's tokens cut again between its tensor ranks (local order) between
    the tensor-parallel regions; the K/V all-gather runs on the regathered local tokens.
    DeepSeek-V3 applies the rotary table to the keys' shared rope part inside the
    sequence-parallel region (a replicated projection): the tensor-parallel pass cuts the
    whole table's tokens between its ranks, and the context rewrite selects the rank's
    positions before that cut (it refused the plan at compile, which the planner offered)."""
    check_cases_against_reference({
        n: (n, with_c(make_plan(t=2), 2, sequence_parallel=True))
        for n in ("gpt", "llama_style", "hf_llama", "hf_mistral", "hf_neox", "hf_deepseek_v3")})


def test_c2_zero_sharded_weights_equal_one_device():
    """ZeRO-2/3 shard weights, gradients and Adam's state over the c·d ranks that hold the
    same weights: the c = 2 context ranks, and with d = 2 all four."""
    cases = [("llama_style", 1, 2), ("llama_style", 1, 3), ("gpt", 2, 3)]
    check_cases_against_reference({f"{name}-d{d}-zero{zero}": (
        name, with_c(make_plan(d=d), 2, zero=zero)) for name, d, zero in cases})


@pytest.mark.parametrize("name", ["gpt", "llama_style"])
def test_c2_bf16_equals_one_device_bf16(name):
    """bf16 compute with fp32 masters (against the single-device bf16 run, the tolerances of
    tests/numerics/test_training.py), clipping active: the K/V all-gather and its
    reduce-scatter run in bf16, the loss average and the gradient reduction over c; the
    Llama-style model's RMSNorm upcasts to fp32 (captured in bf16, passes/capture.py) and its
    rotary tables, sliced at the rank's positions, are cast to bf16."""
    check_training(name, with_c(make_plan(), 2), precision="bf16", max_norm=0.05)


def test_c2_zero3_bf16_equals_one_device_bf16():
    """ZeRO-3 under bf16 over the c = 2 context ranks holding the same weights: the fp32
    master shards gathered in bf16, the gradients reduce-scattered in fp32 over c."""
    check_training("llama_style", with_c(make_plan(), 2, zero=3), precision="bf16",
                   max_norm=0.05)


def _ignored_unevenly(plan: Plan) -> list:
    """make_data's batches with targets -100 (ignored, as transformers' labels) at positions
    2, 3, 4 of every sequence and 6 of the odd ones: under c = 2 rank 0 (positions 0, 1, 6, 7)
    counts 4 or 3 tokens of a sequence, rank 1 (2, 3, 4, 5) one; every micro-batch counts the
    same total, so the single-device mean is the mean of the micro-batches' means."""
    from programs import RUNTIME_VOCAB, make_data
    out = []
    for x, y in make_data(plan, RUNTIME_VOCAB):
        y = y.clone()
        y[:, 2:5] = -100
        y[1::2, 6] = -100
        out.append((x, y))
    return out


@pytest.mark.parametrize("name, t", [("gpt", 1), ("llama_style", 2)])
def test_c2_ignored_targets_uneven_between_ranks_equal_one_device(name, t):
    """The loss is the mean over the counted tokens of the whole sequence, not the mean of the
    context ranks' means (which would weigh rank 1's one token per sequence like rank 0's
    four); t = 2: the vocabulary-parallel cross-entropy."""
    plan = with_c(make_plan(t=t), 2)
    assert plan.micro_batch_size % 2 == 0
    check_against_reference(name, plan, batches=_ignored_unevenly(plan))


def _dropout_rank(rank, world, plan, dropout):
    """GPT (runtime_model's sizes) with `dropout` everywhere (embedding, attention, residual)
    under `plan` on this rank: (losses, full_state_dict) after 3 steps."""
    from autopar.api import ParallelProgram
    from models import gpt
    from programs import RUNTIME_VOCAB, loss_fn, make_data, train_steps
    torch.manual_seed(0)
    model = gpt(layers=plan.num_layers, heads=2, dropout=dropout)
    ex = torch.zeros(plan.micro_batch_size, SEQ, dtype=torch.long)
    prog = ParallelProgram(model=model, plan=plan, profile=None, example_inputs=(ex,),
                           loss_fn=loss_fn, example_targets=ex, cluster=None)
    runner = prog.compile(optimizer=adamw, max_grad_norm=MAX_NORM, timeout_s=60)
    return train_steps(runner, plan, make_data(plan, RUNTIME_VOCAB)), runner.full_state_dict()


def test_c2_dropout_runs_on_rank_streams_and_recompute_replays_them():
    """Dropout 0.1 under c = 2 (cannot equal one device bit for bit: each context rank draws
    its own masks, as tensor-parallel regions do): it is active (the losses differ from the
    dropout-0 run, which equals one device), and full recompute redraws exactly the masks of
    the forward (the same losses and weights as without recompute)."""
    from autopar.testing import spawn
    plan = with_c(make_plan(), 2)
    plain = spawn(_dropout_rank, 2, plan, 0.1, timeout_s=300)
    replayed = spawn(_dropout_rank, 2, with_c(plan, 2, recompute="full"), 0.1, timeout_s=300)
    off = spawn(_dropout_rank, 2, plan, 0.0, timeout_s=300)
    ref = train_single_device("gpt", plan, max_grad_norm=MAX_NORM)
    torch.testing.assert_close(torch.tensor(off[0][0]), torch.tensor(ref.losses),
                               rtol=1e-4, atol=1e-5)
    assert all(abs(a - b) > 1e-3 for a, b in zip(plain[0][0], off[0][0]))
    assert plain[0][0] == plain[1][0]           # the global mean, the same on both ranks
    torch.testing.assert_close(replayed[0][0], plain[0][0], rtol=0, atol=0)
    for key, value in plain[0][1].items():
        torch.testing.assert_close(replayed[0][1][key], value, rtol=0, atol=0)


def test_c2_t2_a_microbatch_with_every_target_ignored_adds_nothing():
    """Micro-batch 1 ignores all its targets: the context ranks' token mean counts none (0,
    not a 0/0 whose NaN the vocabulary-parallel backward would spread) and the runtime weighs
    it 0, as one device's mean over the whole batch does."""
    plan = with_c(make_plan(t=2), 2)
    from programs import RUNTIME_VOCAB, make_data
    batches = [(x, y.clone().index_fill_(0, torch.tensor([2, 3]), -100))
               for x, y in make_data(plan, RUNTIME_VOCAB)]
    check_against_reference("llama_style", plan, batches=batches)

"""bf16 mixed precision (bf16 compute, fp32 master weights and gradient accumulation) on the
models whose norms upcast with `x.float()` / `.to(torch.float32)` — the examples' Llama-style
model, unmodified transformers Llama, Qwen3 (q/k norms per head), Gemma (the norm's
(1 + weight) in fp32) and Mixtral (experts) —
against the same model trained on one device in bf16 (tests/reference.py: MixedPrecision, the
loss on fp32 logits), 3 AdamW steps with clipping active, at the bf16 tolerances of
tests/programs.py (BF16_LOSS_RTOL, BF16_WEIGHT_ATOL). They run because build captures the
model in bf16 (passes/capture.py compute_dtype): traced on fp32 weights the upcast is x itself
and the graph cannot tell it apart from x. Sharded weights (ZeRO-2/3) under bf16 too: fp32
master shards gathered in bf16, gradients reduced in fp32 (autopar/runtime/zero3_chunks.py; the
collectives' dtypes and the fp32 exactness of the shard gradient: test_zero3.py). (GPT's bf16
runs: test_training.py; context parallelism's: test_context_parallel_numerics.py.)"""
from __future__ import annotations

import pytest

from programs import check_training, make_plan, make_program, with_zero

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name", ["llama_style", "hf_llama", "hf_qwen3", "hf_gemma"])
def test_t2_bf16_equals_one_device_bf16(name):
    """Tensor parallelism: the norms' fp32 statistics on each rank's whole rows, the
    column/row-parallel projections and their all-reduces in bf16, the vocabulary-parallel
    loss on fp32 logits (passes/loss_precision.py)."""
    check_training(name, make_plan(t=2), precision="bf16", max_norm=0.05)


def test_mixtral_d2_bf16_equals_one_device_bf16():
    """Mixtral: the router's softmax in fp32 (transformers upcasts it), the top-2 experts'
    grouped matmuls in bf16, fp32 main_grad reduced over the 2 replicas."""
    check_training("hf_mixtral", make_plan(d=2), precision="bf16", max_norm=0.05)


def test_saved_bf16_program_runs_from_its_files(tmp_path):
    """prog.save(..., precision="bf16") writes chunks captured in bf16 (their PRECISION says
    so); compile(program_dir=..., precision="bf16") runs those files (a pipeline of 2: the
    hidden states cross in bf16) and equals one device."""
    plan = make_plan(p=2, m=2)
    prog, _ = make_program("llama_style", plan)
    prog.save(tmp_path, precision="bf16")
    assert "PRECISION = 'bf16'" in (tmp_path / "chunk_00.py").read_text()
    check_training("llama_style", plan, precision="bf16", max_norm=0.05,
                   program_dir=str(tmp_path))


# ---- sharded weights (ZeRO-2/3) under bf16 ------------------------------------------------
@pytest.mark.parametrize("name", ["gpt", "llama_style"])
def test_zero3_d2_bf16_equals_one_device_bf16(name):
    """ZeRO-3: each rank's shard is the fp32 master, gathered in bf16 before every compute and
    released after it; each chunk's bf16 gradients folded into an fp32 accumulation and
    reduce-scattered in fp32 into the fp32 shard gradient; clipping over the fp32 shards (and
    GPT's tied embedding, kept replicated with its own fp32 master)."""
    check_training(name, with_zero(make_plan(d=2), 3), precision="bf16", max_norm=0.05)


def test_zero2_d2_bf16_equals_one_device_bf16():
    """ZeRO-2: the same, each chunk gathered once and kept until its last backward, so its
    two micro-batches' gradients add up in the fp32 accumulation before one reduce-scatter."""
    check_training("llama_style", with_zero(make_plan(d=2, m=2), 2), precision="bf16",
                   max_norm=0.05)


def test_zero3_p2_d2_bf16_equals_one_device_bf16():
    """ZeRO-3 under a pipeline of 2 (1F1B, 2 micro-batches): each stage's chunk gathered in
    bf16 per its schedule, the hidden states crossing in bf16, the tied embedding's fp32
    main_grad summed over the two stages."""
    check_training("gpt", with_zero(make_plan(p=2, d=2, m=2), 3), precision="bf16",
                   max_norm=0.05)


def test_zero3_t2_d2_bf16_equals_one_device_bf16():
    """ZeRO-3 on tensor-parallel shards (t = 2, d = 2): each tensor rank's chunk shards
    gathered in bf16 over its data group; the norms' fp32 statistics and the
    vocabulary-parallel loss on fp32 logits as at zero = 0."""
    check_training("llama_style", with_zero(make_plan(t=2, d=2), 3), precision="bf16",
                   max_norm=0.05)


def test_zero3_interleaved_revisits_bf16_equals_one_device_bf16():
    """ZeRO-3 under interleaved 1F1B with v = 4 chunks on a rank (d = 2, m = 3): at most two
    chunks gathered, so a chunk is gathered and reduce-scattered once per visit (12
    reduce-scatters for 4 chunks), its visits' fp32 reduce-scatters adding up in the fp32
    shard gradient."""
    plan = with_zero(make_plan(d=2, v=4, m=3, schedule="interleaved-1f1b", layers=4), 3)
    check_training("gpt", plan, precision="bf16", max_norm=0.05)

"""Shared fixtures. The tiny models live in models.py, the single-device reference training in
reference.py (see README.md in this folder for the layout of the tests)."""
from __future__ import annotations

import pytest

from autopar.testing import preload
from models import PASS_MODELS

# the spawned ranks of the numerics tests build these models: the fork server imports them once
# instead of every rank of every test (~5 s each)
preload(*(f"transformers.models.{m}.modeling_{m}" for m in (
    "gpt2", "llama", "bert", "gpt_neox", "falcon", "gptj", "bloom", "olmo2", "phi", "mistral",
    "mixtral", "olmoe", "qwen2_moe", "qwen3", "gemma", "vit", "gpt_bigcode", "phi3", "t5",
    "bart", "mbart", "umt5", "whisper", "qwen3_moe", "cohere2", "gpt_oss", "swin")),
    "torch.export", "autopar.examples.gpt", "autopar.examples.llama", "models", "programs",
    "fork_warmup")


@pytest.fixture(params=PASS_MODELS)
def tiny_name(request) -> str:
    return request.param

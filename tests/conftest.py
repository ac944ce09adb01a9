"""Shared fixtures. The tiny models live in models.py, the single-device reference training in
reference.py (see README.md in this folder for the layout of the tests)."""
from __future__ import annotations

import os
import tempfile

import pytest

from autopar.testing import preload, start_server
from models import PASS_MODELS

# the spawned ranks of the numerics tests build these models: the fork server imports them once
# instead of every rank of every test (~5 s each)
preload(*(f"transformers.models.{m}.modeling_{m}" for m in (
    "gpt2", "llama", "bert", "gpt_neox", "falcon", "gptj", "bloom", "olmo2", "phi", "mistral",
    "mixtral", "olmoe", "qwen2_moe", "qwen3", "gemma", "vit", "gpt_bigcode", "phi3", "t5",
    "bart", "mbart", "umt5", "whisper", "qwen3_moe", "cohere2", "gpt_oss", "swin", "modernbert")),
    "torch.export", "autopar.examples.gpt", "autopar.examples.llama", "models", "programs",
    "fork_warmup")


@pytest.fixture(params=PASS_MODELS)
def tiny_name(request) -> str:
    return request.param


def pytest_configure(config) -> None:
    """Start the spawn fork server before collection when numerics tests may run: its ~12 CPU-s
    of imports and warm-up (fork_warmup.py) then overlap pytest's ~13 CPU-s of collection on
    the second core, instead of stalling the first spawning test."""
    args = [str(a) for a in config.args]
    if not args or any("unit" not in a and "passes" not in a for a in args):
        # the ranks' stderr (warnings, gloo / profiler messages) to a file, not between the dots
        start_server(os.path.join(tempfile.gettempdir(), f"autopar-ranks-{os.getpid()}.log"))

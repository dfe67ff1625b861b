"""Fixtures shared by every test package: prepared models and engine binding."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmesh.models import DEFAULT_MODEL, ensure_model

# Engines started by tests are small; keep vLLM's CPU KV cache modest on a 24 GiB box.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct), prepared once."""
    return ensure_model(DEFAULT_MODEL, quiet=True)


@pytest.fixture(scope="session")
def tiny_deepseek_dir() -> Path:
    """The tiny random DeepSeek-V2 test model, prepared once."""
    return ensure_model("tiny-deepseek", quiet=True)

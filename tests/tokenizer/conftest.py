"""Fixtures of the tokenizer-tier tests: both prepared models, one in-process server."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.tokenizer.loader import LoadedTokenizer, load_models
from services.tokenizer.server import build_server, warm_up
from services.tokenizer.settings import TokenizerSettings
from tests.tokenizer.helpers import running_server

SMOL = "smollm2-135m-instruct"
TINY = "tiny-deepseek"


@pytest.fixture(scope="session")
def model_specs(smollm2_dir: Path, tiny_deepseek_dir: Path) -> list[str]:
    return [f"{SMOL}={smollm2_dir}", f"{TINY}={tiny_deepseek_dir}"]


@pytest.fixture(scope="session")
def loaded(model_specs: list[str]) -> dict[str, LoadedTokenizer]:
    return load_models(model_specs)


@pytest.fixture(scope="module")
async def tokenizer_server(model_specs: list[str]):
    settings = TokenizerSettings(
        port=0, models=model_specs, max_messages=8, max_input_chars=10_000, max_batch_inputs=4,
        drain_seconds=0,
    )
    async with running_server(lambda: build_server(settings), warm_up, tier="tokenizer") as server:
        yield server

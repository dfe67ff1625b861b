"""Fixtures of the postprocessor tests: both prepared tokenizers, one in-process server."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.postprocessor.server import build_server, warm_up
from services.postprocessor.settings import PostprocessorSettings
from services.tokenizer.loader import LoadedTokenizer, load_models
from tests.tokenizer.helpers import running_server

SMOL = "smollm2-135m-instruct"
TINY = "tiny-deepseek"


@pytest.fixture(scope="session")
def pp_model_specs(smollm2_dir: Path, tiny_deepseek_dir: Path) -> list[str]:
    return [f"{SMOL}={smollm2_dir}", f"{TINY}={tiny_deepseek_dir}"]


@pytest.fixture(scope="session")
def tokenizers(pp_model_specs: list[str]) -> dict[str, LoadedTokenizer]:
    return load_models(pp_model_specs)


@pytest.fixture(scope="module")
async def postprocessor_server(pp_model_specs: list[str]):
    settings = PostprocessorSettings(
        port=0, models=pp_model_specs, max_stop_strings=4, max_stop_chars=32, max_tokens_per_stream=5000,
        drain_seconds=0, final_drain_seconds=2.0,
    )
    async with running_server(lambda: build_server(settings), warm_up, tier="postprocessor") as server:
        yield server

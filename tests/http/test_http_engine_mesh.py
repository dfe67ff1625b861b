"""The OpenAI-compatible HTTP surface through a real mesh with one vLLM CPU worker on SmolLM2,
driven by the official ``openai`` client.

The mesh is this module's own (tests/gateway's session-scoped engine mesh has no HTTP
listener and its fixture is not visible here); it is stopped when the module ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmesh.meshconfig import GatewayConfig, MeshConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from tests.http.conftest import client, running_mesh

pytestmark = pytest.mark.engine

PARIS: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def http_engine_mesh(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(smollm2_dir),
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), settings={"drain_seconds": 0}),
        workers=[WorkerConfig(zone="zone-a", engine="vllm", cpu_omp_threads_bind="0-1",
                              settings={"max_num_seqs": 4, "max_model_len": 2048, "cpu_kvcache_space_gb": 1,
                                        "canary_interval_s": 30})],
    )
    with running_mesh(config, tmp_path_factory.mktemp("http-engine-mesh")) as mesh:
        yield mesh


def test_chat_paris_streamed_equals_non_streamed(http_engine_mesh: Mesh) -> None:
    api = client(http_engine_mesh)
    unary = api.chat.completions.create(model=http_engine_mesh.model_name, messages=PARIS,
                                        temperature=0, max_tokens=32)
    answer = unary.choices[0].message.content or ""
    assert "Paris" in answer
    assert unary.choices[0].finish_reason in ("stop", "length")
    assert unary.usage is not None and unary.usage.completion_tokens > 0
    chunks = list(api.chat.completions.create(model=http_engine_mesh.model_name, messages=PARIS,
                                              temperature=0, max_tokens=32, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-2].choices[0].finish_reason == unary.choices[0].finish_reason
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens


def test_completions_streamed_equals_non_streamed(http_engine_mesh: Mesh) -> None:
    api = client(http_engine_mesh)
    prompt = "The capital of France is"
    unary = api.completions.create(model="", prompt=prompt, temperature=0, max_tokens=8)
    assert "Paris" in unary.choices[0].text
    chunks = list(api.completions.create(model="", prompt=prompt, temperature=0, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == unary.choices[0].text
    assert {c.model for c in chunks} == {http_engine_mesh.model_name}

"""Fixtures shared by every test package: prepared models and engine binding."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmesh.meshconfig import GatewayConfig, MeshConfig, RouterConfig, TierConfig, WorkerConfig
from llmesh.models import DEFAULT_MODEL, ensure_model
from llmesh.procs import free_port
from llmesh.up import Mesh

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


@pytest.fixture(scope="session")
def engine_mesh(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A whole mesh with one real vLLM CPU worker on SmolLM2, gRPC and HTTP, two routers
    and two postprocessors, started once for every test that needs the real engine."""
    config = MeshConfig(
        model=str(smollm2_dir),
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), settings={"drain_seconds": 0}),
        # ha.yaml's shape: two routers and two postprocessors, so the HA tests can kill one
        # of each under a real engine.
        router=RouterConfig(replicas=2),
        postprocessor=TierConfig(replicas=2),
        workers=[WorkerConfig(zone="zone-a", engine="vllm", cpu_omp_threads_bind="0-1",
                              settings={"max_num_seqs": 16, "max_model_len": 2048,
                                        "canary_interval_s": 30})],
    )
    mesh = Mesh(config, log_dir=tmp_path_factory.mktemp("engine-mesh"))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()

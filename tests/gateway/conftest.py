"""Meshes for gateway tests, started with the same code as ``llmesh up``.

``fake_mesh``: every tier real, workers on the deterministic fake engine (fast; for
validation, auth and orchestration). ``engine_mesh`` (in tests/conftest.py, shared with
the HTTP tests): the same with one real vLLM CPU worker on SmolLM2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.meshconfig import MeshConfig, RouterConfig, TenantConfig, TierConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh

DEMO_KEY = "demo-key-change-me"
LIMITED_KEY = "limited-key"


def _hash(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


@contextlib.contextmanager
def running_mesh(config: MeshConfig, log_dir: Path) -> Iterator[Mesh]:
    mesh = Mesh(config, log_dir=log_dir)
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


def gateway_address(mesh: Mesh) -> str:
    return f"{mesh.config.gateway.host}:{mesh.config.gateway.port}"


@pytest.fixture(scope="session")
def fake_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1,
                 "audit_log": str(tmp_path_factory.mktemp("audit") / "audit.jsonl"),
                 "settings": {"drain_seconds": 0}},
        router=RouterConfig(zones=["zone-a", "zone-b"]),
        tokenizer=TierConfig(),
        workers=[
            WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 5}),
            WorkerConfig(zone="zone-b", engine="fake", settings={"fake_token_delay_ms": 5}),
        ],
        tenants=[
            TenantConfig(name="demo", key_sha256=_hash(DEMO_KEY)),
            TenantConfig(name="limited", key_sha256=_hash(LIMITED_KEY), requests_per_minute=3),
            TenantConfig(name="redacted", key_sha256=_hash("redact-key"), filter_mode="redact"),
        ],
    )
    with running_mesh(config, tmp_path_factory.mktemp("fake-mesh")) as mesh:
        yield mesh


@pytest.fixture
async def fake_channel(fake_mesh: Mesh):
    channel = grpc.aio.insecure_channel(gateway_address(fake_mesh))
    yield channel
    await channel.close()


@pytest.fixture
async def engine_channel(engine_mesh: Mesh):
    channel = grpc.aio.insecure_channel(gateway_address(engine_mesh))
    yield channel
    await channel.close()

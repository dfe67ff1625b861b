"""The chaos mesh: every tier real, workers on the deterministic fake engine.

Two zones of two workers each, two routers and two postprocessors (the ``ha.yaml``
shape), started with the same code as ``llmesh up``. Tests that break a process put a
fresh one in its place before they end, so the module-scoped mesh stays whole.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.meshconfig import GatewayConfig, MeshConfig, RouterConfig, TierConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from tests.chaos.load import TOKEN_DELAY_MS, references


@pytest.fixture(scope="module")
def chaos_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    worker_settings = {"fake_token_delay_ms": TOKEN_DELAY_MS, "fake_max_running": 32}
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway=GatewayConfig(port=free_port(), http_port=-1, settings={"drain_seconds": 0}),
        router=RouterConfig(replicas=2, zones=["zone-a", "zone-b"]),
        postprocessor=TierConfig(replicas=2),
        workers=[WorkerConfig(zone=zone, engine="fake", settings=worker_settings)
                 for zone in ("zone-a", "zone-a", "zone-b", "zone-b")],
    )
    mesh = Mesh(config, log_dir=tmp_path_factory.mktemp("chaos-mesh"))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
async def chaos_channel(chaos_mesh: Mesh) -> AsyncIterator[grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(f"{chaos_mesh.config.gateway.host}:{chaos_mesh.config.gateway.port}")
    yield channel
    await channel.close()


@pytest.fixture(scope="module")
async def chaos_refs(chaos_channel: grpc.aio.Channel) -> dict[str, str]:
    return await references(chaos_channel)

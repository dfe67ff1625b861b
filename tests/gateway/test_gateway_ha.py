"""Nothing accepted is lost when a CPU-tier replica dies (the ha.yaml shape).

Two routers and two postprocessors; workers run the deterministic fake engine, so an
undisturbed run is the reference. A kill -9 of the router or the postprocessor carrying
a stream must leave the client with one continuous stream and the same text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.meshconfig import MeshConfig, RouterConfig, TierConfig, WorkerConfig
from llmesh.procs import TierProcess, free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import collect_stream, metric_total, stream_and_kill, stream_request, stub

PROMPT = "tell me about failover"
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def ha_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1, "settings": {"drain_seconds": 0}},
        router=RouterConfig(replicas=2, zones=["zone-a", "zone-b"]),
        postprocessor=TierConfig(replicas=2),
        workers=[
            WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 25}),
            WorkerConfig(zone="zone-b", engine="fake", settings={"fake_token_delay_ms": 25}),
        ],
    )
    with running_mesh(config, tmp_path_factory.mktemp("ha-mesh")) as mesh:
        yield mesh


def _request() -> inference_pb2.GenerateStreamRequest:
    return stream_request(prompt=PROMPT, sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                   "ignore_eos": True})


async def _reference(channel: grpc.aio.Channel) -> str:
    text, final, _ = await collect_stream(stub(channel), _request())
    assert final.usage.completion_tokens == MAX_TOKENS
    return text


async def test_router_killed_mid_stream_is_resumed_through_the_other(ha_mesh):
    routers = [p for p in ha_mesh.procs if p.tier == "router"]
    async with grpc.aio.insecure_channel(gateway_address(ha_mesh)) as channel:
        reference = await _reference(channel)

        def carrier() -> TierProcess:
            busy = [p for p in routers if p.alive() and metric_total(p, "llmesh_router_worker_in_flight") > 0]
            assert len(busy) == 1, "exactly one router should carry the stream"
            return busy[0]

        text, final, victim = await stream_and_kill(channel, _request(), carrier)
    victim.popen.wait(10)
    assert text == reference
    assert final.usage.completion_tokens == MAX_TOKENS
    assert final.served_by.resumed >= 1
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH


async def test_postprocessor_killed_mid_stream_is_replayed_into_the_other(ha_mesh):
    posts = [p for p in ha_mesh.procs if p.tier == "postprocessor"]
    async with grpc.aio.insecure_channel(gateway_address(ha_mesh)) as channel:
        reference = await _reference(channel)
        before = {p.name: metric_total(p, "llmesh_postprocessor_tokens_total") for p in posts}

        def carrier() -> TierProcess:
            moved = [p for p in posts if p.alive()
                     and metric_total(p, "llmesh_postprocessor_tokens_total") > before[p.name]]
            assert len(moved) == 1, "exactly one postprocessor should carry the stream"
            return moved[0]

        text, final, _ = await stream_and_kill(channel, _request(), carrier)
    assert text == reference
    assert final.usage.completion_tokens == MAX_TOKENS

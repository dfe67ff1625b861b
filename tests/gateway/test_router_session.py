"""The gateway over router Sessions (``router_transport: session``) in a real mesh.

Two routers, two workers on the deterministic fake engine. The mesh's gateway (a
process, like ``llmesh up`` starts it) talks to the routers over one Session each; an
in-process gateway in calls mode over the same tiers is the reference. Streams give the
same text, a router killed mid-stream is resumed through the other with nothing lost,
and a cancelled client aborts its request on the router and the worker.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from gateway.server import Gateway, create_gateway
from gateway.settings import GatewaySettings
from llmesh.meshconfig import MeshConfig, RouterConfig, TierConfig, WorkerConfig
from llmesh.procs import TierProcess, free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import collect_stream, stream_request, stub
from tests.router.helpers import wait_for

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def session_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1,
                 "settings": {"drain_seconds": 0, "router_transport": "session"}},
        router=RouterConfig(replicas=2, zones=["zone-a", "zone-b"]),
        postprocessor=TierConfig(replicas=1),
        workers=[
            WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 20}),
            WorkerConfig(zone="zone-b", engine="fake", settings={"fake_token_delay_ms": 20}),
        ],
    )
    with running_mesh(config, tmp_path_factory.mktemp("router-session-mesh")) as mesh:
        yield mesh


def _procs(mesh: Mesh, tier: str) -> list[TierProcess]:
    return [p for p in mesh.procs if p.tier == tier]


@pytest.fixture
async def calls_gateway(session_mesh: Mesh) -> AsyncIterator[grpc.aio.Channel]:
    """A gateway in calls mode over the same tiers, in this process: the reference."""
    settings = GatewaySettings(
        host="127.0.0.1", port=0, http_port=-1, router_transport="calls",
        tokenizer_targets=[p.address for p in _procs(session_mesh, "tokenizer")],
        router_targets=[p.address for p in _procs(session_mesh, "router") if p.alive()],
        postprocessor_targets=[p.address for p in _procs(session_mesh, "postprocessor")],
    )
    gateway: Gateway = await create_gateway(settings)
    await gateway.handle.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    yield channel
    await channel.close()
    await gateway.handle.server.stop(0)
    await gateway.close()


def _metric(proc: TierProcess, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(\{{.*\}})?\s+(\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _generate_calls(mesh: Mesh) -> float:
    return sum(_metric(p, "llmesh_rpc_requests_total", tier="router", method="Generate", transport="call")
               for p in _procs(mesh, "router") if p.alive())


def _request(prompt: str, max_tokens: int = MAX_TOKENS) -> inference_pb2.GenerateStreamRequest:
    return stream_request(prompt=prompt, sampling={"max_tokens": max_tokens, "temperature": 0.0,
                                                   "ignore_eos": True})


async def _worker_in_flight(mesh: Mesh) -> int:
    total = 0
    for proc in _procs(mesh, "worker"):
        async with grpc.aio.insecure_channel(proc.address) as channel:
            worker = worker_pb2_grpc.WorkerServiceStub(channel)
            load = await worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
            total += load.load.in_flight
    return total


def _router_in_flight(mesh: Mesh) -> float:
    return sum(_metric(p, "llmesh_router_worker_in_flight") for p in _procs(mesh, "router") if p.alive())


PROMPTS = [f"prompt number {i} about sessions" for i in range(12)]


async def test_concurrent_streams_equal_calls_mode(
    session_mesh: Mesh, calls_gateway: grpc.aio.Channel
) -> None:
    async with grpc.aio.insecure_channel(gateway_address(session_mesh)) as channel:
        before = await asyncio.to_thread(_generate_calls, session_mesh)
        sessions = await asyncio.gather(*(collect_stream(stub(channel), _request(p, 40), timeout=60)
                                          for p in PROMPTS))
        # The session gateway made no Generate call on any router.
        assert await asyncio.to_thread(_generate_calls, session_mesh) == before
    calls = await asyncio.gather(*(collect_stream(stub(calls_gateway), _request(p, 40), timeout=60)
                                   for p in PROMPTS))
    assert await asyncio.to_thread(_generate_calls, session_mesh) > before  # the reference did
    for (text, final, _), (ref_text, ref_final, _) in zip(sessions, calls, strict=True):
        assert text == ref_text and text
        assert final.usage.completion_tokens == ref_final.usage.completion_tokens == 40
        assert final.finish_reason == ref_final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert final.served_by.worker_id and final.served_by.resumed == 0


async def test_client_cancel_aborts_on_router_and_worker(session_mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(gateway_address(session_mesh)) as channel:
        call = stub(channel).GenerateStream(_request("a long one to cancel", 2000))
        for _ in range(2):
            item = await call.read()
            assert item.HasField("delta")
        assert await _worker_in_flight(session_mesh) >= 1
        call.cancel()
        await wait_for(_no_worker_in_flight(session_mesh), timeout=10)
        await wait_for(lambda: _router_in_flight(session_mesh) == 0, timeout=10)
        # The sessions are still there and serve the next request.
        text, final, _ = await collect_stream(stub(channel), _request("after the cancel", 5), timeout=30)
        assert text and final.usage.completion_tokens == 5


def _no_worker_in_flight(mesh: Mesh):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return await _worker_in_flight(mesh) == 0
    return check


async def test_router_killed_mid_stream_resumes_through_the_other(
    session_mesh: Mesh, calls_gateway: grpc.aio.Channel
) -> None:
    # Last in this module: it leaves the mesh with one router.
    prompts = [f"failover story {i}" for i in range(4)]
    references = await asyncio.gather(*(collect_stream(stub(calls_gateway), _request(p), timeout=60)
                                        for p in prompts))
    routers = _procs(session_mesh, "router")
    victim: list[TierProcess] = []

    async def one(
        channel: grpc.aio.Channel, prompt: str, kill: bool
    ) -> tuple[str, inference_pb2.GenerateResponse]:
        parts: list[str] = []
        final = None
        async for item in stub(channel).GenerateStream(_request(prompt), timeout=60):
            if item.HasField("delta"):
                parts.append(item.delta.text)
                if kill and len(parts) == 5:
                    busy = [p for p in routers if p.alive()
                            and await asyncio.to_thread(_metric, p, "llmesh_router_worker_in_flight") > 0]
                    assert busy, "a router should carry the streams"
                    victim.append(busy[0])
                    os.kill(busy[0].pid, signal.SIGKILL)
            else:
                final = item.final
        assert final is not None
        return "".join(parts), final

    async with grpc.aio.insecure_channel(gateway_address(session_mesh)) as channel:
        results = await asyncio.gather(*(one(channel, p, i == 0) for i, p in enumerate(prompts)))
    assert victim
    victim[0].popen.wait(10)
    resumed = 0
    for (text, final), (ref_text, _, _) in zip(results, references, strict=True):
        assert text == ref_text  # no failed stream, greedy text identical
        assert final.usage.completion_tokens == MAX_TOKENS
        assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        resumed += final.served_by.resumed
    assert resumed >= 1

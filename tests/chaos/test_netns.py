"""Network faults on a zone: its namespace cut off and restored, then 200 ms of latency (needs root).

zone-a (preferred) lives in its own network namespace; zone-b is in the root namespace.
Cutting zone-a under load must lose nothing (the router ejects it and resumes its
streams in zone-b); once restored, zone-a serves again. With 200 ms of added latency
towards zone-a, requests still succeed, only slower. Each fault is applied to the link
and to the forwarders in front of zone-a (tests/chaos/netmesh.py says why).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.v1 import inference_pb2_grpc
from tests.chaos.load import PROMPTS, LoadLoop, Outcome, assert_clean, one_stream, references
from tests.chaos.netmesh import NetemUnavailable, NetnsMesh, ZoneNamespace, netns_available

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.netns,
    pytest.mark.skipif(not netns_available(), reason="needs root with ip and tc (network namespaces, netem)"),
]


@pytest.fixture(scope="module")
def zone_ns() -> Iterator[ZoneNamespace]:
    ns = ZoneNamespace()
    try:
        ns.create()
    except Exception as exc:  # e.g. a container without CAP_NET_ADMIN
        ns.delete()
        pytest.skip(f"cannot create a network namespace: {exc}")
    try:
        yield ns
    finally:
        ns.clear_delay()
        ns.delete()


@pytest.fixture(scope="module")
def netns_mesh(tiny_deepseek_dir: Path, zone_ns: ZoneNamespace,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsMesh]:
    mesh = NetnsMesh(tiny_deepseek_dir, zone_ns, tmp_path_factory.mktemp("netns-mesh"))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
async def net_channel(netns_mesh: NetnsMesh) -> AsyncIterator[grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(netns_mesh.gateway_address)
    yield channel
    await channel.close()


@pytest.fixture(scope="module")
async def net_refs(net_channel: grpc.aio.Channel) -> dict[str, str]:
    return await references(net_channel)


def _brief(outcomes: list[Outcome], t0: float) -> list[tuple[str, str, int, float, float]]:
    """zone, worker, resumes, start and end relative to t0: what an assertion message needs."""
    return [(o.zone, o.worker_id, o.resumed, round(o.started - t0, 2), round(o.ended - t0, 2))
            for o in outcomes]


async def _zone_a_serves(channel: grpc.aio.Channel, timeout: float = 20.0) -> bool:
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = await asyncio.gather(*(one_stream(stub, p) for p in PROMPTS[:4]))
        assert all(o.ok for o in batch), [o.details for o in batch if not o.ok]
        if any(o.zone == "zone-a" for o in batch):
            return True
    return False


async def test_zone_cut_off_and_restored(netns_mesh: NetnsMesh, net_channel, net_refs) -> None:
    assert await _zone_a_serves(net_channel), "zone-a does not serve before the cut"
    async with LoadLoop(net_channel) as load:
        await load.run_for(1.0)
        await asyncio.to_thread(netns_mesh.cut_zone)
        cut_at = time.monotonic()
        try:
            await load.run_for(3.0)
            kernel_path = await asyncio.to_thread(netns_mesh.zone_reachable)
        finally:
            await asyncio.to_thread(netns_mesh.restore_zone)
        restored_at = time.monotonic()
        await load.run_for(1.0)
        outcomes = await load.stop()
    assert_clean(outcomes, net_refs)
    hit = [o for o in outcomes if o.started < cut_at < o.ended]
    assert any(o.resumed >= 1 for o in hit), f"the cut hit no zone-a stream mid-way: {_brief(hit, cut_at)}"
    during = [o for o in outcomes if cut_at + 1.5 < o.started and o.ended < restored_at]
    assert during and {o.zone for o in during} == {"zone-b"}, (
        f"served while zone-a was cut off (link down, forwarders severed; zone-a reachable around "
        f"the forwarders: {kernel_path}): {_brief(during, cut_at)}")
    assert await _zone_a_serves(net_channel), "zone-a was not used again after the restore"


async def test_zone_latency_200ms_still_succeeds(
    zone_ns: ZoneNamespace, netns_mesh: NetnsMesh, net_channel, net_refs
) -> None:
    assert await _zone_a_serves(net_channel), "zone-a does not serve before the delay"
    # The forwarders (the router's only path to zone-a) delay it; netem on the link too
    # where the kernel has it.
    netns_mesh.set_proxy_delay(0.2)
    try:
        await asyncio.to_thread(zone_ns.add_delay, 200)
        netem = True
    except NetemUnavailable:
        netem = False
    try:
        async with LoadLoop(net_channel, concurrency=4) as load:
            await load.run_for(3.0)
            outcomes = await load.stop()
    finally:
        netns_mesh.set_proxy_delay(0.0)
        await asyncio.to_thread(zone_ns.clear_delay)
    assert_clean(outcomes, net_refs, least=4)
    slow = [o for o in outcomes if o.zone == "zone-a"]
    assert slow, "zone-a (the preferred zone) served nothing while slow"
    # Every request sent to zone-a crosses the delayed link at least once before its first token.
    early = [(o.worker_id, round(o.first_token - o.started, 3))
             for o in slow if o.first_token - o.started < 0.2]
    assert not early, f"zone-a requests not delayed (netem too: {netem}): worker, s to first token {early}"

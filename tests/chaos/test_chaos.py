"""Fault injection under steady load: kill -9 and SIGSTOP of workers, router restart, all workers gone.

Where the design promises it (a worker or a router replica lost while others remain),
no request may fail and every stream must equal its undisturbed reference. With every
worker gone the promise is a clear UNAVAILABLE instead.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from llmesh.procs import TierProcess
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2_grpc
from tests.chaos.load import (
    PROMPTS,
    LoadLoop,
    assert_clean,
    kill9,
    metric,
    one_stream,
    respawn,
    wait_until,
)

pytestmark = pytest.mark.chaos


def _tier(mesh: Mesh, tier: str) -> list[TierProcess]:
    return [p for p in mesh.procs if p.tier == tier]


def _worker_id(mesh: Mesh, proc: TierProcess) -> str:
    # llmesh up names worker i of zone z "worker-<i>-<z>" (see Mesh.start).
    return f"{proc.name}-{proc.zone}"


async def _restore(mesh: Mesh, proc: TierProcess) -> TierProcess:
    new = respawn(mesh.procs, proc)
    await asyncio.to_thread(new.wait_serving, 60)
    return new


async def _busy(proc: TierProcess, timeout: float = 10.0) -> None:
    assert await wait_until(lambda: metric(proc, "llmesh_worker_in_flight") > 0, timeout), (
        f"{proc.name} never carried a stream"
    )


async def test_worker_kill9_loses_nothing(chaos_mesh: Mesh, chaos_channel, chaos_refs) -> None:
    victim = _tier(chaos_mesh, "worker")[0]
    async with LoadLoop(chaos_channel) as load:
        await load.run_for(1.0)
        await _busy(victim)
        await asyncio.to_thread(kill9, victim)
        killed_at = time.monotonic()
        await load.run_for(2.5)
        outcomes = await load.stop()
    try:
        assert_clean(outcomes, chaos_refs)
        hit = [o for o in outcomes if o.started < killed_at < o.ended]
        assert any(o.resumed >= 1 for o in hit), "the kill hit no stream mid-way"
        after = [o for o in outcomes if o.started > killed_at + 0.5]
        assert after and _worker_id(chaos_mesh, victim) not in {o.worker_id for o in after}
    finally:
        await _restore(chaos_mesh, victim)


async def test_worker_sigstop_is_ejected_and_used_again_after_sigcont(
    chaos_mesh: Mesh, chaos_channel, chaos_refs
) -> None:
    victim = _tier(chaos_mesh, "worker")[1]
    victim_id = _worker_id(chaos_mesh, victim)
    hold_s = 4.0
    async with LoadLoop(chaos_channel) as load:
        await load.run_for(1.0)
        await _busy(victim)
        os.kill(victim.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            await load.run_for(hold_s)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        await load.run_for(1.0)
        outcomes = await load.stop()
    assert_clean(outcomes, chaos_refs)
    frozen = [o for o in outcomes if o.started < stopped_at < o.ended]
    assert any(o.resumed >= 1 for o in frozen), "no stream was carried by the stopped worker"
    # Ejection (~1 s) and resume elsewhere: nothing waited for the frozen worker to wake up.
    assert all(o.ended < resumed_at for o in frozen), "a stream waited for SIGCONT"
    during = [o for o in outcomes if stopped_at + 1.5 < o.started and o.ended < resumed_at]
    assert during and victim_id not in {o.worker_id for o in during}
    # After SIGCONT the router takes the worker back (bounded wait, light load).
    stub = inference_pb2_grpc.InferenceServiceStub(chaos_channel)
    seen: set[str] = set()
    deadline = time.monotonic() + 20.0
    while victim_id not in seen and time.monotonic() < deadline:
        batch = await asyncio.gather(*(one_stream(stub, p) for p in PROMPTS))
        assert all(o.ok for o in batch), [o.details for o in batch if not o.ok]
        seen.update(o.worker_id for o in batch)
    assert victim_id in seen, f"{victim_id} was not used again after SIGCONT (saw {sorted(seen)})"


async def test_router_restart_loses_nothing(chaos_mesh: Mesh, chaos_channel, chaos_refs) -> None:
    victim = _tier(chaos_mesh, "router")[0]
    async with LoadLoop(chaos_channel) as load:
        await load.run_for(1.0)
        assert await wait_until(lambda: metric(victim, "llmesh_router_worker_in_flight") > 0, 10.0)
        await asyncio.to_thread(kill9, victim)
        killed_at = time.monotonic()
        await load.run_for(1.0)
        new = await _restore(chaos_mesh, victim)
        await load.run_for(1.5)
        outcomes = await load.stop()
    assert_clean(outcomes, chaos_refs)
    hit = [o for o in outcomes if o.started < killed_at < o.ended]
    assert any(o.resumed >= 1 for o in hit), "the kill hit no stream mid-way"
    # The gateway sends traffic to the new replica again (bounded wait, light load).
    stub = inference_pb2_grpc.InferenceServiceStub(chaos_channel)

    async def routed_by_new() -> bool:
        batch = await asyncio.gather(*(one_stream(stub, p) for p in PROMPTS))
        assert all(o.ok for o in batch), [o.details for o in batch if not o.ok]
        return await asyncio.to_thread(metric, new, "llmesh_router_routed_requests_total") > 0

    deadline = time.monotonic() + 20.0
    used = False
    while not used and time.monotonic() < deadline:
        used = await routed_by_new()
    assert used, "the restarted router got no traffic"


async def test_every_worker_killed_gives_unavailable(chaos_mesh: Mesh, chaos_channel, chaos_refs) -> None:
    workers = _tier(chaos_mesh, "worker")
    stub = inference_pb2_grpc.InferenceServiceStub(chaos_channel)
    try:
        in_flight = [asyncio.create_task(one_stream(stub, p)) for p in PROMPTS[:4]]
        assert await wait_until(lambda: sum(metric(w, "llmesh_worker_in_flight") for w in workers) > 0, 10.0)
        await asyncio.gather(*(asyncio.to_thread(kill9, w) for w in workers))
        outcomes = await asyncio.gather(*in_flight)
        # A stream either finished before the kill (with its full reference text) or fails
        # with UNAVAILABLE -- never a hang, a truncated OK or some other status.
        for o in outcomes:
            if o.ok:
                assert o.text == chaos_refs[o.prompt]
            else:
                assert o.code is grpc.StatusCode.UNAVAILABLE, (o.code, o.details)
        assert any(not o.ok for o in outcomes)
        late = await one_stream(stub, PROMPTS[0])
        assert late.code is grpc.StatusCode.UNAVAILABLE, (late.code, late.details)
        assert late.text == ""
    finally:
        await asyncio.gather(*(_restore(chaos_mesh, w) for w in workers))
    # The mesh recovers once workers are back (bounded wait).
    recovered = False
    deadline = time.monotonic() + 30.0
    while not recovered and time.monotonic() < deadline:
        out = await one_stream(stub, PROMPTS[1])
        recovered = out.ok and out.text == chaos_refs[PROMPTS[1]]
        if not recovered:
            await asyncio.sleep(0.5)
    assert recovered, "no request succeeded after every worker was restarted"

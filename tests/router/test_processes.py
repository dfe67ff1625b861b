"""Fault tests with real ``llmesh worker --engine fake`` processes: kill -9, SIGSTOP/SIGCONT."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from llmesh.procs import TierProcess
from tests.router.helpers import RouterUnderTest, request, start_router, wait_for
from tests.router.procs import spawn_fake_worker

pytestmark = pytest.mark.chaos


@pytest.fixture
def two_zone_workers() -> Iterator[list[TierProcess]]:
    procs = [spawn_fake_worker("fz-a", "zone-a", delay_ms=20),
             spawn_fake_worker("fz-b", "zone-b", delay_ms=20)]
    try:
        for proc in procs:
            proc.wait_serving(60)
        yield procs
    finally:
        for proc in procs:
            if proc.alive():
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()


async def _stream_and_fault(rut: RouterUnderTest, prompt: list[int], n: int, after: int, fault) -> tuple:  # type: ignore[no-untyped-def]
    """Stream a generation; after ``after`` tokens call ``fault()`` once."""
    tokens: list[int] = []
    final = None
    faulted = False
    async for response in rut.stub.Generate(request(prompt, n), timeout=60):
        if response.HasField("delta"):
            tokens.extend(response.delta.token_ids)
            if not faulted and len(tokens) >= after:
                faulted = True
                fault()
        else:
            final = response.final
    return tokens, final


async def test_kill_9_mid_stream_resumes_with_identical_output(two_zone_workers: list[TierProcess]) -> None:
    a, b = two_zone_workers
    rut = await start_router([(a.address, "zone-a"), (b.address, "zone-b")])
    try:
        prompt = [11, 22, 33, 44]
        undisturbed, final = await rut.generate(prompt, 40)
        assert final.served_by.worker_id == "fz-a" and final.served_by.resumed == 0
        tokens, final = await _stream_and_fault(rut, prompt, 40, 10, lambda: os.kill(a.pid, signal.SIGKILL))
        assert tokens == undisturbed  # one continuous stream, no duplicates, same greedy text
        assert final.served_by.resumed == 1 and final.served_by.worker_id == "fz-b"
        assert final.final.completion_tokens == 40 and final.final.prompt_tokens == len(prompt)
        status = await rut.status()
        assert status[a.address].health != "SERVING"
        # A new request right away goes to the surviving zone.
        _, final = await rut.generate(prompt, 3)
        assert final.served_by.zone == "zone-b"
    finally:
        await rut.close()


async def test_sigstop_ejects_and_sigcont_recovers(two_zone_workers: list[TierProcess]) -> None:
    a, b = two_zone_workers
    rut = await start_router([(a.address, "zone-a"), (b.address, "zone-b")])
    try:
        prompt = [7, 8, 9]
        undisturbed, _ = await rut.generate(prompt, 60)
        # Stop the serving worker mid-stream: the stream must still complete, resumed.
        tokens, final = await _stream_and_fault(rut, prompt, 60, 5, lambda: os.kill(a.pid, signal.SIGSTOP))
        assert tokens == undisturbed
        assert final.served_by.worker_id == "fz-b" and final.served_by.resumed == 1
        status = await rut.status()
        assert status[a.address].health in ("UNREACHABLE", "UNKNOWN")
        for _ in range(3):
            _, final = await rut.generate(prompt, 2)
            assert final.served_by.worker_id == "fz-b"
        os.kill(a.pid, signal.SIGCONT)

        async def back() -> bool:
            return (await rut.status())[a.address].health == "SERVING"

        await wait_for(back, timeout=10)
        await asyncio.sleep(0.6)  # let a circuit opened by the failure reach half-open
        _, final = await rut.generate(prompt, 2)
        assert final.served_by.worker_id == "fz-a"
    finally:
        await rut.close()


async def test_sigstop_while_idle_is_noticed(two_zone_workers: list[TierProcess]) -> None:
    a, b = two_zone_workers
    rut = await start_router([(a.address, "zone-a"), (b.address, "zone-b")])
    try:
        os.kill(a.pid, signal.SIGSTOP)
        await wait_for(lambda: not rut.router.registry.workers[a.address].healthy, timeout=5)
        _, final = await rut.generate([1, 2], 3)
        assert final.served_by.zone == "zone-b" and final.retries == 0
        os.kill(a.pid, signal.SIGCONT)
        await wait_for(lambda: rut.router.registry.workers[a.address].healthy, timeout=10)
    finally:
        await rut.close()

"""The router over worker Sessions (``worker_transport: session``): real worker servicers
on the step-based fake engine, in process, over real channels. Every request gets exactly
its tokens, frames carry many requests, refusals stay per request, cancel and deadlines
abort in the engine, and a worker lost mid-stream resumes elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from llmesh.worker.v1 import worker_pb2
from services.router.breaker import Circuit
from services.worker.fake_engine import FakeModel, fake_greedy
from tests.router.helpers import request, start_router, wait_for
from tests.worker.conftest import RunningWorker, start_running_worker


@pytest.fixture
async def two_workers(tiny_deepseek_dir: Path) -> AsyncIterator[list[RunningWorker]]:
    workers = [
        await start_running_worker(tiny_deepseek_dir, zone=zone, worker_id=f"w-{zone}",
                                   fake_token_delay_ms=5, fake_max_running=64,
                                   canary_interval_s=5.0, canary_timeout_s=5.0)
        for zone in ("zone-a", "zone-b")
    ]
    yield workers
    for worker in workers:
        await worker.close()


def address(worker: RunningWorker) -> str:
    return f"127.0.0.1:{worker.server.port}"


async def test_concurrent_requests_share_frames_and_get_exactly_their_tokens(
    two_workers: list[RunningWorker], tiny_deepseek_dir: Path
) -> None:
    model = FakeModel.from_dir(tiny_deepseek_dir)
    rut = await start_router([(address(w), w.server.settings.zone) for w in two_workers],
                             worker_transport="session", batch_max_wait_ms=5, worker_capacity=64)
    try:
        prompts = [[5, i, i + 1] for i in range(24)]
        results = await asyncio.gather(*(rut.generate(p, 10) for p in prompts))
        for prompt, (tokens, final) in zip(prompts, results, strict=True):
            assert tokens == fake_greedy(prompt, 10, model)
            assert final.final.completion_tokens == 10
        engine = two_workers[0].engine
        assert engine is not None
        # 24 requests x 10 tokens shared the engine's steps (10 to a few dozen, by how the
        # submissions spread over time on a busy box), far from one step per token.
        assert engine.steps <= 120
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([1, 2], 2, temperature=5.0)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        state = rut.router.registry.workers[address(two_workers[0])]
        assert state.breaker.state is Circuit.CLOSED
    finally:
        await rut.close()


async def test_cancel_aborts_in_the_engine_and_the_session_goes_on(two_workers: list[RunningWorker]) -> None:
    rut = await start_router([(address(two_workers[0]), "zone-a")], worker_transport="session")
    try:
        call = rut.stub.Generate(request([9, 9], 1500, ignore_eos=True))
        await call.read()
        call.cancel()

        async def idle() -> bool:
            load = await two_workers[0].stub.GetLoad(worker_pb2.GetLoadRequest())
            return load.load.in_flight == 0

        await wait_for(idle, timeout=5.0)
        tokens, _ = await rut.generate([3, 4], 3)  # the same session still serves
        assert len(tokens) == 3
    finally:
        await rut.close()


async def test_an_engine_lost_mid_stream_resumes_on_another_worker(
    two_workers: list[RunningWorker], tiny_deepseek_dir: Path
) -> None:
    model = FakeModel.from_dir(tiny_deepseek_dir)
    rut = await start_router([(address(w), w.server.settings.zone) for w in two_workers],
                             worker_transport="session")
    try:
        stream = rut.stub.Generate(request([6, 7], 60))
        tokens: list[int] = []
        final = None
        async for response in stream:
            if response.HasField("delta"):
                tokens += response.delta.token_ids
                if len(tokens) == 5:
                    assert two_workers[0].engine is not None
                    two_workers[0].engine.kill()  # zone-a's engine dies mid-stream
            else:
                final = response.final
        assert final is not None and final.served_by.zone == "zone-b" and final.served_by.resumed == 1
        assert tokens == fake_greedy([6, 7], 60, model)
    finally:
        await rut.close()

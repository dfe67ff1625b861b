"""The router over worker Sessions (``worker_transport: session``): real worker servicers
on the step-based fake engine, in process, over real channels. Every request gets exactly
its tokens, frames carry many requests, refusals stay per request, cancel and deadlines
abort in the engine, and a worker lost mid-stream resumes elsewhere."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from llmesh.common.v1 import common_pb2
from llmesh.worker.v1 import worker_pb2
from services.common import sessionwire
from services.common.errors import InvalidArgument, error_from_rpc
from services.router.breaker import Circuit
from services.router.workerclient import WATCH_LOAD_METHOD, GrpcWorkerClient
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


async def test_worker_frames_reach_the_requests_from_the_read_not_a_task(
    two_workers: list[RunningWorker], tiny_deepseek_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the worker's framed listener each frame goes to its requests from the event
    loop's read callback (FramedCall.listen): no reader task wakes per frame. The tokens
    are the same."""
    from services.router import batching

    in_task: list[bool] = []
    original = batching.AttemptStream.push_tokens

    def push_tokens(self: batching.AttemptStream, token_ids: list[int]) -> None:
        in_task.append(asyncio.current_task() is not None)
        original(self, token_ids)

    monkeypatch.setattr(batching.AttemptStream, "push_tokens", push_tokens)
    model = FakeModel.from_dir(tiny_deepseek_dir)
    rut = await start_router([(address(two_workers[0]), "zone-a")], worker_transport="session")
    try:
        prompts = [[8, i] for i in range(4)]
        results = await asyncio.gather(*(rut.generate(p, 12) for p in prompts))
        for prompt, (tokens, _) in zip(prompts, results, strict=True):
            assert tokens == fake_greedy(prompt, 12, model)
        assert in_task and not any(in_task), in_task
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


async def test_load_reports_travel_over_the_workers_framed_listener(tiny_deepseek_dir: Path) -> None:
    """The router's load watch (every interval, idle or not) is a plain frame per report
    on a connection of its own, not a grpc.aio message; a worker without the listener is
    watched over gRPC as before."""
    framed = await start_running_worker(tiny_deepseek_dir, canary_interval_s=5.0, canary_timeout_s=5.0)
    grpc_only = await start_running_worker(tiny_deepseek_dir, canary_interval_s=5.0, canary_timeout_s=5.0,
                                           session_port=-1)
    try:
        for worker, over_frames in ((framed, True), (grpc_only, False)):
            client = GrpcWorkerClient(address(worker))
            try:
                reports = []
                async for load in client.watch_load(0.02):
                    reports.append(load)
                    if len(reports) == 3:
                        break
                assert all(load.max_num_seqs == 64 for load in reports)
                opener = client._opener()
                assert (opener.framed_calls, opener.grpc_calls) == ((1, 0) if over_frames else (0, 1))
            finally:
                await client.close()
    finally:
        await framed.close()
        await grpc_only.close()


async def test_a_busy_workers_load_comes_on_its_frames(two_workers: list[RunningWorker],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The router names its load watch in its sessions: while a request streams, the
    worker's frames carry the load and the router takes it as a report (the worker's
    side, tests/worker/test_load_on_frames.py, shows the watch going quiet meanwhile).
    The quiet watch's connection is not pinged meanwhile: a ping and its pong would wake
    both processes for nothing the frames do not already say."""
    monkeypatch.setattr(sessionwire, "PING_IDLE_S", 0.1)  # pings every 0.1 s of silence
    pings = 0
    plain_frame = sessionwire.frame

    def counting_frame(kind: int, payload: bytes = b"") -> bytes:
        nonlocal pings
        pings += kind == sessionwire.PING
        return plain_frame(kind, payload)

    monkeypatch.setattr(sessionwire, "frame", counting_frame)
    worker = two_workers[0]
    rut = await start_router([(address(worker), "zone-a")], worker_transport="session",
                             load_interval_ms=100, load_timeout_ms=400)
    try:
        [monitor] = rut.router._monitors.values()
        dispatcher = rut.router._dispatchers[address(worker)]
        assert dispatcher.load_watch is not None and dispatcher.load_watch[0] == monitor.watcher
        # The worker knows the watch by the router's name for it.
        await wait_for(lambda: worker.server.servicer.load_clocks.get(monitor.watcher) is not None)
        # After a frame with the load, the watch may stay quiet for the router's limit on
        # silence less an interval (steps longer than the interval need no report between).
        clock = worker.server.servicer.load_clocks.get(monitor.watcher)
        assert clock is not None and clock.silence_s == pytest.approx(0.3)
        taken: list[int] = []

        def frame_load(load):  # type: ignore[no-untyped-def]
            taken.append(load.running)
            monitor.frame_load(load)

        dispatcher.load_watch = (monitor.watcher, frame_load)  # before the session opens
        [state] = list(rut.router.registry)
        tokens, final = await rut.generate([5, 6], 200, ignore_eos=True)  # about 1 s at 5 ms a step
        assert final.final.completion_tokens == 200 and len(tokens) == 200
        assert len(taken) >= 5 and max(taken) >= 1, taken
        assert state.reachable and state.load_failures == 0
        assert pings == 0  # the session is busy and the watch is heard on its frames
    finally:
        await rut.close()


async def test_a_framed_load_watch_names_what_is_wrong_with_its_request(tiny_deepseek_dir: Path) -> None:
    worker = await start_running_worker(tiny_deepseek_dir, canary_interval_s=5.0, canary_timeout_s=5.0)
    client = GrpcWorkerClient(address(worker))
    try:
        async def requests(*items: worker_pb2.WatchLoadRequest) -> AsyncIterator[worker_pb2.WatchLoadRequest]:
            for item in items:
                yield item

        def unused(_messages: object) -> object:
            raise AssertionError("the worker has a listener: no gRPC call")

        for messages, field in ((requests(worker_pb2.WatchLoadRequest(interval_ms=5)), "interval_ms"),
                                (requests(), "request")):
            call = client._opener().open(WATCH_LOAD_METHOD, unused, messages, worker_pb2.WatchLoadResponse)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            error = error_from_rpc(caught.value)
            assert isinstance(error, InvalidArgument) and error.violations[0].field == field
        # The worker serves on: a good watch still reports.
        async for load in client.watch_load(0.02):
            assert load.max_num_seqs == 64
            break
    finally:
        await client.close()
        await worker.close()


async def test_a_finished_request_leaves_no_generator_to_the_loops_finalizer(
        two_workers: list[RunningWorker]) -> None:
    """A request's worker stream is closed where the router leaves it at the final: one
    left suspended would be closed by the event loop's finalizer hook, which schedules
    the close thread-safely (a wake-up of the loop per request)."""
    hooks = sys.get_asyncgen_hooks()
    finalized: list[str] = []

    def finalizer(agen: Any) -> None:
        finalized.append(agen.__qualname__)
        if hooks.finalizer is not None:
            hooks.finalizer(agen)

    rut = await start_router([(address(two_workers[0]), "zone-a")], worker_transport="session")
    try:
        sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)
        try:
            for _ in range(3):
                tokens, final = await rut.generate([5, 6], 8)
                assert len(tokens) == 8
                assert final.final.finish_reason == common_pb2.ENGINE_FINISH_REASON_LENGTH
            gc.collect()
        finally:
            sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=hooks.finalizer)
        assert "AttemptStream.events" not in finalized, finalized
    finally:
        await rut.close()

"""Worker test fixtures: in-process workers on ephemeral ports with real aio channels."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.common.v1 import common_pb2
from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from services.worker.engine import EngineOutput, EngineRequest, FinishReason, OutputSink
from services.worker.fake_engine import FakeEngine
from services.worker.server import WorkerServer, start_worker
from services.worker.servicer import SERVICE_NAME
from services.worker.settings import WorkerSettings


@dataclass
class RunningWorker:
    server: WorkerServer
    engine: FakeEngine | None
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    health: health_pb2_grpc.HealthStub

    async def readiness(self, service: str = SERVICE_NAME) -> str:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    async def wait_readiness(self, status: str, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            current = await self.readiness()
            if current == status:
                return
            if loop.time() > deadline:
                raise AssertionError(f"readiness stayed {current}, wanted {status}")
            await asyncio.sleep(0.02)

    async def close(self) -> int:
        await self.channel.close()
        return await self.server.stop()


def start_from_generator(
    outputs: AsyncGenerator[EngineOutput, None], sink: OutputSink
) -> asyncio.Task[None]:
    """``Engine.start`` for an engine that yields one generator per request: a task per
    request drains it into ``sink``, so outputs of one step reach the worker from many
    tasks (an engine without a step loop of its own). Cancelling the task closes it."""

    async def drain() -> None:
        try:
            async with contextlib.aclosing(outputs) as events:
                async for out in events:
                    sink(out)
                    if out.finish_reason is not None:
                        return
            # The engine ended the stream without a finish reason: an error of this request.
            sink(EngineOutput([], finish_reason=FinishReason.ERROR))
        except Exception as exc:
            sink(exc)  # EngineDeadError, RequestRejected or any failure: its end, never none

    return asyncio.ensure_future(drain())


class Bridged:
    """The fake behind a per-request generator bridge (:func:`start_from_generator`, a
    task per request): the core and session must not rely on one callback per step."""

    def __init__(self, fake: FakeEngine) -> None:
        self.fake = fake
        self.drains: set[asyncio.Task[None]] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fake, name)

    async def start(self, request: EngineRequest, sink: OutputSink) -> None:
        task = start_from_generator(self.fake.generate(request), sink)
        self.drains.add(task)
        task.add_done_callback(self.drains.discard)


def token_request(request_id: str, prompt: list[int], **sampling: object) -> common_pb2.TokenRequest:
    return common_pb2.TokenRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=common_pb2.EngineSampling(**sampling),  # type: ignore[arg-type]
    )


async def generate(stub: worker_pb2_grpc.WorkerServiceStub, request: common_pb2.TokenRequest,
                   timeout: float = 60.0) -> tuple[list[int], common_pb2.TokenFinal]:
    tokens: list[int] = []
    final = None
    async for msg in stub.Generate(worker_pb2.GenerateRequest(request=request), timeout=timeout):
        assert msg.request_id == (request.request_id or msg.request_id)
        assert final is None, "nothing may follow the final message"
        if msg.HasField("delta"):
            tokens += msg.delta.token_ids
        else:
            final = msg.final
    assert final is not None, "stream ended without a final message"
    return tokens, final


async def start_running_worker(
    model_dir: Path, *, engine_factory: Callable[[], object] | None = None, wait: bool = True,
    **overrides: object,
) -> RunningWorker:
    values: dict[str, object] = {
        "model": str(model_dir), "engine": "fake", "port": 0, "zone": "zone-t", "worker_id": "w-test",
        "canary_interval_s": 0.1, "canary_timeout_s": 0.3, "engine_check_interval_s": 0.05,
        "grace_seconds": 0.5, "drain_seconds": 0.3,
    }
    values.update(overrides)
    settings = WorkerSettings(**values)  # type: ignore[arg-type]
    engine = None
    if engine_factory is None:
        engine = FakeEngine(model_dir, token_delay_ms=float(values.get("fake_token_delay_ms", 2.0)),  # type: ignore[arg-type]
                            max_running=int(values.get("fake_max_running", 64)))  # type: ignore[call-overload]

        def engine_factory() -> FakeEngine:
            return engine  # type: ignore[return-value]
    server = await start_worker(settings, engine_factory=engine_factory)  # type: ignore[arg-type]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    worker = RunningWorker(server, engine, channel, worker_pb2_grpc.WorkerServiceStub(channel),
                           health_pb2_grpc.HealthStub(channel))
    if wait:
        await worker.wait_readiness("SERVING")
    return worker


@pytest.fixture(scope="module")
async def fake_worker(tiny_deepseek_dir: Path) -> AsyncIterator[RunningWorker]:
    """One fake-engine worker shared by a module's servicer tests."""
    worker = await start_running_worker(tiny_deepseek_dir, canary_interval_s=5.0, canary_timeout_s=5.0)
    yield worker
    await worker.close()


@pytest.fixture
async def stepped_worker(tiny_deepseek_dir: Path) -> AsyncIterator[RunningWorker]:
    """A fake-engine worker of its own per test, 5 ms per engine step, room for 64 requests."""
    worker = await start_running_worker(tiny_deepseek_dir, fake_token_delay_ms=5, fake_max_running=64,
                                        canary_interval_s=5.0, canary_timeout_s=5.0)
    yield worker
    await worker.close()

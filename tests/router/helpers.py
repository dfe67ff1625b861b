"""Shared helpers of the router tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc

from llmesh.common.v1 import common_pb2
from llmesh.router.v1 import router_pb2, router_pb2_grpc
from services.router.server import RouterServer, start_in_process, stop_in_process
from services.router.settings import RouterSettings


def settings(workers: Sequence[tuple[str, str]], **overrides: Any) -> RouterSettings:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "workers": [{"address": a, "zone": z} for a, z in workers],
        "zones": ["zone-a", "zone-b", "kunpeng"],
        "degraded_zones": ["kunpeng"],
        "load_interval_ms": 50,
        # Generous: CI shares 2 cores with vLLM engines; a missed poll would move traffic.
        "load_timeout_ms": 1000,
        "retry_base_backoff_ms": 5,
        "batch_max_wait_ms": 0,
    }
    values.update(overrides)
    return RouterSettings(**values)


class RouterUnderTest:
    def __init__(self, server: RouterServer) -> None:
        self.server = server
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)

    @property
    def router(self):  # type: ignore[no-untyped-def]
        return self.server.router

    async def close(self) -> None:
        await self.channel.close()
        await stop_in_process(self.server)

    async def wait_healthy(self, n: int, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if sum(1 for w in self.router.registry if w.healthy) >= n:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"fewer than {n} healthy workers: {await self.status()}")

    async def status(self) -> dict[str, router_pb2.WorkerStatus]:
        reply = await self.stub.ListWorkers(router_pb2.ListWorkersRequest())
        return {w.address: w for w in reply.workers}

    async def generate(
        self, prompt: Sequence[int], max_tokens: int = 8, *, request_id: str = "", timeout: float = 30,
        **fields: Any,
    ) -> tuple[list[int], router_pb2.RouterFinal]:
        tokens: list[int] = []
        final = None
        async for response in self.stub.Generate(request(prompt, max_tokens, request_id, **fields),
                                                 timeout=timeout):
            if response.HasField("delta"):
                tokens.extend(response.delta.token_ids)
            else:
                final = response.final
        assert final is not None
        return tokens, final


def request(prompt: Sequence[int], max_tokens: int = 8, request_id: str = "", *,
            model: str = "", resume: Sequence[int] = (), resumed: int = 0,
            priority: int = 0, ignore_eos: bool = False,
            temperature: float = 0.0) -> router_pb2.GenerateRequest:
    token_request = common_pb2.TokenRequest(
        request_id=request_id, model=model, prompt_token_ids=list(prompt), priority=priority
    )
    token_request.sampling.max_tokens = max_tokens
    token_request.sampling.temperature = temperature
    if ignore_eos:
        token_request.sampling.ignore_eos = True
    return router_pb2.GenerateRequest(
        request=token_request, resume_token_ids=list(resume), resumed=resumed
    )


async def start_router(workers: Sequence[tuple[str, str]], healthy: int | None = None,
                       **overrides: Any) -> RouterUnderTest:
    server = await start_in_process(settings(workers, **overrides))
    rut = RouterUnderTest(server)
    if healthy is None:
        healthy = len(workers)
    if healthy:
        await rut.wait_healthy(healthy)
    return rut


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02) -> float:  # type: ignore[no-untyped-def]
    """Poll until ``predicate()`` is true; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - start
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")

"""Helpers for the CPU-tier tests: in-process servers, health, reflection, error details."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from services.common.server import ServerHandle, run_until_signal


@asynccontextmanager
async def running_server(
    build: Callable[[], Awaitable[tuple[ServerHandle, Any]]],
    warmup: Callable[[Any], Awaitable[None]] | None = None,
    tier: str = "test",
) -> AsyncIterator[tuple[ServerHandle, Any, grpc.aio.Channel]]:
    """Start a server from its factory on an ephemeral port; yield (handle, core, channel)."""
    handle, core = await build()
    assert handle.port > 0
    stop = asyncio.Event()
    task = asyncio.create_task(run_until_signal(
        handle, tier=tier, grace_seconds=1.0,
        warmup=(lambda: warmup(core)) if warmup else None, stop_event=stop,
    ))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        await asyncio.wait_for(channel.channel_ready(), 10)
        for _ in range(500):
            if "ready" in handle.events:
                break
            await asyncio.sleep(0.01)
        yield handle, core, channel
    finally:
        stop.set()
        await task
        await channel.close()


async def health_status(channel: grpc.aio.Channel, service: str) -> str:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def reflection_services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names: list[str] = []
    async for reply in stub.ServerReflectionInfo(requests(), timeout=5):
        names = [s.name for s in reply.list_services_response.service]
    return names


async def reflection_file_for(channel: grpc.aio.Channel, symbol: str) -> bool:
    """True when reflection can describe ``symbol`` (a service's descriptor is served)."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)

    async for reply in stub.ServerReflectionInfo(requests(), timeout=5):
        return bool(reply.file_descriptor_response.file_descriptor_proto)
    return False


def field_violations(err: grpc.aio.AioRpcError) -> list[str]:
    """The BadRequest field names carried in the status details of ``err``."""
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    fields: list[str] = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields

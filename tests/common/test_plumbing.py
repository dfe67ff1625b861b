"""The shared gRPC plumbing over real aio channels: health, reflection, errors, shutdown."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from llmesh.v1 import inference_pb2, inference_pb2_grpc
from services.common import errors
from services.common.server import ServerHandle, create_server, run_until_signal
from services.common.settings import ServerSettings

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


class RaisingService(inference_pb2_grpc.InferenceServiceServicer):
    """Raises whatever the prompt names, to exercise the error mapping end to end."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        if request.prompt == "invalid":
            raise errors.InvalidArgument("sampling.temperature", "must be >= 0, got -1")
        if request.prompt == "quota":
            raise errors.ResourceExhausted("tenant demo over 30 requests/min", retry_after_s=2.5)
        if request.prompt == "missing":
            raise errors.NotFound("model 'nope' is not served")
        if request.prompt == "boom":
            raise RuntimeError("secret prompt text must not leak")
        if request.prompt == "slow":
            await self.release.wait()
        return inference_pb2.GenerateResponse(text="ok:" + request.prompt)

    async def GenerateStream(self, request, context):
        yield inference_pb2.GenerateStreamResponse(delta=inference_pb2.StreamDelta(text="a"))
        if request.prompt == "invalid":
            raise errors.InvalidArgument("prompt", "bad after first delta")
        yield inference_pb2.GenerateStreamResponse(final=inference_pb2.GenerateResponse(text=""))


async def start(service: RaisingService) -> ServerHandle:
    handle = await create_server(
        ServerSettings(port=0),
        tier="test",
        register=lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(service, s),
        service_names=[SERVICE],
    )
    return handle


@pytest.fixture
async def running():
    service = RaisingService()
    handle = await start(service)
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_until_signal(handle, tier="test", grace_seconds=1.0, stop_event=stop)
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    await asyncio.wait_for(channel.channel_ready(), 10)
    for _ in range(100):
        if "ready" in handle.events:
            break
        await asyncio.sleep(0.02)
    yield handle, channel, service, stop
    stop.set()
    await task
    await channel.close()


async def test_binds_an_ephemeral_port(running):
    handle, *_ = running
    assert handle.port > 0


async def test_health_liveness_and_readiness(running):
    _, channel, _, _ = running
    stub = health_pb2_grpc.HealthStub(channel)
    live = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    ready = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert live.status == health_pb2.HealthCheckResponse.SERVING
    assert ready.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_services(running):
    _, channel, _, _ = running
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names = []
    async for reply in stub.ServerReflectionInfo(requests()):
        names = [s.name for s in reply.list_services_response.service]
    assert SERVICE in names
    assert "grpc.health.v1.Health" in names


async def _call(channel, prompt):
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    return await stub.Generate(inference_pb2.GenerateRequest(prompt=prompt), timeout=5)


async def test_invalid_argument_carries_field_violation(running):
    _, channel, _, _ = running
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(channel, "invalid")
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "sampling.temperature"


async def test_resource_exhausted_carries_retry_info(running):
    _, channel, _, _ = running
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(channel, "quota")
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(err.value)
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert info.retry_delay.ToMilliseconds() == 2500


async def test_unexpected_errors_are_internal_and_do_not_leak(running):
    _, channel, _, _ = running
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(channel, "boom")
    assert err.value.code() is grpc.StatusCode.INTERNAL
    assert "secret" not in (err.value.details() or "")
    # The server is still up after the failure.
    reply = await _call(channel, "fine")
    assert reply.text == "ok:fine"


async def test_stream_error_after_first_delta(running):
    _, channel, _, _ = running
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for item in stub.GenerateStream(inference_pb2.GenerateStreamRequest(prompt="invalid")):
            got.append(item)
    assert len(got) == 1
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidArgument("f", "d"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("m"), grpc.StatusCode.NOT_FOUND),
        (errors.Unauthenticated("m"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.PermissionDenied("m"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.ResourceExhausted("m"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unavailable("m"), grpc.StatusCode.UNAVAILABLE),
        (errors.DeadlineExceeded("m"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.Cancelled("m"), grpc.StatusCode.CANCELLED),
        (errors.FailedPrecondition("m"), grpc.StatusCode.FAILED_PRECONDITION),
        (ValueError("plain"), grpc.StatusCode.INVALID_ARGUMENT),
        (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
        (KeyError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_mapping_table(exc, code):
    assert errors.map_exception(exc).code is code


def test_invalid_argument_is_a_value_error_naming_many_fields():
    err = errors.InvalidArgument.many(
        [errors.FieldViolation("a", "x"), errors.FieldViolation("b", "y")]
    )
    assert isinstance(err, ValueError)
    assert err.field == "a"
    mapped = errors.map_exception(err)
    bad = mapped.details[0]
    assert [v.field for v in bad.field_violations] == ["a", "b"]
    assert not math.isnan(len(mapped.message))


async def test_shutdown_order_drains_in_flight_calls():
    """NOT_SERVING first, then in-flight calls finish within grace, then close()."""
    service = RaisingService()
    handle = await start(service)
    stop = asyncio.Event()
    closed: list[str] = []

    async def close_engine() -> None:
        closed.append("engine")
        handle.events.append("engine_closed")

    task = asyncio.create_task(
        run_until_signal(
            handle, tier="test", grace_seconds=5.0, stop_event=stop, close=[close_engine],
            drain_seconds=0.5,
        )
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    health_stub = health_pb2_grpc.HealthStub(channel)
    for _ in range(200):
        if "ready" in handle.events:
            break
        await asyncio.sleep(0.02)
    slow = asyncio.create_task(_call(channel, "slow"))
    await asyncio.sleep(0.2)
    stop.set()
    for _ in range(200):
        if "not_ready" in handle.events:
            break
        await asyncio.sleep(0.01)
    reply = await health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    service.release.set()
    result = await slow
    assert result.text == "ok:slow"
    await task
    await channel.close()
    events = handle.events
    assert events.index("not_ready") < events.index("stopped") < events.index("engine_closed")
    assert events[-1] == "closed"
    assert closed == ["engine"]


async def test_health_watch_streams_through_the_interceptors(running):
    """grpc's health Watch writes with context.write(): the interceptor must not break it."""
    _, channel, _, _ = running
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
    async for reply in call:
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        break
    call.cancel()


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    """A port for a tier to bind later is never one an outgoing connection may take as its
    local port meanwhile (the kernel's ephemeral range), nor one handed out before."""
    import socket
    from pathlib import Path

    from llmesh.procs import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < port < low for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))

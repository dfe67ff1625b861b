"""The shared server interceptors against hostile input and cancellation.

A real grpc.aio server on port 0 with the interceptors every tier installs (tracing,
then error mapping) and a stand-in InferenceService; calls go through real channels.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from llmesh.v1 import inference_pb2, inference_pb2_grpc
from services.common.interceptors import ErrorMappingInterceptor
from services.common.tracing import server_interceptors
from tests.gateway.helpers import violations

TRACEPARENT = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
BIG = "x" * (1 << 20)


class StandIn(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self) -> None:
        self.stream_closed = asyncio.Event()
        self.sending = asyncio.Event()

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        return inference_pb2.GenerateResponse(text=request.prompt)

    async def GenerateStream(self, request, context):  # type: ignore[no-untyped-def]
        try:
            while True:
                # Large messages fill the flow-control window: grpc then waits in its send
                # with this generator suspended at the yield, where a cancel used to orphan it.
                self.sending.set()
                yield inference_pb2.GenerateStreamResponse(delta=inference_pb2.StreamDelta(text=BIG))
        finally:
            self.stream_closed.set()


@pytest.fixture
async def served():  # type: ignore[no-untyped-def]
    servicer = StandIn()
    server = grpc.aio.server(interceptors=[*server_interceptors(), ErrorMappingInterceptor("test")])
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel
    await channel.close()
    await server.stop(0)


def _raw(channel: grpc.aio.Channel, method: str, *, stream: bool = False):  # type: ignore[no-untyped-def]
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    path = f"/llmesh.v1.InferenceService/{method}"
    return channel.unary_stream(path, **identity) if stream else channel.unary_unary(path, **identity)


# Field 1 (model, a string) holding "\xc3\x28": not UTF-8. Then bytes that are no message at all.
INVALID_UTF8 = b"\x0a\x02\xc3\x28"
UNDECODABLE = b"\xff\xff\xff\xff\xff"


@pytest.mark.parametrize("payload", [INVALID_UTF8, UNDECODABLE], ids=["invalid-utf8", "undecodable"])
async def test_unparsable_unary_request_is_invalid_argument(served, payload: bytes) -> None:  # type: ignore[no-untyped-def]
    _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _raw(channel, "Generate")(payload, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "llmesh.v1.GenerateRequest" in (err.value.details() or "")
    assert "Error" not in (err.value.details() or "")  # no Python class names
    assert violations(err.value) == ["request"]


@pytest.mark.parametrize("payload", [INVALID_UTF8, UNDECODABLE], ids=["invalid-utf8", "undecodable"])
async def test_unparsable_stream_request_is_invalid_argument(served, payload: bytes) -> None:  # type: ignore[no-untyped-def]
    _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in _raw(channel, "GenerateStream", stream=True)(payload, timeout=5):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "llmesh.v1.GenerateStreamRequest" in (err.value.details() or "")


async def test_valid_bytes_still_parse(served) -> None:  # type: ignore[no-untyped-def]
    _, channel = served
    reply = await _raw(channel, "Generate")(inference_pb2.GenerateRequest(prompt="hé").SerializeToString())
    assert inference_pb2.GenerateResponse.FromString(reply).text == "hé"


async def test_cancelled_stream_logs_no_error(served, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    servicer, channel = served
    caplog.set_level(logging.WARNING)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    for _ in range(5):
        servicer.stream_closed.clear()
        servicer.sending.clear()
        call = stub.GenerateStream(inference_pb2.GenerateStreamRequest(prompt="x"), metadata=TRACEPARENT)
        await call.read()  # the stream runs; the server is now blocked sending the next ones
        await asyncio.wait_for(servicer.sending.wait(), 5)
        call.cancel()
        # The servicer's generator is closed by the cancel itself, not left to the GC.
        await asyncio.wait_for(servicer.stream_closed.wait(), 5)
    # grpc's own "ExecuteBatchError raised in core" may appear here: a multi-MB message still
    # in flight when the stream is reset (this test's big messages make the timing certain;
    # the stock OpenTelemetry interceptor gets it too). Everything else must be quiet.
    errors = {r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
              and not r.getMessage().startswith("ExecuteBatchError raised in core")}
    assert not errors, sorted(errors)

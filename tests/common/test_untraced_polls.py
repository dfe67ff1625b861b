"""Load polls, health checks and Session streams get no span of their own; other RPCs do.

A real grpc.aio server with the tiers' tracing interceptor and a real channel with the
tiers' client interceptor; spans go to the SDK's in-memory exporter.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common import tracing


class Loads(worker_pb2_grpc.WorkerServiceServicer):
    async def GetLoad(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.GetLoadResponse(load=worker_pb2.Load(running=1))

    async def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.GetModelInfoResponse(model="m")


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", lambda name, version=None, tracer_provider=None, schema_url=None,
                        attributes=None: provider.get_tracer(name, version, schema_url))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    yield exporter
    provider.shutdown()


async def test_polls_and_health_are_not_traced_other_calls_are(spans: InMemorySpanExporter) -> None:
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(Loads(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=tracing.client_interceptors())
    try:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        for _ in range(5):
            assert (await stub.GetLoad(worker_pb2.GetLoadRequest())).load.running == 1
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert spans.get_finished_spans() == ()
        assert (await stub.GetModelInfo(worker_pb2.GetModelInfoRequest())).model == "m"
        names = sorted((s.name, s.kind.name) for s in spans.get_finished_spans())
        assert names == [("/llmesh.worker.v1.WorkerService/GetModelInfo", "CLIENT"),
                         ("/llmesh.worker.v1.WorkerService/GetModelInfo", "SERVER")]
    finally:
        await channel.close()
        await server.stop(0)

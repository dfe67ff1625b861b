"""The tiers' own OpenTelemetry helpers: the RPC filter and the tracer cache."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import filters
from opentelemetry.sdk.trace import TracerProvider

from services.common import tracing

METHODS = [
    "/llmesh.tokenizer.v1.TokenizerService/Encode",
    "/llmesh.worker.v1.WorkerService/GetLoad",
    "/llmesh.worker.v1.WorkerService/WatchLoad",
    "/llmesh.worker.v1.WorkerService/Session",
    "/llmesh.worker.v1.WorkerService/GetModelInfo",
    "/llmesh.router.v1.RouterService/Session",
    "/llmesh.v1.InferenceService/GenerateStream",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.health.v1.HealthX/Check",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/a.b.C/Sessions",
    "/a.b.C/",
    "NoSlash",
    "",
]


class ServerDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def client_details(method: str) -> Any:
    # grpc.aio hands client interceptors the method as bytes (grpc issue 31092).
    return grpc.aio.ClientCallDetails(method.encode(), None, None, None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", METHODS)
def test_the_filter_decides_as_opentelemetrys_composition(method: str) -> None:
    """``tracing._traced`` stands in for OpenTelemetry's own filters, which cost a tenth
    of a unary call's CPU: it must decide every method the same way, on both sides."""
    theirs = filters.negate(filters.any_of(
        filters.health_check(), *(filters.method_name(name) for name in tracing.UNTRACED_METHODS)
    ))
    for details in (ServerDetails(method), client_details(method)):
        assert tracing._traced(details) == theirs(details), (method, type(details).__name__)


def test_the_filter_leaves_out_polls_sessions_and_health() -> None:
    assert tracing._traced(ServerDetails("/llmesh.tokenizer.v1.TokenizerService/Encode"))
    assert not tracing._traced(ServerDetails("/llmesh.worker.v1.WorkerService/GetLoad"))
    assert not tracing._traced(client_details("/llmesh.router.v1.RouterService/Session"))
    assert not tracing._traced(ServerDetails("/grpc.health.v1.Health/Watch"))


def test_the_tracer_is_kept_until_the_provider_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = TracerProvider(), TracerProvider()
    current = [first]
    made: list[str] = []

    def get_tracer(name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        made.append(name)
        return current[0].get_tracer(name)

    monkeypatch.setattr(trace, "get_tracer", get_tracer)
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: current[0])
    monkeypatch.setattr(tracing, "_tracers", {})
    a = tracing.tracer()
    assert tracing.tracer() is a and made == ["llmesh"]
    assert tracing.tracer("other") is not a and made == ["llmesh", "other"]
    current[0] = second
    b = tracing.tracer()
    assert b is not a and made == ["llmesh", "other", "llmesh"]
    with b.start_as_current_span("x") as span:
        assert span.get_span_context().is_valid  # from the new provider, recording

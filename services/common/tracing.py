"""OpenTelemetry set-up from the standard variables, and the gRPC interceptors.

OTEL_TRACES_EXPORTER: otlp, console or none. Unset means otlp when
OTEL_EXPORTER_OTLP_ENDPOINT (or the traces endpoint) is set, else none, so a
development machine without a collector does not log export failures.
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG are read by the SDK itself.
"""

from __future__ import annotations

import os
from typing import Any

import grpc
from opentelemetry import trace

_configured = False


def setup_tracing(service_name: str) -> None:
    """Install a tracer provider for this process (idempotent)."""
    global _configured
    if _configured:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    exporter_names = os.environ.get("OTEL_TRACES_EXPORTER", "")
    if not exporter_names:
        has_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        )
        exporter_names = "otlp" if has_endpoint else "none"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    for exporter_name in (n.strip() for n in exporter_names.split(",")):
        exporter: Any
        if exporter_name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif exporter_name == "console":
            exporter = ConsoleSpanExporter()
        elif exporter_name in ("none", ""):
            continue
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {exporter_name!r}")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _configured = True


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def tracer(name: str = "llmesh") -> trace.Tracer:
    return trace.get_tracer(name)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())

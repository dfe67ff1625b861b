"""OpenTelemetry set-up from the standard variables, and the gRPC interceptors.

OTEL_TRACES_EXPORTER: otlp, console or none. Unset means otlp when
OTEL_EXPORTER_OTLP_ENDPOINT (or the traces endpoint) is set, else none, so a
development machine without a collector does not log export failures.
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG are read by the SDK itself.

Spans nobody exports are not recorded (:class:`LeanTracerProvider`): with no exporter,
each span is a non-recording one that still gets its own ids and the sampler's decision,
so trace ids reach the logs and the next tier exactly as with the SDK's spans.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.util import types

_configured = False


def setup_tracing(service_name: str) -> None:
    """Install a tracer provider for this process (idempotent)."""
    global _configured
    if _configured:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    exporter_names = os.environ.get("OTEL_TRACES_EXPORTER", "")
    if not exporter_names:
        has_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        )
        exporter_names = "otlp" if has_endpoint else "none"
    provider = LeanTracerProvider(resource=Resource.create({"service.name": name}))
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


_RANDOM_TRACE_ID = int(getattr(trace.TraceFlags, "RANDOM_TRACE_ID", 0))
"""W3C trace-context level 2's flag, set by SDKs that have it (1.4x); 0 where it is absent."""


class LeanTracerProvider(TracerProvider):
    """The SDK's provider, whose spans are recorded only once a span processor is added.

    Before that a recorded span goes nowhere, yet costs every tier tens of microseconds
    per span (attributes checked and copied, the span built, ended and offered to no
    processor), several spans per request. Its tracers hand out non-recording spans
    instead, with what the SDK would have given them: a new span id, the parent's trace
    id or a new one, the sampler's decision in the trace flags and its trace state. Logs
    (:mod:`services.common.logs`) and ``traceparent`` headers therefore carry the same ids,
    and a tier downstream that does export records the same trace."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exporting = False
        """A span processor was added: spans are the SDK's own from then on."""

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self.exporting = True

    def get_tracer(self, instrumenting_module_name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _LeanTracer(self, super().get_tracer(instrumenting_module_name, *args, **kwargs))


class _LeanTracer(trace.Tracer):
    """A tracer of :class:`LeanTracerProvider`: the SDK's tracer while the provider exports,
    non-recording spans with the SDK's ids and sampling decision before."""

    def __init__(self, provider: LeanTracerProvider, recording: trace.Tracer) -> None:
        self._provider = provider
        self._recording = recording

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[trace.Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        provider = self._provider
        if provider.exporting:
            return self._recording.start_span(
                name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception)
        parent = trace.get_current_span(context).get_span_context()
        ids = provider.id_generator
        if parent.is_valid:
            trace_id = parent.trace_id
            flags = parent.trace_flags & _RANDOM_TRACE_ID
        else:
            trace_id = ids.generate_trace_id()
            flags = _RANDOM_TRACE_ID if _RANDOM_TRACE_ID and ids.is_trace_id_random() else 0
        decision = provider.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        if decision.decision.is_sampled():
            flags |= trace.TraceFlags.SAMPLED
        return trace.NonRecordingSpan(trace.SpanContext(
            trace_id, ids.generate_span_id(), is_remote=False,
            trace_flags=trace.TraceFlags(flags), trace_state=decision.trace_state,
        ))

    @contextlib.contextmanager  # the API's own decorator is private; no tier decorates with spans
    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[trace.Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(
            name, context, kind, attributes, links, start_time, record_exception, set_status_on_exception)
        with trace.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                            set_status_on_exception=set_status_on_exception) as current:
            yield current


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


_tracers: dict[str, tuple[object, trace.Tracer]] = {}
"""name -> (the provider it came from, the tracer): ``trace.get_tracer`` builds a new
tracer (and compares instrumentation scopes) on every call, which the request paths of
every tier make several times per request."""


def tracer(name: str = "llmesh") -> trace.Tracer:
    """The tracer ``name`` of the current global provider (kept until the provider changes)."""
    provider = trace.get_tracer_provider()
    cached = _tracers.get(name)
    if cached is not None and cached[0] is provider:
        return cached[1]
    made = trace.get_tracer(name)
    _tracers[name] = (provider, made)
    return made


def current_traceparent() -> str:
    """The current span's W3C ``traceparent``, "" when there is none: the header the
    trace-context propagator writes, for session frames that carry only this header.
    Straight from the span context, where ``propagate.inject`` runs the whole propagator
    chain (trace context, baggage) into a dict: 1.5 against 2.8 µs per call (timeit), asked
    once per request by each session hop."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


UNTRACED_METHODS = ("GetLoad", "WatchLoad", "Session")
"""RPCs that get no span of their own. Load polls run several times a second per worker
for as long as the mesh runs: a span each would cost both ends more CPU than the poll
itself and flood the trace backend with spans nobody reads. A ``Session`` lives as long as
the processes it links; every request it carries has its own span instead. Health checks
are left out for the same reason as load polls."""


_UNTRACED = frozenset(UNTRACED_METHODS)
_HEALTH_SERVICE = "grpc.health.v1.Health"


def _traced(details: Any) -> bool:
    """The OpenTelemetry gRPC filter: every RPC but :data:`UNTRACED_METHODS` and health.

    What OpenTelemetry's ``negate(any_of(health_check(), method_name(...)))`` decides,
    without its cost: that composition splits and normalises the method path once per
    condition, with isinstance checks, on every call on both sides (about a tenth of the
    tokenizer's CPU per ``Encode``). ``tests/common/test_tracing.py`` checks both agree."""
    method = getattr(details, "method", None)
    if isinstance(method, bytes):
        method = method.decode()
    if not isinstance(method, str):
        return True
    service, _, name = method.lstrip("/").rpartition("/")
    return name not in _UNTRACED and not service.startswith(_HEALTH_SERVICE)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    from opentelemetry.instrumentation.grpc import __version__, _aio_server

    class StreamClosingServerInterceptor(_aio_server.OpenTelemetryAioServerInterceptor):  # type: ignore[misc]
        """OpenTelemetry's aio server interceptor, with response streams written, not yielded.

        The stock interceptor is an async generator that attaches the caller's context and
        holds the span across its ``yield``. When a client cancels while grpc is sending a
        message, grpc drops the generator without closing it; the event loop finalizes it
        later in another task, where detaching a token made in this task fails and logs an
        ERROR "Failed to detach context" (once per cancelled stream, in every streaming
        tier). Here the handler is a coroutine: cancellation lands in it, and the stream
        below is closed, the span ended and the context detached in the same task.
        """

        def _intercept_aio_server_stream(self, behavior: Any, handler_call_details: Any) -> Any:
            async def write_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
                with self._set_remote_context(context), self._start_span(
                    handler_call_details, context, set_status_on_exception=False
                ) as span:
                    traced = _aio_server._OpenTelemetryAioServicerContext(context, span)
                    responses = behavior(request_or_iterator, traced)
                    try:
                        async for response in responses:
                            await context.write(response)
                    except Exception as error:
                        if type(error) is not Exception:  # bare Exceptions are aborts (as upstream)
                            span.record_exception(error)
                        raise
                    finally:
                        await responses.aclose()

            return write_stream

    return [StreamClosingServerInterceptor(trace.get_tracer(
        "opentelemetry.instrumentation.grpc", __version__,
        schema_url="https://opentelemetry.io/schemas/1.11.0",
    ), filter_=_traced)]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_traced))

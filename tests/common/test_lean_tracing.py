"""Spans nobody exports are not recorded, yet carry the ids and sampling decision the SDK's
spans would (services.common.tracing.LeanTracerProvider): logs and the next tier see the
same trace either way."""

from __future__ import annotations

import logging

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from services.common import logs, tracing

REMOTE_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
REMOTE_SPAN = "00f067aa0ba902b7"


def _traceparent(span: trace.Span) -> str:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier["traceparent"]


def _remote(flags: str) -> object:
    return propagate.extract({"traceparent": f"00-{REMOTE_TRACE}-{REMOTE_SPAN}-{flags}"})


def test_without_a_processor_spans_are_not_recorded_and_get_new_ids() -> None:
    tracer = tracing.LeanTracerProvider().get_tracer("t")
    with tracer.start_as_current_span("root", attributes={"a": 1}) as root:
        assert not root.is_recording()
        outer = root.get_span_context()
        assert outer.is_valid and outer.trace_flags.sampled  # the default sampler samples roots
        child = tracer.start_span("child")
        inner = child.get_span_context()
        assert inner.trace_id == outer.trace_id and inner.span_id != outer.span_id
        _, trace_id, span_id, flags = _traceparent(child).split("-")
        assert (trace_id, span_id) == (f"{inner.trace_id:032x}", f"{inner.span_id:016x}")
        assert int(flags, 16) & 1  # sampled (and random-trace-id where the SDK sets it)
    other = tracer.start_span("another root").get_span_context()
    assert other.trace_id != outer.trace_id


@pytest.mark.parametrize(("flags", "sampled"), [("01", True), ("00", False)])
def test_a_remote_parent_keeps_its_trace_and_its_sampling(flags: str, sampled: bool) -> None:
    """A tier without an exporter passes the caller's trace on as the SDK would: same trace
    id, its own span id, the parent's sampled flag (ParentBased, the SDK's default)."""
    tracer = tracing.LeanTracerProvider().get_tracer("t")
    span = tracer.start_span("server", context=_remote(flags))  # type: ignore[arg-type]
    ctx = span.get_span_context()
    assert f"{ctx.trace_id:032x}" == REMOTE_TRACE and f"{ctx.span_id:016x}" != REMOTE_SPAN
    assert ctx.trace_flags.sampled is sampled
    assert _traceparent(span).startswith(f"00-{REMOTE_TRACE}-")
    assert bool(int(_traceparent(span).rsplit("-", 1)[1], 16) & 1) is sampled


def test_the_configured_sampler_decides_the_flags() -> None:
    span = tracing.LeanTracerProvider(sampler=ALWAYS_OFF).get_tracer("t").start_span("root")
    ctx = span.get_span_context()
    assert ctx.is_valid and not ctx.trace_flags.sampled and not span.is_recording()


def test_the_sdk_and_the_lean_provider_propagate_alike() -> None:
    """Under the same remote parent both give the same trace id and flags downstream."""
    for flags in ("00", "01", "03"):
        ours = tracing.LeanTracerProvider().get_tracer("t").start_span("s", context=_remote(flags))  # type: ignore[arg-type]
        sdk = TracerProvider().get_tracer("t").start_span("s", context=_remote(flags))  # type: ignore[arg-type]
        ours_fields, sdk_fields = _traceparent(ours).split("-"), _traceparent(sdk).split("-")
        assert (ours_fields[1], ours_fields[3]) == (sdk_fields[1], sdk_fields[3])
        assert not ours.is_recording() and sdk.is_recording() == (flags != "00")


def test_logs_carry_the_unrecorded_spans_ids(caplog: pytest.LogCaptureFixture) -> None:
    tracer = tracing.LeanTracerProvider().get_tracer("t")
    formatter = logs.JsonFormatter("gateway")
    with tracer.start_as_current_span("request") as span:
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
        line = formatter.format(record)
    ctx = span.get_span_context()
    assert f'"trace_id": "{ctx.trace_id:032x}"' in line and f'"span_id": "{ctx.span_id:016x}"' in line


def test_once_a_processor_is_added_the_same_tracer_records() -> None:
    provider = tracing.LeanTracerProvider()
    tracer = provider.get_tracer("t")
    assert not tracer.start_span("before").is_recording()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with tracer.start_as_current_span("parent", attributes={"k": "v"}) as parent:
        assert parent.is_recording()
        tracer.start_span("child").end()
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert set(finished) == {"parent", "child"}
    assert finished["parent"].attributes == {"k": "v"}
    assert finished["child"].parent is not None
    assert finished["child"].parent.span_id == finished["parent"].context.span_id
    provider.shutdown()


def test_setup_installs_the_lean_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: list[object] = []
    monkeypatch.setattr(tracing, "_configured", False)
    monkeypatch.setattr(trace, "set_tracer_provider", installed.append)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    tracing.setup_tracing("gateway")
    assert len(installed) == 1 and isinstance(installed[0], tracing.LeanTracerProvider)
    assert not installed[0].exporting
    monkeypatch.setattr(tracing, "_configured", False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    tracing.setup_tracing("gateway")
    assert isinstance(installed[1], tracing.LeanTracerProvider) and installed[1].exporting
    for provider in installed:
        provider.shutdown()  # type: ignore[attr-defined]


def test_current_traceparent_is_the_header_the_propagator_writes() -> None:
    """Session frames carry ``current_traceparent()`` where they carried the trace-context
    propagator's header: equal for recorded and unrecorded spans, sampled or not, under a
    remote parent or as a root, and "" (no header) outside any span."""
    for provider in (tracing.LeanTracerProvider(), TracerProvider(),
                     tracing.LeanTracerProvider(sampler=ALWAYS_OFF)):
        tracer = provider.get_tracer("t")
        for parent in (_remote("00"), _remote("01"), None):
            with tracer.start_as_current_span("s", context=parent):  # type: ignore[arg-type]
                carrier: dict[str, str] = {}
                propagate.inject(carrier)
                assert tracing.current_traceparent() == carrier["traceparent"]
    empty: dict[str, str] = {}
    propagate.inject(empty)
    assert "traceparent" not in empty and tracing.current_traceparent() == ""

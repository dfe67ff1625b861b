"""Many requests over one stream, answered with one frame per message (no grpc).

A :class:`PostprocessMux` holds the requests of one ``Session`` call by the caller's
handles. Each message the caller sends (one engine step: opens, every request's new
tokens, ends, closes) is applied with :meth:`PostprocessMux.step`, which returns one
:class:`Frame` with the text, finals and errors of all of them, so the transport pays its
per-message cost once per step instead of once per token per request.

Each request runs the same :class:`~services.postprocessor.core.PostprocessSession` a
``Process`` stream runs (detokenizer, stop strings, filter, skip_chars), with the same
validation: a bad config, a bad token or an unknown handle is that request's error and
never touches the others. A request ends at its final or error (its handle is free
again) or when the caller closes it; tokens and ends that crossed its final on the wire
are ignored, as a ``Process`` stream ignores what comes after its final.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import propagate, trace
from prometheus_client import Counter

from services.common.errors import InvalidArgument, LlmeshError, map_exception
from services.common.metrics import record_request
from services.common.tracing import tracer
from services.postprocessor import metrics
from services.postprocessor.core import (
    FinalResult,
    PostprocessCore,
    PostprocessSession,
    SessionConfig,
    Step,
    UpstreamFinish,
)

log = logging.getLogger(__name__)

SLICE_TOKENS = 256
"""Tokens processed between two yields to the event loop (as the Process servicer does)."""

FINISHED_MEMORY = 16_384
"""How many recently finished handles are remembered, so that tokens and ends still on
their way when a request finished are ignored instead of reported as unknown."""


@dataclass(frozen=True)
class Open:
    """One request opened in a session."""

    handle: int
    config: SessionConfig | Exception
    """The request's configuration, or why it could not even be read."""
    trace_context: Mapping[str, str] = field(default_factory=dict)
    """W3C trace context (``traceparent``) of the caller's span for this request."""


@dataclass(frozen=True)
class SessionInput:
    """One message of the caller, applied in order: opens, tokens, ends, closes."""

    opens: Sequence[Open] = ()
    tokens: Sequence[tuple[int, Sequence[int]]] = ()
    """(handle, new token ids) in the order they came."""
    ends: Sequence[tuple[int, UpstreamFinish]] = ()
    closes: Sequence[int] = ()
    malformed: Sequence[tuple[int, Exception]] = ()
    """Handles named by token columns that do not line up, each with its error."""


@dataclass
class Frame:
    """What one message produced for the session's requests (column layout on the wire)."""

    texts: dict[int, list[str]] = field(default_factory=dict)
    """Released text per handle, in order; one entry per handle on the wire."""
    finals: list[tuple[int, FinalResult]] = field(default_factory=list)
    errors: list[tuple[int, Exception]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.texts or self.finals or self.errors)

    def text(self, handle: int, text: str) -> None:
        if text:
            self.texts.setdefault(handle, []).append(text)


@dataclass
class _Request:
    session: PostprocessSession
    span: trace.Span
    tokens: Counter
    """The model's token counter, looked up once (a labels() call per step cost this tier
    about 5 % of its CPU at 32 streams)."""
    started: float = field(default_factory=time.perf_counter)

    def record(self, code: str) -> None:
        """Count the request as the Process call it stands for (dashboards read rates)."""
        record_request("postprocessor", "Process", code, time.perf_counter() - self.started)


class PostprocessMux:
    """The open requests of one session, by handle."""

    def __init__(self, core: PostprocessCore) -> None:
        self.core = core
        self._requests: dict[int, _Request] = {}
        self._finished: dict[int, None] = {}  # insertion-ordered set, oldest first
        self._fed: dict[Counter, int] = {}
        """Tokens fed during the message being applied, per model's counter: counted once
        per message, not once per request (the counter takes a lock per increment)."""
        self.frames = 0

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    async def step(self, message: SessionInput) -> Frame:
        """Apply one message; return the one frame that answers it (possibly empty).

        A long replay is processed in slices with the event loop free in between, so
        other sessions on this process keep flowing; its text still goes in one frame.
        """
        frame = Frame()
        for handle, error in message.malformed:
            self._fail(frame, handle, error)
        for opening in message.opens:
            self._open(frame, opening)
        budget = SLICE_TOKENS
        fed = self._fed
        requests = self._requests
        try:
            for handle, ids in message.tokens:
                request = requests.get(handle)
                if request is not None and len(ids) < budget:
                    # The steady state: an open request's tokens of one step, in one go.
                    budget -= len(ids)
                    self._feed_open(frame, handle, request, ids)
                    continue
                offset = 0
                while True:
                    take = min(budget, len(ids) - offset)
                    self._feed(frame, handle, ids[offset:offset + take])
                    offset += take
                    budget -= take
                    if budget <= 0:
                        await asyncio.sleep(0)
                        budget = SLICE_TOKENS
                    if offset >= len(ids) or handle not in self._requests:
                        break
        finally:
            for counter, count in fed.items():
                counter.inc(count)
            fed.clear()
        for handle, reason in message.ends:
            self._end(frame, handle, reason)
        for handle in message.closes:
            self._close(frame, handle)
        if frame:
            self.frames += 1
        return frame

    def close(self) -> None:
        """The session ended: drop every request it still holds."""
        for handle in list(self._requests):
            self._drop(handle, "session ended")

    # -- internals -------------------------------------------------------------------
    def _open(self, frame: Frame, opening: Open) -> None:
        handle = opening.handle
        if handle in self._requests:
            # Not a new request: the running one gets the error (the caller broke its
            # own handle bookkeeping, and it cannot tell the two apart any more).
            self._fail(frame, handle, InvalidArgument("opens.handle", f"handle {handle} is already open"))
            return
        self._finished.pop(handle, None)
        parent = propagate.extract(dict(opening.trace_context)) if opening.trace_context else None
        span = tracer().start_span(
            "llmesh.postprocessor/Session.process", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"llmesh.handle": handle},
        )
        try:
            if isinstance(opening.config, Exception):
                raise opening.config
            session = self.core.open(opening.config)
        except Exception as exc:
            self._report(handle, exc)
            _end_span(span, exc)
            record_request("postprocessor", "Process", map_exception(exc).code.name, 0.0)
            frame.errors.append((handle, exc))
            self._remember(handle)
            return
        span.set_attribute("llmesh.model", session.model.name)
        metrics.REQUESTS.labels(session.model.name).inc()
        self._requests[handle] = _Request(session, span, tokens=metrics.TOKENS.labels(session.model.name))

    def _feed(self, frame: Frame, handle: int, ids: Sequence[int]) -> None:
        request = self._lookup(frame, handle, "handles")
        if request is not None:
            self._feed_open(frame, handle, request, ids)

    def _feed_open(self, frame: Frame, handle: int, request: _Request, ids: Sequence[int]) -> None:
        """Feed an open request: its text (or final) into the frame, a failure its error."""
        try:
            step = request.session.feed(ids)
        except Exception as exc:
            self._fail(frame, handle, exc)
            return
        fed = self._fed
        fed[request.tokens] = fed.get(request.tokens, 0) + len(ids)
        self._emit(frame, handle, request, step)

    def _end(self, frame: Frame, handle: int, reason: UpstreamFinish) -> None:
        self._apply(frame, handle, "ends.handle", lambda request: request.session.end(reason))

    def _apply(self, frame: Frame, handle: int, field_name: str,
               advance: Callable[[_Request], Step]) -> None:
        """Advance the request under ``handle``; an unknown handle or a failure is its error."""
        request = self._lookup(frame, handle, field_name)
        if request is None:
            return
        try:
            step = advance(request)
        except Exception as exc:
            self._fail(frame, handle, exc)
            return
        self._emit(frame, handle, request, step)

    def _close(self, frame: Frame, handle: int) -> None:
        # Closing what already ended (or was never opened) is not an error: the request
        # may have finished while the close was on its way.
        if handle in self._requests:
            frame.texts.pop(handle, None)  # the caller does not want it any more
            self._drop(handle, "closed by the caller")

    def _lookup(self, frame: Frame, handle: int, field_name: str) -> _Request | None:
        request = self._requests.get(handle)
        if request is None and handle not in self._finished:
            frame.errors.append((handle, InvalidArgument(field_name, f"handle {handle} is not open")))
            self._remember(handle)  # one error per unknown handle, not one per message
        return request

    def _emit(self, frame: Frame, handle: int, request: _Request, step: Step) -> None:
        frame.text(handle, step.text)
        final = step.final
        if final is None:
            return
        model = request.session.model.name
        metrics.FINISHES.labels(final.finish_reason.value).inc()
        if final.matched_stop:
            metrics.STOP_STRING_HITS.labels(model).inc()
        span = request.span
        span.set_attribute("llmesh.finish_reason", final.finish_reason.value)
        span.set_attribute("llmesh.completion_tokens", final.completion_tokens)
        span.set_attribute("llmesh.redactions", final.redactions)
        span.end()
        log.debug("request %d finished: %s after %d tokens, %d redactions", handle,
                  final.finish_reason.value, final.completion_tokens, final.redactions)
        frame.finals.append((handle, final))
        request.record("OK")
        del self._requests[handle]
        self._remember(handle)

    def _fail(self, frame: Frame, handle: int, error: Exception) -> None:
        request = self._requests.pop(handle, None)
        self._report(handle, error)
        if request is not None:
            _end_span(request.span, error)
            request.record(map_exception(error).code.name)
        frame.errors.append((handle, error))
        self._remember(handle)

    def _drop(self, handle: int, why: str) -> None:
        request = self._requests.pop(handle)
        request.record("CANCELLED")
        request.span.set_attribute("llmesh.dropped", why)
        request.span.end()
        self._remember(handle)

    def _remember(self, handle: int) -> None:
        self._finished[handle] = None
        if len(self._finished) > FINISHED_MEMORY:
            del self._finished[next(iter(self._finished))]

    @staticmethod
    def _report(handle: int, error: Exception) -> None:
        if not isinstance(error, LlmeshError):
            log.error("request %d failed in the postprocessor", handle, exc_info=error)


def _end_span(span: trace.Span, error: Exception) -> None:
    span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
    span.end()

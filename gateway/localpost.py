"""The postprocessor's work inside the gateway's process (``postprocessor_transport: local``).

Each request runs the very :class:`~services.postprocessor.core.PostprocessSession` a
postprocessor replica runs (detokenizer, stop strings, output filter, skip_chars), fed
from the router's frames as they arrive: its text reaches the request's pump in the same
callback, with no frame to encode, no other process to wake and no second wake-up of
the gateway per engine step. The price is the tier's independence: the detokenizer's CPU
is the gateway's, and the gateway loads the model's tokenizer a second time (the
tokenizer tier's is remote). See docs/benchmarks.md for what either layout costs.

A request's span, metrics and errors are the postprocessor tier's own (the same names,
from this process), so dashboards and traces read the same whichever layout runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from opentelemetry import trace

from gateway.tiers import tier_prefixed
from gateway.types import PostConfig, PostDelta, PostFinal
from services.common.errors import LlmeshError, map_exception
from services.common.metrics import record_request
from services.common.tracing import tracer
from services.postprocessor import metrics
from services.postprocessor.core import (
    PostprocessCore,
    PostprocessSession,
    SessionConfig,
    Step,
    UpstreamFinish,
)
from services.postprocessor.sensitive import FilterMode
from services.postprocessor.session import SLICE_TOKENS

log = logging.getLogger(__name__)

PostItem = PostDelta | PostFinal | BaseException

_UPSTREAM = {reason.value: reason for reason in UpstreamFinish}


class LocalPost:
    """One request's postprocessing in this process (the gateway's PostSession protocol).

    Everything runs in the caller's call: :meth:`send_tokens_nowait` feeds the tokens and
    hands the released text to the listener (:meth:`listen`) before it returns; the final
    and errors wait in :meth:`read`'s queue, as a replica's would."""

    def __init__(self, session: PostprocessSession, span: trace.Span) -> None:
        self.session = session
        self.span = span
        self.items: asyncio.Queue[PostItem] = asyncio.Queue()
        self.on_text: Callable[[str], None] | None = None
        self.finished = False
        """A final or an error came: nothing more is fed or released."""
        self.closed = False
        self.started = time.perf_counter()
        self.fed = 0
        """Tokens fed, counted into the tier's token counter once, when the request ends
        (the counter takes a lock per increment; the postprocessor tier counts once per
        message for the same reason)."""

    def send_tokens_nowait(self, token_ids: list[int]) -> bool:
        """Feed a step's tokens at once; never waits (the pump's fast path)."""
        if self.finished or self.closed:
            return True
        try:
            step = self.session.feed(token_ids)
        except Exception as exc:
            self._fail(exc)
            return True
        self.fed += len(token_ids)
        if step.text:
            self._release(step.text)
        if step.final is not None:
            self._finish(step)
        return True

    async def send_tokens(self, token_ids: list[int]) -> None:
        """Feed tokens, a long replay in slices with the event loop free in between (as a
        postprocessor replica does), so other requests keep flowing meanwhile."""
        for start in range(0, len(token_ids), SLICE_TOKENS):
            if start:
                await asyncio.sleep(0)
            self.send_tokens_nowait(token_ids[start:start + SLICE_TOKENS])

    async def send_end(self, finish_reason: str) -> None:
        if self.finished or self.closed:
            return
        try:
            step = self.session.end(_UPSTREAM.get(finish_reason, UpstreamFinish.ERROR))
        except Exception as exc:
            self._fail(exc)
            return
        if step.text:
            self._release(step.text)
        self._finish(step)

    def listen(self, on_text: Callable[[str], None]) -> None:
        """Hand released text to ``on_text`` as it is released; :meth:`read` then returns
        only the final or raises the error."""
        self.on_text = on_text

    async def read(self) -> PostDelta | PostFinal | None:
        item = await self.items.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self, graceful: bool = False) -> None:
        """Drop the request (a request that did not finish counts as cancelled)."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self._count_tokens()
            self._record("CANCELLED")
            self.span.set_attribute("llmesh.dropped", "closed by the caller")
            self.span.end()

    def _release(self, text: str) -> None:
        on_text = self.on_text
        if on_text is not None:
            on_text(text)
        else:
            self.items.put_nowait(PostDelta(text=text))

    def _finish(self, step: Step) -> None:
        """The step's final: the request ends, its final waits in :meth:`read`."""
        final = step.final
        assert final is not None
        self.finished = True
        self._count_tokens()
        metrics.FINISHES.labels(final.finish_reason.value).inc()
        if final.matched_stop:
            metrics.STOP_STRING_HITS.labels(self.session.model.name).inc()
        self.span.set_attribute("llmesh.finish_reason", final.finish_reason.value)
        self.span.set_attribute("llmesh.completion_tokens", final.completion_tokens)
        self.span.set_attribute("llmesh.redactions", final.redactions)
        self.span.end()
        self._record("OK")
        self.items.put_nowait(PostFinal(
            finish_reason=final.finish_reason.value, matched_stop=final.matched_stop,
            completion_tokens=final.completion_tokens, redactions=final.redactions,
        ))

    def _fail(self, error: Exception) -> None:
        """The request's own error (a token outside the vocabulary, a stream too long):
        it ends this request only."""
        self.finished = True
        self._count_tokens()
        if not isinstance(error, LlmeshError):
            log.error("postprocessing a request failed", exc_info=error)
        code = map_exception(error).code.name
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
        self.span.end()
        self._record(code)
        self.items.put_nowait(error)

    def _count_tokens(self) -> None:
        if self.fed:
            metrics.TOKENS.labels(self.session.model.name).inc(self.fed)
            self.fed = 0

    def _record(self, code: str) -> None:
        record_request("postprocessor", "Process", code, time.perf_counter() - self.started, "local")


class LocalPostprocessorTier:
    """The postprocessor tier as one in-process replica (the gateway's PostprocessorTier)."""

    def __init__(self, core: PostprocessCore) -> None:
        self.core = core

    @property
    def replicas(self) -> int:
        return 1

    async def open(self, replica: int, config: PostConfig, *, timeout: float | None) -> LocalPost:
        """Start a request's pipeline; a config the postprocessor refuses (an unknown model,
        too many stop strings) raises its error, naming the field."""
        span = tracer().start_span("llmesh.postprocessor/Session.process", kind=trace.SpanKind.INTERNAL)
        try:
            session = self.core.open(session_config(config))
        except Exception as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            span.end()
            record_request("postprocessor", "Process", map_exception(exc).code.name, 0.0, "local")
            if isinstance(exc, LlmeshError):
                raise tier_prefixed(exc, "postprocessor") from None
            raise
        span.set_attribute("llmesh.model", session.model.name)
        metrics.REQUESTS.labels(session.model.name).inc()
        return LocalPost(session, span)

    async def close(self) -> None:
        return None


def session_config(config: PostConfig) -> SessionConfig:
    """The gateway's postprocessor config as the postprocessor core takes it."""
    return SessionConfig(
        model=config.model,
        stop=tuple(config.stop),
        skip_special_tokens=config.skip_special_tokens,
        include_stop_str_in_output=config.include_stop_str_in_output,
        filter_mode=FilterMode(config.filter_mode),
        skip_chars=config.skip_chars,
    )

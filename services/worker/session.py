"""Many generations over one stream, answered with one frame per engine step (no grpc).

A :class:`WorkerSession` runs every submitted request on the :class:`WorkerCore` and
collects what they produce into one :class:`Frame`. The first output of a step schedules
the flush with ``call_soon``; everything the step's other requests produce before the
event loop gets to it lands in the same frame. An accelerator (and the step-based fake)
wakes all running requests of one step in the same loop iteration, so a frame carries
that step's tokens for every request, and the session's transport pays its per-message
cost once per step instead of once per token per request. That machinery is
:class:`services.common.framing.FramedSession`; this module says what a worker frame
holds and how one request runs on the engine.

Requests keep what they had as separate calls: validation with field violations (an
error of that request alone), a deadline after which the engine aborts it, abort by
handle (the request still ends with an ABORT final), a trace span under the caller's
trace context, and the engine-side abort of everything still running when the session
ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from opentelemetry import propagate, trace

from services.common import framing
from services.common.errors import LlmeshError
from services.common.tracing import tracer
from services.worker.core import Delta, Failed, Final, WorkerCore
from services.worker.engine import EngineRequest, TokenLogprob


def annotate_final(span: trace.Span, final: Final) -> None:
    """The engine's account of one request, on its worker span (Generate's server span,
    or the request's span in a session)."""
    if not span.is_recording():
        return
    span.set_attribute("llmesh.worker.finish_reason", final.finish_reason.value)
    span.set_attribute("llmesh.worker.prompt_tokens", final.prompt_tokens)
    span.set_attribute("llmesh.worker.completion_tokens", final.completion_tokens)
    span.set_attribute("llmesh.worker.cached_tokens", final.cached_tokens)
    span.set_attribute("llmesh.worker.queue_ms", final.queue_ms)
    span.set_attribute("llmesh.worker.ttft_ms", final.ttft_ms)


Submission = framing.Submission[EngineRequest | Failed]
"""One request submitted to a session: the request, or why it could not even be read
(unknown model)."""


@dataclass
class Frame:
    """What one step produced for a session's requests (column layout on the wire)."""

    tokens: list[tuple[int, list[int], list[TokenLogprob] | None]] = field(default_factory=list)
    """(handle, new token ids, their logprobs when asked) per request with new tokens."""
    finals: list[tuple[int, Final]] = field(default_factory=list)
    errors: list[tuple[int, Exception]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finals or self.errors)


class WorkerSession(framing.FramedSession[Frame]):
    """The requests of one session and the frame being filled for them."""

    deadline_message = "the request's deadline passed on the worker"
    failure_log = "request %s failed in the engine"
    request_metric = ("worker", "Generate")

    def __init__(self, core: WorkerCore) -> None:
        super().__init__()
        self.core = core

    def submit(self, submission: Submission) -> None:
        """Start one request; a refusal becomes that request's error in the next frame."""
        handle, request = submission.handle, submission.request
        if self._taken(handle):
            return
        if isinstance(request, Failed):
            self._refuse(handle, request.error)
            return
        try:
            self.core.validate(request)
        except LlmeshError as exc:
            self._refuse(handle, exc)
            return
        self._start(handle, request.request_id, lambda: self._generate(submission, request))

    def abort(self, handle: int) -> None:
        """Abort a running request; it ends with an ABORT final. Unknown handles are ignored
        (the request finished while the abort was on its way)."""
        request_id = self._request_ids.get(handle)
        state = self.core.mark_aborted(request_id) if request_id is not None else None
        if state is not None:
            # Marked now, not when the task runs: a submission under the same id in the
            # caller's next message then waits for this one instead of being refused.
            task = asyncio.ensure_future(self.core.abort_marked(state))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    # -- internals -------------------------------------------------------------------
    def _new_frame(self) -> Frame:
        return Frame()

    def _add_error(self, frame: Frame, handle: int, error: Exception) -> None:
        frame.errors.append((handle, error))


    async def _generate(self, submission: Submission, request: EngineRequest) -> None:
        handle = submission.handle
        parent = propagate.extract(dict(submission.trace_context)) if submission.trace_context else None
        with tracer().start_as_current_span(
            "llmesh.worker/Session.generate", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"llmesh.request_id": request.request_id},
        ) as span:
            # Closing core.generate (by the timeout) aborts the request in the engine.
            async with asyncio.timeout(submission.timeout_s):
                async with contextlib.aclosing(self.core.generate(request, validated=True)) as events:
                    async for event in events:
                        if isinstance(event, Delta):
                            self._frame.tokens.append((handle, event.token_ids, event.logprobs))
                        else:
                            annotate_final(span, event)
                            self._frame.finals.append((handle, event))
                        self._schedule()

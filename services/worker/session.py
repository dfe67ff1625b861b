"""Many generations over one stream, answered with one frame per engine step (no grpc).

A :class:`WorkerSession` runs every submitted request as an
:class:`services.worker.core.EngineRun` whose consumer writes straight into the
session's :class:`Frame`: the engine calls its sinks from its step loop, every request
that advanced in one step within the same event-loop callback, so that step's tokens for
every request land in one frame with no task or generator per request. The first output
of a step schedules the flush with ``call_soon``. The session's transport pays its
per-message cost once per step instead of once per token per request. That machinery is
:class:`services.common.framing.FramedSession` (its task-less requests); this module says
what a worker frame holds and how one request runs on the engine.

Submissions are handed to the engine by one task per session that drains them in order
(a message of many submissions is one wakeup), not a task per request; a submission whose
id an aborted request still holds waits for it in a task of its own, so the others do
not wait behind it.

Requests keep what they had as separate calls: validation with field violations (an
error of that request alone), a deadline (a timer per request) after which the engine
aborts it and it ends with DEADLINE_EXCEEDED, abort by handle (the request still ends
with an ABORT final), a trace span under the caller's trace context (started at submit,
ended at the final), and the engine-side abort of everything still running when the
session ends.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from services.common import framing
from services.common.errors import DeadlineExceeded, LlmeshError, map_exception
from services.common.tracing import tracer
from services.worker.core import Delta, EngineRun, Failed, Final, WorkerCore
from services.worker.engine import EngineRequest

log = logging.getLogger(__name__)

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
    """What the session's requests produced since the previous frame was taken: one engine
    step, or several when the previous frame's write outlasted a step (column layout on the
    wire)."""

    tokens: dict[int, framing.FrameTokens] = field(default_factory=dict)
    """Handle -> new tokens (and their logprobs when asked), in the order the handles first
    produced some. One entry per request even when the frame covers several steps (taken
    only after the previous frame's write, which may outlast a step): the wire carries a
    request's logprobs by handle, so a handle named once per step would pair every token
    of the frame with one step's logprobs."""
    finals: list[tuple[int, Final]] = field(default_factory=list)
    errors: list[tuple[int, Exception]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finals or self.errors)


class SessionRequest:
    """One request of a session: its engine run's consumer, writing into the session's
    frame; its deadline timer and its trace span."""

    __slots__ = ("handle", "run", "session", "span", "timer")

    def __init__(self, session: WorkerSession, submission: Submission, request: EngineRequest) -> None:
        self.session = session
        self.handle = submission.handle
        parent = propagate.extract(dict(submission.trace_context)) if submission.trace_context else None
        self.span = tracer().start_span(
            "llmesh.worker/Session.generate", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"llmesh.request_id": request.request_id},
        )
        self.run = EngineRun(session.core, request, self)
        self.timer: asyncio.TimerHandle | None = None
        if submission.timeout_s is not None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_at(loop.time() + submission.timeout_s, self._deadline_passed)

    def __call__(self, event: Delta | Final | Exception) -> None:
        """The run's consumer (called from the engine's step callback)."""
        session = self.session
        if isinstance(event, Delta):
            framing.tokens_of(session._frame.tokens, self.handle).add(event.token_ids, event.logprobs)
            session._schedule()
        elif isinstance(event, Final):
            annotate_final(self.span, event)
            session._frame.finals.append((self.handle, event))
            session._schedule()
            self._end("OK")
        else:
            self._error(event)
            session._fail(self.handle, event)
            self._end(map_exception(event).code.name)

    def step_tokens(self, token_ids: list[int]) -> None:
        """The run's plain token ids of one step (see :meth:`EngineRun.step_tokens`): into the
        session's frame like a :class:`Delta` without logprobs."""
        session = self.session
        framing.tokens_of(session._frame.tokens, self.handle).token_ids.extend(token_ids)
        session._schedule()

    def _deadline_passed(self) -> None:
        self.timer = None
        if self.run.done:
            return
        # Nothing more is sent for it; the engine aborts it (and its id is freed) after.
        self.run.detach()
        self.session._background(self.run.cancel())
        error = DeadlineExceeded(self.session.deadline_message)
        self._error(error)
        self.session._fail(self.handle, error)
        self._end("DEADLINE_EXCEEDED")

    def close(self) -> Coroutine[Any, Any, None]:
        """The session ends: nothing more is sent; the returned coroutine aborts the
        request in the engine."""
        self.run.detach()
        self.span.set_status(Status(StatusCode.ERROR, "cancelled: the session ended"))
        self._end("CANCELLED")
        return self.run.cancel()

    def _error(self, error: Exception) -> None:
        if self.span.is_recording():
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))

    def _end(self, code: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.span.end()
        session = self.session
        if session._requests.get(self.handle) is self:
            del session._requests[self.handle]
            session._ended(self.handle, code)


class WorkerSession(framing.FramedSession[Frame]):
    """The requests of one session and the frame being filled for them."""

    deadline_message = "the request's deadline passed on the worker"
    request_metric = ("worker", "Generate")

    def __init__(self, core: WorkerCore) -> None:
        super().__init__()
        self.core = core
        self._requests: dict[int, SessionRequest] = {}
        self._to_start: collections.deque[SessionRequest] = collections.deque()
        self._starter: asyncio.Task[None] | None = None
        self._tasks_aside: set[asyncio.Task[None]] = set()
        """Starts waiting for an aborted id, aborts and deadline aborts under way."""

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
        self._open(handle, request.request_id)
        entry = self._requests[handle] = SessionRequest(self, submission, request)
        self._to_start.append(entry)
        if self._starter is None:
            self._starter = asyncio.ensure_future(self._start_submitted())

    def abort(self, handle: int) -> None:
        """Abort a running request; it ends with an ABORT final. Unknown handles are ignored
        (the request finished while the abort was on its way)."""
        entry = self._requests.get(handle)
        if entry is None:
            return
        run = entry.run
        # Marked now, not when the engine gets the abort: a submission under the same id in
        # the caller's next message then waits for this one instead of being refused (and
        # one not yet handed to the engine ends ABORT without reaching it).
        run.aborted = True
        if run.in_engine:
            self._background(self.core.abort_marked(run))

    async def close(self) -> None:
        """Stop every request still running: nothing more is sent for them, and each is
        aborted in the engine (waited for)."""
        aborts = [entry.close() for entry in list(self._requests.values())]
        self._to_start.clear()
        pending = [*self._tasks_aside, *([self._starter] if self._starter is not None else [])]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, *aborts, return_exceptions=True)
        await super().close()

    # -- internals -------------------------------------------------------------------
    def _new_frame(self) -> Frame:
        return Frame()

    def _add_error(self, frame: Frame, handle: int, error: Exception) -> None:
        frame.errors.append((handle, error))

    async def _start_submitted(self) -> None:
        """Hand the submitted requests to the engine in order, in this one task."""
        try:
            while self._to_start:
                run = self._to_start.popleft().run
                if run.done:
                    continue  # its deadline passed, or the session is closing
                if self.core.id_in_flight(run.request_id):
                    # An aborted request still holds its id: wait for it aside.
                    self._background(run.start())
                else:
                    await run.start()
        finally:
            self._starter = None

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks_aside.add(task)
        task.add_done_callback(self._aside_done)

    def _aside_done(self, task: asyncio.Task[None]) -> None:
        self._tasks_aside.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("abort in the engine failed: %s", exc)

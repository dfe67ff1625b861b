"""Many generations over one stream, answered with one frame per event-loop tick (no grpc).

A :class:`RouterSession` runs every submitted request through :meth:`Router.generate`
in a task of its own and collects what they produce into one :class:`Frame`. The first
event after a flush schedules the next flush with ``call_soon``; every event the other
requests produce before the event loop gets to it lands in the same frame. The worker
link wakes all requests of one engine step in the same loop iteration (one worker frame,
or one message per request read back to back), so a step's tokens for many requests
cross the router -> gateway hop as one message instead of one message per request.
Tokens reach the frame from the worker link's reader directly (``on_delta`` of
:meth:`Router.generate`): a request's task wakes for the end of an attempt, not per
token. The frame machinery is :class:`services.common.framing.FramedSession`; this
module says what a router frame holds and how one request runs.

Requests keep what they had as separate Generate calls: validation with field
violations (an error of that request alone), a deadline after which the request ends
with DEADLINE_EXCEEDED and its worker request is aborted, abort by handle (cancelling the
request's task aborts its worker request), retry and resume across workers, a trace span
under the caller's trace context, and the abort of everything still running when the
session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from opentelemetry import propagate, trace

from services.common import framing
from services.common.errors import LlmeshError
from services.common.generation import Delta, RouterFinal
from services.common.tracing import tracer
from services.router.core import Router, RouteRequest

Submission = framing.Submission[RouteRequest | LlmeshError]
"""One request submitted to a session: the request, or why it could not even be read
(a missing field)."""


FrameTokens = framing.FrameTokens
"""New tokens of one request in a frame (its deltas since the previous frame, merged)."""


@dataclass
class Frame:
    """What one event-loop tick produced for a session's requests (column layout on the wire)."""

    tokens: dict[int, FrameTokens] = field(default_factory=dict)
    """Handle -> new tokens, in the order the handles first produced some."""
    finals: list[tuple[int, RouterFinal]] = field(default_factory=list)
    errors: list[tuple[int, Exception]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finals or self.errors)

    @property
    def token_count(self) -> int:
        return sum(len(t.token_ids) for t in self.tokens.values())


class RouterSession(framing.FramedSession[Frame]):
    """The requests of one session and the frame being filled for them."""

    deadline_message = "the request's deadline passed on the router"
    request_metric = ("router", "Generate")

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    def submit(self, submission: Submission) -> None:
        """Start one request; a refusal becomes that request's error in the next frame."""
        handle, request = submission.handle, submission.request
        if self._taken(handle):
            return
        if isinstance(request, LlmeshError):
            self._refuse(handle, request)
            return
        self._start(handle, request.request.request_id, lambda: self._generate(submission, request))

    def abort(self, handle: int) -> None:
        """Cancel a running request (its worker request is aborted); nothing more is sent
        for it. Unknown handles are ignored (the request ended while the abort was on its way)."""
        self._cancel(handle)

    # -- internals -------------------------------------------------------------------
    def _new_frame(self) -> Frame:
        return Frame()

    def _add_error(self, frame: Frame, handle: int, error: Exception) -> None:
        frame.errors.append((handle, error))

    def _add(self, handle: int, event: Delta | RouterFinal) -> None:
        if isinstance(event, Delta):
            framing.tokens_of(self._frame.tokens, handle).add(event.token_ids, event.logprobs)
        else:
            self._frame.finals.append((handle, event))
        self._schedule()

    async def _generate(self, submission: Submission, route: RouteRequest) -> None:
        handle = submission.handle
        # Without a traceparent the request starts its own trace (a root span), rather than
        # hanging under the server span of a session that lives as long as its caller.
        parent = propagate.extract(dict(submission.trace_context))
        # The span is current while the core runs: it annotates it with the routing
        # decision as it does the server span of a Generate call.
        with tracer().start_as_current_span(
            "llmesh.router/Session.generate", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"llmesh.request_id": route.request.request_id},
        ):
            # Closing core.generate (by the timeout, or cancelled by an abort) aborts the
            # worker request.
            async with asyncio.timeout(submission.timeout_s) as deadline:
                task = asyncio.current_task()

                def deliver(delta: Delta) -> None:
                    # Tokens go into the frame from the worker link's reader, without
                    # waking this task. Between an abort or a passed deadline and this
                    # task closing the generation, nothing more is sent for the handle
                    # (it may already run another request).
                    if self._tasks.get(handle) is task and not deadline.expired():
                        self._add(handle, delta)

                def deliver_tokens(token_ids: list[int]) -> None:
                    # deliver() for plain token ids (the steady state), the same rules.
                    if self._tasks.get(handle) is task and not deadline.expired():
                        framing.tokens_of(self._frame.tokens, handle).token_ids.extend(token_ids)
                        self._schedule()

                generation = self.router.generate(route, submission.timeout_s, deliver, deliver_tokens)
                async with contextlib.aclosing(generation) as events:
                    async for event in events:
                        self._add(handle, event)

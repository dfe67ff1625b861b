"""Many generations over one stream, answered with one frame per event-loop tick (no grpc).

A :class:`RouterSession` runs every submitted request through :meth:`Router.generate`
in a task of its own and collects what they produce into one :class:`Frame`. The first
event after a flush schedules the next flush with ``call_soon``; every event the other
requests produce before the event loop gets to it lands in the same frame. The worker
link wakes all requests of one engine step in the same loop iteration (one worker frame,
or one message per request read back to back), so a step's tokens for many requests
cross the router -> gateway hop as one message instead of one message per request.

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
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import cast

from opentelemetry import propagate, trace

from llmesh.common.v1 import common_pb2
from services.common.errors import DeadlineExceeded, InvalidArgument, LlmeshError
from services.common.tracing import tracer
from services.router.core import Delta, Final, Router, RouteRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    """One request submitted to a session."""

    handle: int
    request: RouteRequest | LlmeshError
    """The request, or why it could not even be read (a missing field)."""
    timeout_s: float | None = None
    trace_context: Mapping[str, str] = field(default_factory=dict)
    """W3C trace context (``traceparent``) of the caller's span for this request."""


@dataclass
class FrameTokens:
    """New tokens of one request in a frame (several deltas of one tick are merged)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


@dataclass
class Frame:
    """What one event-loop tick produced for a session's requests (column layout on the wire)."""

    tokens: dict[int, FrameTokens] = field(default_factory=dict)
    """Handle -> new tokens, in the order the handles first produced some."""
    finals: list[tuple[int, Final]] = field(default_factory=list)
    errors: list[tuple[int, Exception]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finals or self.errors)

    @property
    def token_count(self) -> int:
        return sum(len(t.token_ids) for t in self.tokens.values())


class RouterSession:
    """The requests of one session and the frame being filled for them."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._frame = Frame()
        self._ready = asyncio.Event()
        self._flush_scheduled = False
        self._input_done = False
        self.frames_sent = 0

    @property
    def running(self) -> int:
        return len(self._tasks)

    def submit(self, submission: Submission) -> None:
        """Start one request; a refusal becomes that request's error in the next frame."""
        handle, request = submission.handle, submission.request
        if handle in self._tasks:
            self._fail(handle, InvalidArgument("submit.handle", f"handle {handle} is already running"))
            return
        if isinstance(request, LlmeshError):
            self._fail(handle, request)
            return
        self._tasks[handle] = asyncio.ensure_future(self._run(submission, request))

    def abort(self, handle: int) -> None:
        """Cancel a running request (its worker request is aborted); nothing more is sent
        for it. Unknown handles are ignored (the request ended while the abort was on its way)."""
        task = self._tasks.get(handle)
        if task is not None:
            task.cancel()

    def input_done(self) -> None:
        """The caller sends no more submissions: frames end once the running ones finish."""
        self._input_done = True
        self._schedule()

    async def frames(self) -> AsyncIterator[Frame]:
        """Frames as requests produce events, until input is done and nothing runs."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            self._flush_scheduled = False
            frame, self._frame = self._frame, Frame()
            if frame:
                self.frames_sent += 1
                yield frame
            if self._input_done and not self._tasks and not self._frame:
                return

    async def close(self) -> None:
        """Cancel every running request (each aborts its worker request) and wait for them."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- internals -------------------------------------------------------------------
    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._ready.set)

    def _fail(self, handle: int, error: Exception) -> None:
        self._frame.errors.append((handle, error))
        self._schedule()

    def _add(self, handle: int, event: Delta | Final) -> None:
        if isinstance(event, Delta):
            tokens = self._frame.tokens.get(handle)
            if tokens is None:
                tokens = self._frame.tokens[handle] = FrameTokens()
            tokens.token_ids.extend(event.delta.token_ids)
            tokens.logprobs.extend(event.delta.logprobs)
        else:
            self._frame.finals.append((handle, event))
        self._schedule()

    async def _run(self, submission: Submission, route: RouteRequest) -> None:
        handle = submission.handle
        # Without a traceparent the request starts its own trace (a root span), rather than
        # hanging under the server span of a session that lives as long as its caller.
        parent = propagate.extract(dict(submission.trace_context))
        try:
            # The span is current while the core runs: it annotates it with the routing
            # decision as it does the server span of a Generate call.
            with tracer().start_as_current_span(
                "llmesh.router/Session.generate", context=parent, kind=trace.SpanKind.SERVER,
                attributes={"llmesh.request_id": route.request.request_id},
            ):
                async with asyncio.timeout(submission.timeout_s):
                    # Router.generate is an async generator (typed as an iterator).
                    generation = cast(AsyncGenerator[Delta | Final, None],
                                      self.router.generate(route, submission.timeout_s))
                    async with contextlib.aclosing(generation) as events:
                        async for event in events:
                            self._add(handle, event)
        except TimeoutError:
            # Closing core.generate (by the timeout) aborted the worker request.
            self._fail(handle, DeadlineExceeded("the request's deadline passed on the router"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, LlmeshError):
                log.exception("session request %s failed", route.request.request_id)
            self._fail(handle, exc)
        finally:
            self._tasks.pop(handle, None)
            if self._input_done:
                self._schedule()

"""The server side of a multiplexed Session: requests by handle, one frame per tick (no grpc).

A Session call carries many requests under handles its caller chose, and what the
requests produce is collected into one frame. The first event after a flush schedules
the next flush with ``call_soon``; every event the other requests produce before the
event loop gets to it lands in the same frame. An engine step (or a worker frame on the
router) wakes all its requests in the same loop iteration, so a step's output for many
requests crosses the hop as one message.

A request runs either in a task of its own (:meth:`FramedSession._start`: the router's
requests; such a task wakes once per attempt, its tokens
reach the frame from the worker link's reader) or without one (:meth:`FramedSession._open` ...
:meth:`FramedSession._ended`: the worker's, fed by engine callbacks, so one engine step
fills one frame with no task wakeup per request).

:class:`FramedSession` owns that machinery: the handles, the frame being filled, the
per-tick flush, the end of input, the frames iterator, and what every request shares
around its work (a passed deadline, a failure, the handle freed when it ends, the RPC
metrics). What a frame holds, how a request runs and how it is aborted belong to each
tier's session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from services.common.errors import DeadlineExceeded, InvalidArgument, LlmeshError, map_exception
from services.common.generation import TokenLogprob
from services.common.metrics import record_request

FrameT = TypeVar("FrameT")
MessageT = TypeVar("MessageT")
RequestT = TypeVar("RequestT")


@dataclass(frozen=True)
class Submission(Generic[RequestT]):
    """One request submitted to a session."""

    handle: int
    request: RequestT
    """The request, or why it could not even be read."""
    timeout_s: float | None = None
    trace_context: Mapping[str, str] = field(default_factory=dict)
    """W3C trace context (``traceparent``) of the caller's span for this request."""


@dataclass
class FrameTokens:
    """New tokens of one request in a frame: every delta it produced since the previous
    frame was taken, merged. A frame is taken when its sender gets to it, so it may cover
    several engine steps (or worker frames); merged, a frame names each request once, and
    its logprobs (sent per request, by handle) stay in line with its token ids."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        self.token_ids.extend(token_ids)
        if logprobs:
            self.logprobs.extend(logprobs)


def tokens_of(frame_tokens: dict[int, FrameTokens], handle: int) -> FrameTokens:
    """The entry of ``handle`` in a frame's tokens, made when the frame has none yet."""
    tokens = frame_tokens.get(handle)
    if tokens is None:
        tokens = frame_tokens[handle] = FrameTokens()
    return tokens


class FramedSession(ABC, Generic[FrameT]):
    """The requests of one session and the frame being filled for them."""

    deadline_message: ClassVar[str] = "the request's deadline passed"
    """The DeadlineExceeded message of a request whose ``asyncio.timeout`` passed."""
    failure_log: ClassVar[str] = "session request %s failed"
    """Logged (with the request id) for a request that failed with an unexpected error."""
    request_metric: ClassVar[tuple[str, str] | None] = None
    """(tier, method): each request is counted in the RPC metrics as that per-request RPC
    (see :func:`services.common.metrics.record_request`); None records nothing."""

    def __init__(self) -> None:
        self._tasks: dict[int, asyncio.Task[str]] = {}
        self._taskless: dict[int, float] = {}
        """Handles of requests running without a task (see :meth:`_open`) -> start time."""
        self._cancelling: set[asyncio.Task[str]] = set()
        """Tasks cancelled by :meth:`_cancel`, no longer under a handle, until they end."""
        self._request_ids: dict[int, str] = {}
        self._frame = self._new_frame()
        self._ready = asyncio.Event()
        self._flush_scheduled = False
        self.direct: Callable[[FrameT], bool] | None = None
        """Writes a frame to the caller at once and says whether it could (a framed
        listener's :class:`~services.common.sessionwire.FramedContext`): set by the
        servicer, frames then go out from the flush callback, without waking the task
        that iterates :meth:`frames`. A frame it cannot take (the connection is backed
        up), or that fails, goes through :meth:`frames`, and so do the ones after it
        until :meth:`frames` has yielded it: the order holds."""
        self._held: list[FrameT] = []
        """Frames that go through :meth:`frames` (see :attr:`direct`)."""
        self._yielding = False
        self._input_done = False
        self.frames_sent = 0

    # -- what each tier defines ------------------------------------------------------
    @abstractmethod
    def _new_frame(self) -> FrameT:
        """An empty frame."""

    @abstractmethod
    def _add_error(self, frame: FrameT, handle: int, error: Exception) -> None:
        """Put ``error`` in ``frame`` as the request's end."""

    def _has_content(self, frame: FrameT) -> bool:
        """Whether ``frame`` is worth sending."""
        return bool(frame)

    # -- the session -----------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._tasks) + len(self._taskless)

    def input_done(self) -> None:
        """The caller sends no more submissions: frames end once the running ones finish."""
        self._input_done = True
        self._schedule()

    async def frames(self) -> AsyncIterator[FrameT]:
        """Frames as requests produce events, until input is done and nothing runs
        (with :attr:`direct` set, only those it could not write)."""
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                self._flush_scheduled = False
                self._yielding = True
                try:
                    while self._held:
                        self.frames_sent += 1
                        yield self._held.pop(0)
                    frame, self._frame = self._frame, self._new_frame()
                    if self._has_content(frame):
                        self.frames_sent += 1
                        yield frame
                finally:
                    self._yielding = False
                if self._input_done and not self.running and not self._has_content(self._frame):
                    return
        finally:
            self.direct = None

    @contextlib.asynccontextmanager
    async def reading(
        self, messages: AsyncIterator[MessageT], receive: Callable[[MessageT], None]
    ) -> AsyncIterator[None]:
        """Apply the caller's messages with ``receive`` while the body sends :meth:`frames`;
        on leaving (the caller went away, or every request ended) stop reading and
        :meth:`close` what still runs."""

        async def read() -> None:
            async for message in messages:
                receive(message)
            self.input_done()

        reader = asyncio.ensure_future(read())
        reader.add_done_callback(lambda _t: self.input_done())
        try:
            yield
        finally:
            reader.cancel()
            await self.close()

    async def close(self) -> None:
        """Cancel every running request and wait for them (and for those already cancelled).
        A tier with task-less requests stops those in its own ``close`` first."""
        tasks = [*self._tasks.values(), *self._cancelling]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- for the tiers' sessions -----------------------------------------------------
    def _taken(self, handle: int) -> bool:
        """Whether ``handle`` still runs a request; if so, the new submission under it
        fails (that error goes to the handle, in the next frame)."""
        if handle in self._tasks or handle in self._taskless:
            self._refuse(handle, InvalidArgument("submit.handle", f"handle {handle} is already running"))
            return True
        return False

    def _start(self, handle: int, request_id: str, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work()`` as the request under ``handle``: its passed deadline
        (``TimeoutError``) or failure becomes the handle's error, and the handle is free
        once it ends."""
        self._request_ids[handle] = request_id
        task = asyncio.ensure_future(self._run(handle, request_id, work))
        self._tasks[handle] = task
        start = time.perf_counter()
        task.add_done_callback(lambda done: self._release(handle, done, start))

    def _open(self, handle: int, request_id: str) -> None:
        """Take ``handle`` for a request that runs without a task of its own: the tier
        fills the frame from its callbacks and calls :meth:`_ended` when it ends."""
        self._request_ids[handle] = request_id
        self._taskless[handle] = time.perf_counter()

    def _ended(self, handle: int, code: str) -> None:
        """The task-less request under ``handle`` ended with status ``code`` (its final or
        error is in the frame, or the session is closing): counted, and the handle free."""
        start = self._taskless.pop(handle, None)
        if start is None:
            return
        self._request_ids.pop(handle, None)
        if self.request_metric is not None:
            record_request(*self.request_metric, code, time.perf_counter() - start)
        if self._input_done:
            self._schedule()

    def _cancel(self, handle: int) -> None:
        """Cancel the request under ``handle`` and free the handle at once: nothing more
        is sent for it, so its caller may submit under it again in its next message,
        before the cancelled task has run. Unknown handles are ignored (the request
        ended while the abort was on its way)."""
        task = self._tasks.pop(handle, None)
        if task is not None:
            self._request_ids.pop(handle, None)
            self._cancelling.add(task)
            task.cancel()

    def _release(self, handle: int, task: asyncio.Task[str], start: float) -> None:
        """Count the request and free ``handle`` once its task is done, also when it was
        cancelled before it ever ran (an abort in the message that submitted it)."""
        self._cancelling.discard(task)
        if self.request_metric is not None:
            code = "CANCELLED" if task.cancelled() else task.result()
            record_request(*self.request_metric, code, time.perf_counter() - start)
        if self._tasks.get(handle) is task:
            del self._tasks[handle]
            self._request_ids.pop(handle, None)
        if self._input_done:
            self._schedule()

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """The frame filled in this loop turn goes out: written by :attr:`direct` when it
        can be, else (and at the end of input) by waking :meth:`frames`."""
        direct = self.direct
        if direct is None or self._held or self._yielding:
            self._ready.set()
            return
        self._flush_scheduled = False
        frame = self._frame
        if self._has_content(frame):
            self._frame = self._new_frame()
            try:
                written = direct(frame)
            except Exception:
                # Through frames(), where the servicer's own conversion raises it again.
                written = False
            if not written:
                self._held.append(frame)
                self._ready.set()
                return
            self.frames_sent += 1
        if self._input_done and not self.running:
            self._ready.set()

    def _refuse(self, handle: int, error: Exception) -> None:
        """A submission refused before it started: counted, and its error sent."""
        if self.request_metric is not None:
            record_request(*self.request_metric, map_exception(error).code.name, 0.0)
        self._fail(handle, error)

    def _fail(self, handle: int, error: Exception) -> None:
        self._add_error(self._frame, handle, error)
        self._schedule()

    async def _run(self, handle: int, request_id: str, work: Callable[[], Awaitable[None]]) -> str:
        """Run one request; returns its status code name for the metrics."""
        try:
            await work()
        except TimeoutError:
            # The timeout closed the request's generation, which aborts it downstream.
            self._fail(handle, DeadlineExceeded(self.deadline_message))
            return "DEADLINE_EXCEEDED"
        except Exception as exc:
            if not isinstance(exc, LlmeshError):
                logging.getLogger(type(self).__module__).exception(self.failure_log, request_id)
            self._fail(handle, exc)
            return map_exception(exc).code.name
        return "OK"

"""Dynamic batching windows per worker, and demultiplexing of batch streams.

Requests for one worker that arrive within a window are sent in one GenerateBatch
call. The window adapts to the worker's pressure (load / capacity, smoothed): an idle
worker gets every request immediately; as pressure rises the window grows toward
``max_wait_ms`` and ``max_size`` (larger batches at peak, when the engine is queueing
anyway and one call per batch saves per-request overhead); it shrinks as load drops.
A window only opens behind a dispatch: a request that finds nothing sent to its worker
for a whole window goes at the end of the loop iteration it arrived in, with whatever
arrived in the same iteration, never waiting for company that is not coming.

With ``session`` (router setting ``worker_transport: session``) there is one long-lived
Session per worker instead of calls: a window's requests go out as one message of
submissions, and the worker answers with one frame per engine step for all of them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field

from services.common.generation import Delta, Final, TokenRequest
from services.common.logs import request_id_var
from services.common.retry import SESSION_RETRY_S
from services.common.tracing import current_traceparent
from services.router.registry import Load
from services.router.workerapi import (
    SessionEvent,
    SessionSubmit,
    StreamEvent,
    WorkerCallError,
    WorkerClient,
    WorkerSessionLink,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowPlan:
    wait_ms: float
    max_size: int


class AdaptiveWindow:
    """Window length and batch size from smoothed worker pressure."""

    def __init__(
        self, max_wait_ms: float, max_size: int, *, alpha: float = 0.3, idle: float = 0.25
    ) -> None:
        self.max_wait_ms = max(0.0, max_wait_ms)
        self.max_size = max(1, max_size)
        self.alpha = alpha
        self.idle = idle
        self.level = 0.0
        """Smoothed pressure, 0..1."""

    @property
    def enabled(self) -> bool:
        return self.max_wait_ms > 0 and self.max_size > 1

    def observe(self, pressure: float) -> None:
        """Fold one pressure sample (load / capacity) into the smoothed level."""
        sample = min(1.0, max(0.0, pressure))
        self.level += self.alpha * (sample - self.level)

    def plan(self) -> WindowPlan:
        """The window for the next request: no wait while the worker is idle."""
        if not self.enabled or self.level < self.idle:
            return WindowPlan(0.0, 1)
        fraction = (self.level - self.idle) / (1.0 - self.idle)
        wait = self.max_wait_ms * fraction
        size = 2 + round((self.max_size - 2) * fraction)
        return WindowPlan(wait, max(2, min(self.max_size, size)))


_END = object()



@dataclass(eq=False)
class AttemptStream:
    """The events of one request sent to one worker (one attempt)."""

    request_id: str
    dispatcher: BatchDispatcher
    queue: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    enqueued_at: float = field(default_factory=time.perf_counter)
    window_wait_ms: float = 0.0
    batch_size: int = 0
    sent: bool = False
    single_task: asyncio.Task[None] | None = None
    handle: int | None = None
    """Its handle in the worker session (``worker_transport: session``)."""
    traceparent: str = ""
    """The submitting request's trace context, captured where it was submitted."""
    submitted: tuple[TokenRequest, float | None] | None = None
    """(request, deadline) while it waits for its first event on a worker session: a
    worker without Session (an older release) takes it again over a call."""
    done: bool = False
    cancelled: bool = False
    started: asyncio.Event = field(default_factory=asyncio.Event)
    on_delta: Callable[[Delta], None] | None = None
    """Set by the consumer for the steady state: deltas go straight to it from the
    worker link's reader, with no queue, no task wake-up and no generator per token;
    the queue then carries only the end (final, error, end of stream)."""
    on_tokens: Callable[[list[int]], None] | None = None
    """Set with ``on_delta``: where a worker session's plain token ids (a delta without
    logprobs, see :data:`~services.router.workerapi.SessionEvent`) go, with no
    :class:`Delta` built; without it they go to ``on_delta`` as one."""

    def push(self, item: object) -> None:
        if not self.done and not self.cancelled:
            if self.on_delta is not None and type(item) is Delta:
                try:
                    self.on_delta(item)
                except Exception as exc:
                    # A bug in the consumer fails this request (its events() raises it),
                    # not the worker link's reader that every request shares.
                    item = exc
                else:
                    return
            self.queue.put_nowait(item)
            if isinstance(item, Final) or item is _END or isinstance(
                item, BaseException
            ):
                self.done = True

    def push_tokens(self, token_ids: list[int]) -> None:
        """A worker session's plain token ids of this request (see :meth:`push`)."""
        if self.done or self.cancelled:
            return
        on_tokens = self.on_tokens
        if on_tokens is None:
            self.push(Delta(token_ids))
            return
        try:
            on_tokens(token_ids)
        except Exception as exc:
            # As in push: a bug in the consumer fails this request, not the reader.
            self.queue.put_nowait(exc)
            self.done = True

    async def events(self) -> AsyncGenerator[StreamEvent, None]:
        """Deltas then one final; raises WorkerCallError if the worker call failed."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                raise WorkerCallError("transport", "UNAVAILABLE", "worker stream ended without a final")
            assert isinstance(item, Delta | Final)
            yield item
            if isinstance(item, Final):
                return

    async def cancel(self) -> None:
        """Stop this request only: drop it from the window, or abort it on the worker."""
        if self.cancelled:
            return
        finished = self.done
        self.cancelled = True
        await self.dispatcher.cancel(self, finished)


BatchObserver = Callable[[int, float], None]
"""Called with (batch size, window wait ms of the oldest request) for every dispatch."""


class BatchDispatcher:
    """Collects requests for one worker into windows and runs the worker calls."""

    def __init__(
        self,
        client: WorkerClient,
        window: AdaptiveWindow,
        pressure: Callable[[], float],
        observer: BatchObserver | None = None,
        *,
        session: bool = False,
    ) -> None:
        self.client = client
        self.session = session
        """Send over one long-lived worker Session (frames per step) instead of calls."""
        self._wants_session = session
        self._session_retry_at = 0.0
        """When a worker that answered Session with UNIMPLEMENTED is asked again."""
        self._link: WorkerSessionLink | None = None
        self._reader: asyncio.Task[None] | None = None
        self._by_handle: dict[int, AttemptStream] = {}
        self._handles = itertools.count(1)
        self.window = window
        self._pressure = pressure
        self._observer = observer
        self._pending: list[tuple[AttemptStream, TokenRequest, float | None]] = []
        self._timer: asyncio.TimerHandle | asyncio.Handle | None = None
        self._last_flush = float("-inf")
        """Loop time of the last dispatch: a window opens only for requests that follow one
        within a window (see :meth:`submit`)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: set[AttemptStream] = set()
        """Streams submitted and not yet finished or cancelled."""
        self.heard_at = float("-inf")
        """Loop time of the latest output from the worker (the health watchdog counts it
        as a sign of life beside the load reports)."""
        self.load_watch: tuple[str, Callable[[Load], None]] | None = None
        """The health monitor's load watch (its name, and where the load on frames goes):
        named in every session, whose frames then stand for its reports."""

    @property
    def live(self) -> int:
        return sum(1 for s in self._live if not s.done and not s.cancelled)

    def fail_all(self, error: WorkerCallError) -> int:
        """Fail every unfinished request on this worker (it stopped answering).

        A stopped or partitioned peer can leave a stream open without data for long; the
        health monitor notices first (missed load polls), and the requests resume elsewhere.
        Returns how many requests were failed.
        """
        failed = 0
        for stream in list(self._live):
            if not stream.done and not stream.cancelled:
                stream.push(error)
                failed += 1
        self._live.clear()
        for task in list(self._tasks):
            task.cancel()
        self._drop_link()
        return failed

    @property
    def queued(self) -> int:
        return len(self._pending)

    def submit(self, request: TokenRequest, deadline: float | None) -> AttemptStream:
        """Queue ``request`` (``deadline`` is a ``time.monotonic()`` instant or None)."""
        stream = AttemptStream(request.request_id, self)
        if self.session:
            stream.traceparent = current_traceparent()
        self._live = {s for s in self._live if not s.done and not s.cancelled}
        self._live.add(stream)
        self.window.observe(self._pressure())
        plan = self.window.plan()
        self._pending.append((stream, request, deadline))
        if plan.wait_ms <= 0 or len(self._pending) >= plan.max_size:
            self._flush()
        elif self._timer is None:
            loop = asyncio.get_running_loop()
            if loop.time() - self._last_flush >= plan.wait_ms / 1000.0:
                # Nothing went to this worker for a whole window: there is nobody to batch
                # with, so a lone request does not wait for one (the smoothed pressure can
                # stay high long after a burst). It still waits for the end of this loop
                # iteration, so the requests that arrive in the same one go with it.
                self._timer = loop.call_soon(self._flush)
            else:
                self._timer = loop.call_later(plan.wait_ms / 1000.0, self._flush)
        return stream

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._last_flush = asyncio.get_running_loop().time()
        if self._wants_session and not self.session and time.monotonic() >= self._session_retry_at:
            self.session = True  # the worker may have been upgraded since
        while self._pending:
            size = max(1, self.window.max_size if self.window.enabled else 1)
            batch, self._pending = self._pending[:size], self._pending[size:]
            now = time.perf_counter()
            for stream, _, _ in batch:
                stream.sent = True
                stream.window_wait_ms = (now - stream.enqueued_at) * 1000.0
                stream.batch_size = len(batch)
            if self._observer is not None:
                self._observer(len(batch), batch[0][0].window_wait_ms)
            if self.session:
                self._send_session(batch)
                continue
            if len(batch) == 1:
                stream, request, deadline = batch[0]
                task = asyncio.ensure_future(self._run_single(stream, request, deadline))
                stream.single_task = task
            else:
                task = asyncio.ensure_future(self._run_batch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _timeout(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        return max(0.0, deadline - time.monotonic())

    async def _run_single(
        self, stream: AttemptStream, request: TokenRequest, deadline: float | None
    ) -> None:
        try:
            loop = asyncio.get_running_loop()
            async for _, event in self.client.generate(request, self._timeout(deadline)):
                self.heard_at = loop.time()
                stream.push(event)
            stream.push(_END)
        except asyncio.CancelledError:
            # The caller cancelled: cancelling the call makes the worker abort the request.
            stream.push(WorkerCallError("cancelled", "CANCELLED", "cancelled by the router"))
            raise
        except WorkerCallError as exc:
            stream.push(exc)
        except Exception as exc:
            log.exception("worker %s: unexpected error in Generate", self.client.address)
            stream.push(WorkerCallError("transport", "INTERNAL", type(exc).__name__))

    async def _run_batch(
        self, batch: list[tuple[AttemptStream, TokenRequest, float | None]]
    ) -> None:
        # This task was created in the first request's context: its logs speak for all.
        request_id_var.set(",".join(stream.request_id for stream, _, _ in batch))
        streams = {stream.request_id: stream for stream, _, _ in batch}
        deadlines = [deadline for _, _, deadline in batch]
        # One call carries every request: it may live as long as the longest deadline;
        # each request's own deadline is enforced by the router core.
        deadline = None if any(d is None for d in deadlines) else max(d for d in deadlines if d)
        loop = asyncio.get_running_loop()
        try:
            async for request_id, event in self.client.generate_batch(
                [request for _, request, _ in batch], self._timeout(deadline)
            ):
                self.heard_at = loop.time()
                target = streams.get(request_id)
                if target is not None:
                    target.push(event)
            for stream in streams.values():
                stream.push(_END)
        except asyncio.CancelledError:
            for stream in streams.values():
                stream.push(WorkerCallError("cancelled", "CANCELLED", "cancelled by the router"))
            raise
        except WorkerCallError as exc:
            for stream in streams.values():
                stream.push(exc)
        except Exception as exc:
            log.exception("worker %s: unexpected error in GenerateBatch", self.client.address)
            for stream in streams.values():
                stream.push(WorkerCallError("transport", "INTERNAL", type(exc).__name__))

    # ---- session transport ----------------------------------------------------------

    def _send_session(self, batch: list[tuple[AttemptStream, TokenRequest, float | None]]) -> None:
        """One message with every submission of the window; frames come back per step."""
        if self._link is None:
            # Quiet while idle: no request on the link waits for output.
            watcher, on_load = self.load_watch or ("", None)
            self._link = self.client.open_session(awaiting=self._awaiting, watcher=watcher, on_load=on_load)
            self._reader = asyncio.ensure_future(self._read_session(self._link))
        submits = []
        for stream, request, deadline in batch:
            stream.handle = next(self._handles)
            self._by_handle[stream.handle] = stream
            timeout = self._timeout(deadline)
            if timeout is not None:
                timeout = max(timeout, 0.001)  # 0 would mean "no deadline" on the wire
            submits.append(SessionSubmit(stream.handle, request, timeout, stream.traceparent))
            stream.submitted = (request, deadline)
        self._link.send(submits, [])

    def _awaiting(self) -> bool:
        return bool(self._by_handle)

    async def _read_session(self, link: WorkerSessionLink) -> None:
        """The session's frames to their requests, then its end (or failure) to every
        request still on it. A link that can call back (``listen``: over the worker's
        framed listener) hands each frame over as it is read, and :meth:`events` only
        ends; otherwise frames come out of :meth:`events`."""
        error = WorkerCallError("transport", "UNAVAILABLE", "worker session ended")
        answered = False
        loop = asyncio.get_running_loop()

        def on_events(events: Iterable[tuple[int, SessionEvent]]) -> None:
            nonlocal answered
            answered = True
            self.heard_at = loop.time()
            by_handle = self._by_handle
            for handle, event in events:
                stream = by_handle.get(handle)
                if stream is None:
                    continue  # cancelled or aborted by us: late output is dropped
                stream.submitted = None
                if type(event) is list:
                    stream.push_tokens(event)
                    continue
                stream.push(event)
                if not isinstance(event, Delta):
                    del by_handle[handle]

        listen = getattr(link, "listen", None)
        if listen is not None:
            listen(on_events)
        try:
            async for events in link.events():
                on_events(events)
        except WorkerCallError as exc:
            error = exc
        except asyncio.CancelledError:
            error = WorkerCallError("transport", "UNAVAILABLE", "worker session closed")
            raise
        finally:
            # The session broke (worker died, link cut): every request on it moves elsewhere.
            if self._link is link:
                self._link = None
                self._reader = None
                streams, self._by_handle = list(self._by_handle.values()), {}
                suspect = not answered and error.code in ("UNIMPLEMENTED", "INTERNAL")
                if suspect and await self._lacks_session():
                    self._fall_back_to_calls(streams, error)
                else:
                    for stream in streams:
                        stream.push(error)
            await link.close()

    async def _lacks_session(self) -> bool:
        """Whether a session that failed before its first frame failed because the worker
        has no Session at all. Requests submitted meanwhile go over calls (every release
        serves them)."""
        self.session = False
        try:
            has = await self.client.has_session(timeout=5.0)
        except WorkerCallError:
            has = True  # it could not tell: treat the failure as the session's own
        self.session = has or self.session
        return not has

    def _fall_back_to_calls(self, streams: list[AttemptStream], error: WorkerCallError) -> None:
        """The worker has no Session (a release before it, during a rolling upgrade):
        its requests go again over calls, which every release serves, instead of failing
        and opening the worker's circuit. Session is tried again after
        :data:`SESSION_RETRY_S`."""
        log.warning("worker %s does not implement Session (%s): using calls for %.0f s",
                    self.client.address, error.message, SESSION_RETRY_S)
        self.session = False
        self._session_retry_at = time.monotonic() + SESSION_RETRY_S
        for stream in streams:
            if stream.submitted is None:  # it already had output there: it cannot move silently
                stream.push(error)
                continue
            request, deadline = stream.submitted
            stream.submitted = None
            stream.handle = None
            self._pending.append((stream, request, deadline))
        if self._pending:
            self._flush()

    def _drop_link(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    async def cancel(self, stream: AttemptStream, finished: bool) -> None:
        for i, (pending, _, _) in enumerate(self._pending):
            if pending is stream:
                del self._pending[i]
                return
        if finished:
            return
        if stream.handle is not None:
            # Only this request of the session stops (its ABORT final is dropped here).
            if self._by_handle.pop(stream.handle, None) is not None and self._link is not None:
                self._link.send([], [stream.handle])
            return
        if stream.single_task is not None:
            stream.single_task.cancel()
            # asyncio.wait, not `await task` under suppress(CancelledError): that would also
            # swallow a cancellation of the caller itself.
            await asyncio.wait({stream.single_task})
            return
        if stream.sent:
            # Only this request of the batch stops; the others keep streaming.
            try:
                await self.client.abort(stream.request_id)
            except WorkerCallError as exc:
                log.warning("abort of %s on %s failed: %s", stream.request_id, self.client.address, exc)

    async def close(self) -> None:
        reader = self._reader
        self._drop_link()
        if reader is not None:
            await asyncio.wait({reader})
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for stream, _, _ in self._pending:
            stream.push(WorkerCallError("transport", "UNAVAILABLE", "worker removed"))
        self._pending.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

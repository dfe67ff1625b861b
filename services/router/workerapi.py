"""The interface the router core uses to talk to one worker (no grpc here).

``services.router.workerclient.GrpcWorkerClient`` is the production implementation;
tests may substitute an in-process double.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import LlmeshError
from services.common.generation import Delta, Final, TokenRequest
from services.common.retry import RETRYABLE_KINDS
from services.router.registry import Load, WorkerInfo


class WorkerCallError(Exception):
    """A call to a worker failed.

    ``kind`` decides what the router does:
    - ``transport``: the worker or the link failed (unreachable, reset, engine dead) ->
      count against the breaker, retry/resume elsewhere;
    - ``failed``: the worker answered but failed this request (INTERNAL, an engine error
      finish) -> retry/resume elsewhere, breaker untouched (it may be the request's doing);
    - ``overloaded``: the worker refused for load -> retry elsewhere, breaker untouched;
    - ``rejected``: the request itself is bad (invalid argument, unknown model) -> tell the
      caller ``error``, with every detail the worker sent; breaker untouched;
    - ``deadline``: the caller's deadline passed -> tell the caller.
    """

    RETRYABLE = RETRYABLE_KINDS
    """The kinds the retry policy moves to another worker (services/common/retry.py)."""

    def __init__(self, kind: str, code: str, message: str, error: LlmeshError | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.kind = kind
        self.code = code
        self.message = message
        self.error = error
        """The worker's own error (field violations, retry hint) for ``rejected`` calls."""

    @property
    def retryable(self) -> bool:
        return self.kind in self.RETRYABLE


StreamEvent = Delta | Final
"""What one request's stream delivers: deltas, then one final."""
WorkerEvent = StreamEvent | WorkerCallError
"""What a worker call yields per request; a WorkerCallError ends that request alone."""
SessionEvent = WorkerEvent | list[int]
"""What a worker session yields per request and frame: a plain list is the token ids of a
delta without logprobs (no :class:`Delta` built for the steady state), else as
:data:`WorkerEvent`."""


@dataclass(frozen=True)
class SessionSubmit:
    """One request sent over a worker session."""

    handle: int
    request: TokenRequest
    timeout_s: float | None
    traceparent: str = ""


class WorkerSessionLink(Protocol):
    """One long-lived session with a worker: many requests, one frame per engine step."""

    def send(self, submits: Sequence[SessionSubmit], aborts: Sequence[int]) -> None:
        """Queue one message carrying these submissions and aborts (never blocks)."""
        ...

    def events(self) -> AsyncIterator[Iterable[tuple[int, SessionEvent]]]:
        """Each frame's (handle, token ids / delta / final / per-request error) as it arrives, one
        iterable per frame (the reader takes a frame's requests in one go, not one wake-up
        of an async iterator each); raises WorkerCallError when the session itself breaks."""
        ...

    async def close(self) -> None: ...


class WorkerClient(Protocol):
    """One connection to a worker's WorkerService."""

    address: str

    def generate(
        self, request: TokenRequest, timeout: float | None
    ) -> AsyncIterator[tuple[str, WorkerEvent]]:
        """Stream (request_id, delta-or-final) of one request; raises WorkerCallError."""
        ...

    def generate_batch(
        self, requests: Sequence[TokenRequest], timeout: float | None
    ) -> AsyncIterator[tuple[str, WorkerEvent]]:
        """Stream (request_id, delta-or-final) of several requests in one call."""
        ...

    def open_session(self, awaiting: Callable[[], bool] | None = None, *, watcher: str = "",
                     on_load: Callable[[Load], None] | None = None) -> WorkerSessionLink:
        """Start a session (the router's ``worker_transport: session``). ``awaiting``
        says whether any request on it still waits for output: while it says no, the
        session neither pings nor minds the worker's silence (services/common/sessionwire.py).
        ``watcher`` names this router's load watch (see :meth:`watch_load`): the worker's
        frames then carry its load now and then, handed to ``on_load``."""
        ...

    async def has_session(self, timeout: float) -> bool:
        """Whether the worker serves Session (False: a release before it); raises
        WorkerCallError when the worker cannot be asked."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def watch_load(self, interval_s: float, *, watcher: str = "", silence_s: float = 0.0,
                   elsewhere: Callable[[], bool] | None = None) -> AsyncIterator[Load]:
        """The worker's load every ``interval_s`` (WatchLoad); raises WorkerCallError
        when the stream breaks. A named watch (``watcher``) gets a report only when no
        frame of a session opened with the same name carried the load for ``interval_s``
        (``silence_s`` after a frame carried it, when longer; services/worker/loadclock.py);
        while ``elsewhere`` says the frames carry it, the watch's connection is not pinged
        either."""
        ...

    async def get_model_info(self, timeout: float) -> WorkerInfo: ...

    def watch_health(self, service: str) -> AsyncIterator[str]:
        """Health statuses (SERVING, NOT_SERVING, ...) as they change; raises WorkerCallError."""
        ...

    async def close(self) -> None: ...

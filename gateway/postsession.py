"""The postprocessor tier over long-lived Session calls (``postprocessor_transport: session``).

One ``Session`` call per replica, opened when the first request needs it and again after
it broke, carries every request the gateway sends to that replica under a handle of its
own. What the requests write in one event-loop iteration (the router's step wakes many
streams at once) goes out as one ``SessionRequest``, and a reader task splits each frame
into the requests' queues (the machinery is :mod:`gateway.sessionlink`'s; here are what
a postprocessor message and frame hold).

To :class:`gateway.core._Stream` a request looks like a ``Process`` stream
(:class:`gateway.core.PostSession`): its own error (bad config, bad token) is the domain
error a call would have ended with, and a broken session is :class:`TierUnavailable` for
every request on it, so each is replayed into another replica (what a failed session
means is :mod:`gateway.sessionlink`'s rule).

A replica without Session (an older release, during a rolling upgrade) gets ``Process``
calls (:class:`gateway.tiers.GrpcPostprocessorTier`): a request that was on the failed
session opens one there and sends it everything it had sent (the replica never answered
on that session, so nothing of it reached the caller), and the replica's next requests
open calls until Session is asked for again.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from gateway import convert
from gateway.core import PostSession, TierUnavailable
from gateway.sessionlink import NoSession, ReplicaLinks, SessionLink
from gateway.tiers import GrpcPostprocessorTier, request_error
from gateway.types import PostConfig, PostDelta, PostFinal
from llmesh.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from services.common import errors
from services.common.sessionwire import SessionOpener
from services.common.settings import TlsSettings
from services.common.tracing import current_traceparent

SESSION_METHOD = "/llmesh.postprocess.v1.PostprocessService/Session"

PostItem = PostDelta | PostFinal | BaseException


class SessionPost:
    """One request in a postprocessor Session (the gateway's PostSession protocol)."""

    def __init__(self, link: _SessionLink, handle: int, deadline: float | None,
                 open_call: Callable[..., Awaitable[PostSession]]) -> None:
        self.link = link
        self.handle = handle
        self.deadline = deadline
        """Monotonic instant after which read() gives up, as a call's timeout would."""
        self.items: asyncio.Queue[PostItem] = asyncio.Queue()
        self.finished = False
        """A final or an error came back: the postprocessor holds nothing for it any more."""
        self.closed = False
        self.sent: list[int] | None = [] if not link.frames_received else None
        """The tokens sent while the replica has not answered on this session (None once
        it has): if it turns out to have no Session, they go again over a call."""
        self.end_reason: str | None = None
        """The finish reason sent, for the same replay."""
        self.call: PostSession | None = None
        """The Process call this request moved to (its replica has no Session)."""
        self._open_call = open_call
        """Opens that call: ``await open_call(timeout=...)``."""
        self.on_text: Callable[[str], None] | None = None
        """Where the request's text goes as its frames arrive (see :meth:`listen`)."""
        self._expiry: asyncio.TimerHandle | None = None
        """One timer for the request's deadline (not a timeout around every read: reads
        come once per frame)."""
        if deadline is not None:
            self._expiry = asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()), self._expire)

    def _expire(self) -> None:
        """The deadline passed: the next read raises DeadlineExceeded, after what already
        arrived (as a call's timeout would)."""
        self._expiry = None
        self.on_text = None  # text after this point stays behind the error, unread
        if not self.finished and not self.closed and self.call is None:
            self.items.put_nowait(errors.DeadlineExceeded("postprocessor: the request's deadline passed"))

    def _stop_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _unanswered(self) -> list[int] | None:
        """:attr:`sent`, while the replica has answered nothing on the session."""
        if self.sent is not None and self.link.frames_received:
            self.sent = None  # it answered: it has Session, and nothing is replayed
        return self.sent

    def _check(self) -> bool:
        """Whether a write should go out; raises TierUnavailable on a broken link (as a
        write into a broken Process call does)."""
        if self.link.failure is not None:
            raise TierUnavailable(self.link.failure.message)
        return not self.finished

    def send_tokens_nowait(self, token_ids: list[int]) -> bool:
        """Send without waiting: False (nothing done) when the request moved to a Process
        call, whose write is awaited (:meth:`send_tokens`)."""
        link = self.link
        if self.sent is None and self.call is None and link.failure is None and not (
            self.closed or self.finished
        ):
            link.tokens(self.handle, token_ids)  # the steady state: an answered session
            return True
        if self.closed:
            return True
        if self.call is not None and self.sent is None:
            return False
        sent = self._unanswered()
        if sent is not None:
            sent.extend(token_ids)
            if isinstance(self.link.failure, NoSession):
                return True  # read() sends it over the call
        if self._check():
            self.link.tokens(self.handle, token_ids)
        return True

    async def send_tokens(self, token_ids: list[int]) -> None:
        if not self.send_tokens_nowait(token_ids):
            assert self.call is not None
            await self.call.send_tokens(token_ids)

    async def send_end(self, finish_reason: str) -> None:
        if self.closed:
            return
        if self.call is not None and self.sent is None:
            await self.call.send_end(finish_reason)
            return
        if self._unanswered() is not None:
            self.end_reason = finish_reason
            if isinstance(self.link.failure, NoSession):
                return
        if self._check():
            self.link.end(self.handle, convert.upstream_finish(finish_reason))

    def listen(self, on_text: Callable[[str], None]) -> None:
        """Hand the request's text to ``on_text`` from the frame reader, as it arrives
        (no queue, no task woken per frame); :meth:`read` then returns only the final or
        raises the error. After a move to a Process call, read() returns its text too."""
        self.on_text = on_text

    async def read(self) -> PostDelta | PostFinal | None:
        if self.call is None:
            item = await self.items.get()
            if not isinstance(item, NoSession):
                if isinstance(item, BaseException):
                    raise item
                return item
            await self._move_to_call()
        assert self.call is not None
        return await self.call.read()

    async def _move_to_call(self) -> None:
        """The replica has no Session: open a Process call there and send it what this
        request sent (the session answered nothing, so the caller had nothing yet); what
        is sent meanwhile joins the replay, and what is sent after goes over the call."""
        remaining = None
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceeded("postprocessor: the request's deadline passed")
        self.call = await self._open_call(timeout=remaining)
        ended = False
        while True:
            if self.sent:
                token_ids, self.sent = self.sent, []
                await self.call.send_tokens(token_ids)
            elif self.end_reason is not None and not ended:
                ended = True
                await self.call.send_end(self.end_reason)
            else:
                break
        self.sent = None  # from now on writes go straight to the call

    async def close(self, graceful: bool = False) -> None:
        """Drop the request; the postprocessor is told unless it already finished it."""
        if self.closed:
            return
        self.closed = True
        self._stop_expiry()
        if self.call is not None:
            await self.call.close(graceful)
            return
        self.link.release(self, tell=not self.finished)

    # called by the link's reader
    def deliver_text(self, text: str) -> None:
        """A frame's text of this request: :meth:`deliver` without a PostDelta when the
        text goes to :attr:`on_text`."""
        on_text = self.on_text
        if on_text is None or self.finished:
            self.deliver(PostDelta(text=text))
        else:
            on_text(text)

    def deliver(self, item: PostItem) -> None:
        if self.finished:
            return
        if isinstance(item, PostDelta):
            if self.on_text is not None:
                self.on_text(item.text)
                return
        else:
            self.finished = True
            if not isinstance(item, NoSession):
                self._stop_expiry()
        self.items.put_nowait(item)


class _SessionLink(SessionLink[postprocess_pb2.SessionRequest, postprocess_pb2.SessionResponse, SessionPost]):
    """One Session call to one postprocessor replica and the requests it carries."""

    tier = "postprocessor"
    ended_message = "postprocessor session: the replica ended the session"
    closed_message = "postprocessor session: closed"

    # -- writing ---------------------------------------------------------------------
    def open(self, config: PostConfig, deadline: float | None,
             open_call: Callable[..., Awaitable[PostSession]]) -> SessionPost:
        handle = self._allocate()
        request = SessionPost(self, handle, deadline, open_call)
        self.requests[handle] = request
        self._pending.opens.append(postprocess_pb2.SessionOpen(
            handle=handle, config=convert.process_config(config),
            traceparent=current_traceparent(),  # the gateway's span of this request
        ))
        self._schedule()
        return request

    def tokens(self, handle: int, token_ids: Sequence[int]) -> None:
        pending = self._pending
        if pending.handles and pending.handles[-1] == handle:
            pending.token_counts[-1] += len(token_ids)  # the same request again: one entry
        else:
            pending.handles.append(handle)
            pending.token_counts.append(len(token_ids))
        pending.token_ids.extend(token_ids)
        self._schedule()

    def end(self, handle: int, finish_reason: int) -> None:
        self._pending.ends.append(postprocess_pb2.SessionEnd(
            handle=handle, finish_reason=finish_reason,  # type: ignore[arg-type]
        ))
        self._schedule()

    def release(self, request: SessionPost, *, tell: bool) -> None:
        if self.requests.get(request.handle) is request:
            del self.requests[request.handle]
        if tell and self.failure is None:
            self._pending.closes.append(request.handle)
            self._schedule()

    # -- internals -------------------------------------------------------------------
    def _open(self, opener: SessionOpener,
              messages: AsyncIterator[postprocess_pb2.SessionRequest]) -> Any:
        stub = postprocess_pb2_grpc.PostprocessServiceStub(opener.channel)
        return opener.open(SESSION_METHOD, stub.Session, messages, postprocess_pb2.SessionResponse,
                           awaiting=self.awaiting)

    def _new_message(self) -> postprocess_pb2.SessionRequest:
        return postprocess_pb2.SessionRequest()

    def _dispatch(self, frame: postprocess_pb2.SessionResponse) -> None:
        requests = self.requests
        for handle, text in zip(frame.handles, frame.texts, strict=True):
            request = requests.get(handle)
            if request is not None:  # else: closed meanwhile
                request.deliver_text(text)
        for final in frame.finals:
            self._finish(final.handle, convert.post_final(final.final))
        for error in frame.errors:
            self._finish(error.handle, request_error(error.error, tier="postprocessor"))


class SessionPostprocessorTier:
    """Postprocessor replicas, each reached over one long-lived Session call (or over the
    ``Process`` calls of :attr:`calls` while it has no Session)."""

    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        self.calls = GrpcPostprocessorTier(targets, tls, server_name)
        """The same replicas over Process calls, for those without Session."""
        self.targets = self.calls.targets
        self.links = ReplicaLinks(_SessionLink, self.targets, tls, server_name)

    @property
    def replicas(self) -> int:
        return len(self.targets)

    def link(self, replica: int) -> _SessionLink:
        """The replica's session, opened now if there is none or the last one broke."""
        return self.links.current(replica)

    async def open(self, replica: int, config: PostConfig, *, timeout: float | None) -> PostSession:
        if self.links.uses_calls(replica):
            return await self.calls.open(replica, config, timeout=timeout)
        deadline = None if timeout is None or timeout == float("inf") else time.monotonic() + timeout
        return self.link(replica).open(config, deadline, functools.partial(self.calls.open, replica, config))

    async def close(self) -> None:
        await self.links.close()
        await self.calls.close()

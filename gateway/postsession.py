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
every request on it, so each is replayed into another replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from opentelemetry import propagate

from gateway import convert
from gateway.core import TierUnavailable
from gateway.sessionlink import ReplicaLinks, SessionLink
from gateway.tiers import domain_error, request_error
from gateway.types import PostConfig, PostDelta, PostFinal
from llmesh.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from services.common import errors
from services.common.channels import broken_link
from services.common.settings import TlsSettings

_BROKEN_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    # The postprocessor (not us) cancelled the session: it is shutting down.
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DATA_LOSS,
    # A replica without Session (an older version during a rollout).
    grpc.StatusCode.UNIMPLEMENTED,
}
"""Codes of a failed Session call that say the link broke, not that the requests were bad."""

PostItem = PostDelta | PostFinal | BaseException


def link_error(err: grpc.aio.AioRpcError) -> errors.LlmeshError:
    """What the failure of a whole Session call means for each of its requests."""
    code = err.code()
    if code in _BROKEN_CODES or broken_link(err.details() or ""):
        return TierUnavailable(f"postprocessor session: {err.details() or code.name}")
    return domain_error(err, tier="postprocessor")


class SessionPost:
    """One request in a postprocessor Session (the gateway's PostSession protocol)."""

    def __init__(self, link: _SessionLink, handle: int, deadline: float | None) -> None:
        self.link = link
        self.handle = handle
        self.deadline = deadline
        """Monotonic instant after which read() gives up, as a call's timeout would."""
        self.items: asyncio.Queue[PostItem] = asyncio.Queue()
        self.finished = False
        """A final or an error came back: the postprocessor holds nothing for it any more."""
        self.closed = False

    def _check(self) -> bool:
        """Whether a write should go out; raises TierUnavailable on a broken link (as a
        write into a broken Process call does)."""
        if self.closed:
            return False
        if self.link.failure is not None:
            raise TierUnavailable(self.link.failure.message)
        return not self.finished

    async def send_tokens(self, token_ids: list[int]) -> None:
        if self._check():
            self.link.tokens(self.handle, token_ids)

    async def send_end(self, finish_reason: str) -> None:
        if self._check():
            self.link.end(self.handle, convert.upstream_finish(finish_reason))

    async def read(self) -> PostDelta | PostFinal | None:
        remaining = None if self.deadline is None else self.deadline - time.monotonic()
        try:
            async with asyncio.timeout(remaining):
                item = await self.items.get()
        except TimeoutError:
            raise errors.DeadlineExceeded("postprocessor: the request's deadline passed") from None
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self, graceful: bool = False) -> None:
        """Drop the request; the postprocessor is told unless it already finished it."""
        if self.closed:
            return
        self.closed = True
        self.link.release(self, tell=not self.finished)

    # called by the link's reader
    def deliver(self, item: PostItem) -> None:
        if self.finished:
            return
        if not isinstance(item, PostDelta):
            self.finished = True
        self.items.put_nowait(item)


class _SessionLink(SessionLink[postprocess_pb2.SessionRequest, postprocess_pb2.SessionResponse, SessionPost]):
    """One Session call to one postprocessor replica and the requests it carries."""

    tier = "postprocessor"
    ended_message = "postprocessor session: the replica ended the session"
    closed_message = "postprocessor session: closed"

    # -- writing ---------------------------------------------------------------------
    def open(self, config: PostConfig, deadline: float | None) -> SessionPost:
        handle = self._allocate()
        request = SessionPost(self, handle, deadline)
        self.requests[handle] = request
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the current span: the gateway's span of this request
        self._pending.opens.append(postprocess_pb2.SessionOpen(
            handle=handle, config=convert.process_config(config), traceparent=carrier.get("traceparent", ""),
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
    def _open(self, channel: grpc.aio.Channel,
              messages: AsyncIterator[postprocess_pb2.SessionRequest]) -> Any:
        return postprocess_pb2_grpc.PostprocessServiceStub(channel).Session(messages)

    def _new_message(self) -> postprocess_pb2.SessionRequest:
        return postprocess_pb2.SessionRequest()

    def _call_error(self, err: grpc.aio.AioRpcError) -> errors.LlmeshError:
        return link_error(err)

    def _dispatch(self, frame: postprocess_pb2.SessionResponse) -> None:
        requests = self.requests
        for handle, text in zip(frame.handles, frame.texts, strict=True):
            request = requests.get(handle)
            if request is not None:  # else: closed meanwhile
                request.deliver(PostDelta(text=text))
        for final in frame.finals:
            self._finish(final.handle, convert.post_final(final.final))
        for error in frame.errors:
            self._finish(error.handle, request_error(error.error, tier="postprocessor"))


class SessionPostprocessorTier:
    """Postprocessor replicas, each reached over one long-lived Session call."""

    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        if not targets:
            raise ValueError("at least one target is required")
        self.targets = list(targets)
        self.links = ReplicaLinks(_SessionLink, self.targets, tls, server_name)

    @property
    def replicas(self) -> int:
        return len(self.targets)

    def link(self, replica: int) -> _SessionLink:
        """The replica's session, opened now if there is none or the last one broke."""
        return self.links.current(replica)

    async def open(self, replica: int, config: PostConfig, *, timeout: float | None) -> SessionPost:
        deadline = None if timeout is None or timeout == float("inf") else time.monotonic() + timeout
        return self.link(replica).open(config, deadline)

    async def close(self) -> None:
        await self.links.close()

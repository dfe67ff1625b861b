"""The postprocessor tier over long-lived Session calls (``postprocessor_transport: session``).

One ``Session`` call per replica, opened when the first request needs it and again after
it broke, carries every request the gateway sends to that replica under a handle of its
own. What the requests write in one event-loop iteration (the router's step wakes many
streams at once) goes out as one ``SessionRequest``: the first write schedules the flush
with ``call_soon``, the others land in the same message. A reader task splits each frame
into the requests' queues.

To :class:`gateway.core._Stream` a request looks like a ``Process`` stream
(:class:`gateway.core.PostSession`): its own error (bad config, bad token) is the domain
error a call would have ended with, and a broken session is :class:`TierUnavailable` for
every request on it, so each is replayed into another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from opentelemetry import propagate

from gateway import convert
from gateway.core import TierUnavailable
from gateway.tiers import domain_error
from gateway.types import PostConfig, PostDelta, PostFinal
from llmesh.common.v1 import common_pb2
from llmesh.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from services.common import errors
from services.common.channels import broken_link, create_channel
from services.common.settings import TlsSettings

log = logging.getLogger(__name__)

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

_REQUEST_TRANSPORT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}
"""Codes of one request's error that make it go to another replica (as a call's would)."""

PostItem = PostDelta | PostFinal | BaseException


def link_error(err: grpc.aio.AioRpcError) -> errors.LlmeshError:
    """What the failure of a whole Session call means for each of its requests."""
    code = err.code()
    if code in _BROKEN_CODES or broken_link(err.details() or ""):
        return TierUnavailable(f"postprocessor session: {err.details() or code.name}")
    return domain_error(err, tier="postprocessor")


def request_error(proto: common_pb2.RequestError) -> errors.LlmeshError:
    """One request's error, mapped as gateway.tiers.domain_error maps a Process call's."""
    code, mapped = errors.request_error_from_proto(proto)
    if code in _REQUEST_TRANSPORT:
        return TierUnavailable(f"postprocessor: {mapped.message}")
    if not isinstance(mapped, errors.InvalidArgument | errors.ResourceExhausted):
        mapped.message = f"postprocessor: {mapped.message}"
        mapped.args = (mapped.message,)
    return mapped


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


class _SessionLink:
    """One Session call to one replica: a buffer flushed once per loop iteration, and a
    reader that demultiplexes frames by handle."""

    def __init__(self, stub: postprocess_pb2_grpc.PostprocessServiceStub, replica: int) -> None:
        self.replica = replica
        self.requests: dict[int, SessionPost] = {}
        self.failure: errors.LlmeshError | None = None
        self._next_handle = 0
        self._outbox: asyncio.Queue[postprocess_pb2.SessionRequest | None] = asyncio.Queue()
        self._pending = postprocess_pb2.SessionRequest()
        self._flush_scheduled = False
        self.messages_sent = 0
        self._call = stub.Session(self._messages())
        self._reader = asyncio.ensure_future(self._read())

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

    def _allocate(self) -> int:
        while True:
            self._next_handle = (self._next_handle + 1) & 0xFFFFFFFF
            if self._next_handle not in self.requests:
                return self._next_handle

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.failure is not None:
            return
        message, self._pending = self._pending, postprocess_pb2.SessionRequest()
        self.messages_sent += 1
        self._outbox.put_nowait(message)

    async def _messages(self) -> AsyncIterator[postprocess_pb2.SessionRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    # -- reading ---------------------------------------------------------------------
    async def _read(self) -> None:
        failure: errors.LlmeshError
        try:
            async for frame in self._call:
                self._demultiplex(frame)
            failure = TierUnavailable("postprocessor session: the replica ended the session")
        except grpc.aio.AioRpcError as err:
            failure = link_error(err)
        except asyncio.CancelledError:
            failure = TierUnavailable("postprocessor session: closed")
            self._fail(failure)
            raise
        except Exception as exc:  # a bug here must not leave requests waiting forever
            log.exception("postprocessor session reader failed")
            failure = TierUnavailable(f"postprocessor session: {type(exc).__name__}")
        self._fail(failure)

    def _demultiplex(self, frame: postprocess_pb2.SessionResponse) -> None:
        requests = self.requests
        for handle, text in zip(frame.handles, frame.texts, strict=True):
            request = requests.get(handle)
            if request is not None:  # else: closed meanwhile
                request.deliver(PostDelta(text=text))
        for final in frame.finals:
            request = requests.pop(final.handle, None)
            if request is not None:
                request.deliver(convert.post_final(final.final))
        for error in frame.errors:
            request = requests.pop(error.handle, None)
            if request is not None:
                request.deliver(request_error(error.error))

    def _fail(self, failure: errors.LlmeshError) -> None:
        """The call is over: every request still on it fails with ``failure``."""
        if self.failure is not None:
            return
        self.failure = failure
        requests, self.requests = self.requests, {}
        if requests:
            log.warning("postprocessor replica %d: session broke (%s) under %d requests",
                        self.replica, failure.message, len(requests))
        for request in requests.values():
            request.deliver(failure)
        self._outbox.put_nowait(None)

    async def close(self) -> None:
        self._fail(TierUnavailable("postprocessor session: closed"))
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class SessionPostprocessorTier:
    """Postprocessor replicas, each reached over one long-lived Session call."""

    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        if not targets:
            raise ValueError("at least one target is required")
        self.targets = list(targets)
        # Untraced channels: the call lives for many requests; each request carries its
        # own trace context in its open.
        self.channels = [
            create_channel(t, tls=tls, server_name_override=server_name, interceptors=[])
            for t in self.targets
        ]
        self.stubs = [postprocess_pb2_grpc.PostprocessServiceStub(c) for c in self.channels]
        self.links: list[_SessionLink | None] = [None] * len(self.targets)

    @property
    def replicas(self) -> int:
        return len(self.channels)

    def link(self, replica: int) -> _SessionLink:
        """The replica's session, opened now if there is none or the last one broke."""
        index = replica % self.replicas
        link = self.links[index]
        if link is None or link.failure is not None:
            link = _SessionLink(self.stubs[index], index)
            self.links[index] = link
        return link

    async def open(self, replica: int, config: PostConfig, *, timeout: float | None) -> SessionPost:
        deadline = None if timeout is None or timeout == float("inf") else time.monotonic() + timeout
        return self.link(replica).open(config, deadline)

    async def close(self) -> None:
        for link in self.links:
            if link is not None:
                with contextlib.suppress(Exception):
                    await link.close()
        for channel in self.channels:
            with contextlib.suppress(Exception):
                await channel.close()

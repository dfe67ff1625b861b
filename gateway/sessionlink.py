"""The client side of a multiplexed Session: one long-lived call per replica.

A tier in ``session`` transport keeps one bidirectional ``Session`` call per replica and
carries every request it sends there under a handle of its own:

- what the requests write in one event-loop iteration goes out as one message: the first
  write schedules the flush with ``call_soon``, the others land in the same message;
- a reader task splits each frame the replica sends into the requests it names;
- when the call breaks (or ends, or is closed) every request still on it fails with the
  same error, :class:`TierUnavailable` unless the replica refused the call itself, so the
  gateway core moves each to another replica; the next request opens a new call.

:class:`SessionLink` is that call; :class:`ReplicaLinks` opens one per replica when a
request needs it, again after it broke, over channels without the tracing interceptor:
one span for a call that lives as long as the gateway would say nothing, so each request
carries the W3C ``traceparent`` of its own span in its submission instead. What a message
and a frame hold, and what a request's error means, is each tier's
(:mod:`gateway.routersession`, :mod:`gateway.postsession`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import grpc

from gateway.core import TierUnavailable
from services.common import errors
from services.common.channels import create_channel
from services.common.settings import TlsSettings

log = logging.getLogger(__name__)


class Carried(Protocol):
    """A request a link carries: its events, its end, and the call's failure under it are
    delivered to it (what an event is, is the tier's)."""

    def deliver(self, item: Any) -> None: ...


MessageT = TypeVar("MessageT")
FrameT = TypeVar("FrameT")
CarriedT = TypeVar("CarriedT", bound=Carried)


class SessionLink(ABC, Generic[MessageT, FrameT, CarriedT]):
    """One Session call to one replica: the requests it carries by handle, the message
    being filled for the next flush, and the reader that demultiplexes frames."""

    tier: ClassVar[str]
    """The tier's name in logs."""
    ended_message: ClassVar[str]
    """Why requests fail when the replica ends the call (``{replica}`` is its index)."""
    closed_message: ClassVar[str]
    """Why requests fail when the link is closed on this side."""

    def __init__(self, channel: grpc.aio.Channel, replica: int) -> None:
        self.replica = replica
        self.requests: dict[int, CarriedT] = {}
        """The requests on this call, by handle."""
        self.failure: errors.LlmeshError | None = None
        """Why the call is over, once it is."""
        self.messages_sent = 0
        self.frames_received = 0
        self._next_handle = 0
        self._outbox: asyncio.Queue[MessageT | None] = asyncio.Queue()
        self._pending = self._new_message()
        self._flush_scheduled = False
        self._call = self._open(channel, self._messages())
        self._reader = asyncio.ensure_future(self._read())

    # -- what each tier defines ------------------------------------------------------
    @abstractmethod
    def _open(self, channel: grpc.aio.Channel, messages: AsyncIterator[MessageT]) -> Any:
        """Start the Session call that sends ``messages``."""

    @abstractmethod
    def _new_message(self) -> MessageT:
        """An empty message."""

    @abstractmethod
    def _dispatch(self, frame: FrameT) -> None:
        """Hand what ``frame`` holds to the requests it names (and forget the ended ones)."""

    @abstractmethod
    def _call_error(self, err: grpc.aio.AioRpcError) -> errors.LlmeshError:
        """What the failure of the whole call means for each of its requests."""

    # -- the link --------------------------------------------------------------------
    @property
    def broken(self) -> bool:
        return self.failure is not None

    async def close(self) -> None:
        self._fail(TierUnavailable(self.closed_message))
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    # -- for the tiers' links --------------------------------------------------------
    def _allocate(self) -> int:
        """A free handle (0 is never one: it is the wire's "unset")."""
        while True:
            self._next_handle = (self._next_handle + 1) & 0xFFFFFFFF
            if self._next_handle and self._next_handle not in self.requests:
                return self._next_handle

    def _finish(self, handle: int, item: object) -> None:
        """Deliver a request's last item (its final or error); its handle is free again."""
        request = self.requests.pop(handle, None)
        if request is not None:  # else: closed or aborted by us meanwhile
            request.deliver(item)

    def _schedule(self) -> None:
        # Everything written in this tick goes out as one message.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    # -- internals -------------------------------------------------------------------
    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.failure is not None:
            return
        message, self._pending = self._pending, self._new_message()
        self.messages_sent += 1
        self._outbox.put_nowait(message)

    async def _messages(self) -> AsyncIterator[MessageT]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        failure: errors.LlmeshError
        try:
            async for frame in self._call:
                self.frames_received += 1
                self._dispatch(frame)
            failure = TierUnavailable(self.ended_message.format(replica=self.replica))
        except grpc.aio.AioRpcError as err:
            failure = self._call_error(err)
        except asyncio.CancelledError:
            self._fail(TierUnavailable(self.closed_message))
            raise
        except Exception as exc:  # a bug here must not leave requests waiting forever
            log.exception("%s session reader failed", self.tier)
            failure = TierUnavailable(f"{self.tier} session: {type(exc).__name__}")
        self._fail(failure)

    def _fail(self, failure: errors.LlmeshError) -> None:
        """The call is over: every request still on it fails with ``failure``."""
        if self.failure is not None:
            return
        self.failure = failure
        requests, self.requests = self.requests, {}
        if requests:
            log.warning("%s replica %d: session broke (%s) under %d requests",
                        self.tier, self.replica, failure.message, len(requests))
        for request in requests.values():
            request.deliver(failure)
        self._outbox.put_nowait(None)


LinkT = TypeVar("LinkT", bound=SessionLink[Any, Any, Any])


class ReplicaLinks(Generic[LinkT]):
    """One :class:`SessionLink` per replica, opened when a request needs it and again
    after it broke, each over an untraced channel of its own (module docstring)."""

    def __init__(self, link: type[LinkT], targets: Sequence[str], tls: TlsSettings | None = None,
                 server_name: str = "") -> None:
        self._link = link
        self.channels = [
            create_channel(t, tls=tls, server_name_override=server_name, interceptors=[])
            for t in targets
        ]
        self._links: list[LinkT | None] = [None] * len(self.channels)
        self.opened = 0
        """Calls opened so far (one per replica, plus one per break)."""

    def __len__(self) -> int:
        return len(self._links)

    def __getitem__(self, replica: int) -> LinkT | None:
        """The replica's current link, if it has one (it may be broken)."""
        return self._links[replica]

    def current(self, replica: int) -> LinkT:
        """The replica's link, opened now if there is none or the last one broke."""
        index = replica % len(self._links)
        link = self._links[index]
        if link is None or link.broken:
            if link is not None:
                log.info("%s replica %d: session broke; opening a new one", link.tier, index)
            # Opened in an empty context: the call and its reader serve every request, so
            # they must not carry this request's span or log fields.
            link = contextvars.Context().run(self._link, self.channels[index], index)
            self._links[index] = link
            self.opened += 1
        return link

    async def close(self) -> None:
        for link in self._links:
            if link is not None:
                with contextlib.suppress(Exception):
                    await link.close()
        for channel in self.channels:
            with contextlib.suppress(Exception):
                await channel.close()

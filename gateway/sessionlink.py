"""The client side of a multiplexed Session: one long-lived call per replica.

A tier in ``session`` transport keeps one bidirectional ``Session`` call per replica and
carries every request it sends there under a handle of its own:

- what the requests write in one event-loop iteration goes out as one message: the first
  write schedules the flush with ``call_soon``, the others land in the same message;
- each frame the replica sends is split into the requests it names as it is read (over
  the framed listener, in the callback that read its bytes; over gRPC, in a reader task,
  which over the listener only waits for the call's end);
- when the whole call fails (or ends, or is closed), one rule for every tier says what
  that means for each request still on it (:meth:`SessionLink._call_failure`): the
  replica refused the call (PERMISSION_DENIED, UNAUTHENTICATED): each fails with that
  error, as another replica would refuse the same; the replica has no Session at all (a
  release before it, during a rolling upgrade; asked with a Session call that writes
  nothing): each runs again over the tier's per-request calls (:class:`NoSession`), and
  so does the replica until :data:`SESSION_RETRY_S` has passed; anything else is a broken
  link: :class:`TierUnavailable`, and the gateway core moves each request to another
  replica. The next request opens a new call.

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
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import grpc

from gateway.core import TierUnavailable
from gateway.tiers import domain_error
from services.common import errors
from services.common.channels import LOOKUP_IDLE_TIMEOUT_MS, create_channel
from services.common.retry import SESSION_RETRY_S
from services.common.sessionwire import SessionOpener
from services.common.settings import TlsSettings

log = logging.getLogger(__name__)


PROBE_TIMEOUT_S = 5.0
"""Longest wait for the answer to the Session call that asks whether a replica has one."""

REFUSED_CODES = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})
"""A Session call ended with one of these was refused, not broken: another replica would
refuse the same, so its requests fail with the error instead of moving."""

NO_SESSION_CODES = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL})
"""How a Session call to a replica without Session ends: UNIMPLEMENTED, or INTERNAL
"Internal error from Core" when grpc.aio sees the call end while this side is still
writing (64 of 100 tries, measured on the router's worker hop). Only a Session call that
writes nothing tells that from the session's own failure (:meth:`SessionLink._ask_for_session`)."""


class NoSession(TierUnavailable):
    """The replica has no Session (a release before it): a request that was on the failed
    call runs again over the tier's per-request call. None of it reached its caller (the
    call failed before its first frame). Being a :class:`TierUnavailable`, a request that
    cannot move that way fails over like one on a broken link."""


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
    """The tier's name in logs and error messages."""
    field_prefixes: ClassVar[tuple[str, ...]] = ()
    """Internal prefixes of field paths a refusal's violations name (see ``domain_error``)."""
    ended_message: ClassVar[str]
    """Why requests fail when the replica ends the call (``{replica}`` is its index)."""
    closed_message: ClassVar[str]
    """Why requests fail when the link is closed on this side."""

    def __init__(self, opener: SessionOpener, replica: int, target: str = "") -> None:
        self.replica = replica
        self.target = target
        self.requests: dict[int, CarriedT] = {}
        """The requests on this call, by handle."""
        self.failure: errors.LlmeshError | None = None
        """Why the call is over, once it is."""
        self.probing = False
        """The call failed in a way a replica without Session ends it; it is being asked."""
        self.calls_until = 0.0
        """Monotonic instant until which the replica gets calls: it turned out to have no
        Session (0: it has, or nobody knows yet)."""
        self._opener = opener
        self.messages_sent = 0
        self.frames_received = 0
        self._next_handle = 0
        self._outbox: asyncio.Queue[MessageT | None] = asyncio.Queue()
        self._pending = self._new_message()
        self._flush_scheduled = False
        self._call = self._open(opener, self._messages())
        listen = getattr(self._call, "listen", None)
        if listen is not None:
            listen(self._on_frame)
        self._reader = asyncio.ensure_future(self._read())

    # -- what each tier defines ------------------------------------------------------
    @abstractmethod
    def _open(self, opener: SessionOpener, messages: AsyncIterator[MessageT]) -> Any:
        """Start the Session call that sends ``messages`` (``opener.open``: over the
        replica's framed listener when it has one, services/common/sessionwire.py)."""

    @abstractmethod
    def _new_message(self) -> MessageT:
        """An empty message."""

    @abstractmethod
    def _dispatch(self, frame: FrameT) -> None:
        """Hand what ``frame`` holds to the requests it names (and forget the ended ones)."""

    # -- the link --------------------------------------------------------------------
    @property
    def broken(self) -> bool:
        return self.failure is not None

    def awaiting(self) -> bool:
        """Whether any request on the link still waits for the replica: an idle link
        neither pings nor minds the replica's silence (sessionwire.FramedCall), so an idle
        gateway costs its replicas no wake-ups. A replica that broke meanwhile is found by
        the next request, within DEAD_AFTER_S, as it would be on a link just opened."""
        return bool(self.requests)

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
        self._call.send_or_queue(message, self._outbox)

    async def _messages(self) -> AsyncIterator[MessageT]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        failure: errors.LlmeshError
        try:
            try:
                async for frame in self._call:
                    self._on_frame(frame)
                failure = TierUnavailable(self.ended_message.format(replica=self.replica))
            except grpc.aio.AioRpcError as err:
                failure = await self._call_failure(err)
        except asyncio.CancelledError:
            self._fail(TierUnavailable(self.closed_message))
            raise
        except Exception as exc:  # a bug here must not leave requests waiting forever
            log.exception("%s session reader failed", self.tier)
            failure = TierUnavailable(f"{self.tier} session: {type(exc).__name__}")
        self._fail(failure)

    def _on_frame(self, frame: FrameT) -> None:
        self.frames_received += 1
        self._dispatch(frame)

    async def _call_failure(self, err: grpc.aio.AioRpcError) -> errors.LlmeshError:
        """What the failure of the whole call means for each of its requests (module
        docstring): a refusal, no Session at all, or a broken link."""
        if err.code() in NO_SESSION_CODES and not self.frames_received:
            # What grpc reported may hide the replica's answer (INTERNAL): a call that
            # writes nothing gets it as the replica gave it.
            answer = await self._ask_for_session()
            if answer is not None and answer.code() is grpc.StatusCode.UNIMPLEMENTED:
                self.calls_until = time.monotonic() + SESSION_RETRY_S
                log.warning("%s replica %d (%s) has no Session, an older release? (%s): its %d "
                            "requests and the next ones go over calls for %.0f s",
                            self.tier, self.replica, self.target, err.details() or err.code().name,
                            len(self.requests), SESSION_RETRY_S)
                return NoSession(f"{self.tier} replica {self.replica}: no Session")
            if answer is not None and answer.code() in REFUSED_CODES:
                err = answer
        if err.code() in REFUSED_CODES:
            return domain_error(err, tier=self.tier, strip=self.field_prefixes)
        return TierUnavailable(f"{self.tier} session: {err.details() or err.code().name}")

    async def _ask_for_session(self) -> grpc.aio.AioRpcError | None:
        """How the replica answers a Session call that writes nothing and ends its input
        at once (None: OK, or no answer in time). A replica with Session answers OK with
        no frames, one without it UNIMPLEMENTED, one that refuses this gateway refuses it
        too. Meanwhile the replica gets calls."""
        self.probing = True
        call = self._open(self._opener, _no_messages())
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                async for _ in call:
                    pass
        except grpc.aio.AioRpcError as err:
            return err
        except TimeoutError:
            return None
        finally:
            self.probing = False
            call.cancel()
        return None

    def _fail(self, failure: errors.LlmeshError) -> None:
        """The call is over: every request still on it fails with ``failure``."""
        if self.failure is not None:
            return
        self.failure = failure
        requests, self.requests = self.requests, {}
        if requests and not isinstance(failure, NoSession):  # that one said so itself
            log.warning("%s replica %d: session broke (%s) under %d requests",
                        self.tier, self.replica, failure.message, len(requests))
        for request in requests.values():
            request.deliver(failure)
        self._outbox.put_nowait(None)


async def _no_messages() -> AsyncIterator[Any]:
    """What a Session call that only asks whether the replica has Session sends."""
    nothing: tuple[Any, ...] = ()
    for message in nothing:
        yield message


LinkT = TypeVar("LinkT", bound=SessionLink[Any, Any, Any])


class ReplicaLinks(Generic[LinkT]):
    """One :class:`SessionLink` per replica, opened when a request needs it and again
    after it broke, each over an untraced channel of its own (module docstring); and
    which replicas get calls instead (:meth:`uses_calls`)."""

    def __init__(self, link: type[LinkT], targets: Sequence[str], tls: TlsSettings | None = None,
                 server_name: str = "") -> None:
        self._link = link
        self.targets = list(targets)
        self.channels = [
            create_channel(t, tls=tls, server_name_override=server_name, interceptors=[],
                           idle_timeout_ms=LOOKUP_IDLE_TIMEOUT_MS)
            for t in targets
        ]
        self.openers = [
            SessionOpener(channel, target, tls=tls, server_name=server_name)
            for channel, target in zip(self.channels, self.targets, strict=True)
        ]
        self._links: list[LinkT | None] = [None] * len(self.channels)
        self.opened = 0
        """Calls opened so far (one per replica, plus one per break)."""

    def __len__(self) -> int:
        return len(self._links)

    def __getitem__(self, replica: int) -> LinkT | None:
        """The replica's current link, if it has one (it may be broken)."""
        return self._links[replica]

    def uses_calls(self, replica: int) -> bool:
        """Whether a request for ``replica`` goes over the tier's per-request call: the
        replica has no Session (until :data:`SESSION_RETRY_S` after that was found), or
        whether it has is being asked."""
        link = self._links[replica % len(self._links)]
        return link is not None and (link.probing or time.monotonic() < link.calls_until)

    def current(self, replica: int) -> LinkT:
        """The replica's link, opened now if there is none or the last one broke."""
        index = replica % len(self._links)
        link = self._links[index]
        if link is None or link.broken:
            if link is not None:
                log.info("%s replica %d: session broke; opening a new one", link.tier, index)
            # Opened in an empty context: the call and its reader serve every request, so
            # they must not carry this request's span or log fields.
            link = contextvars.Context().run(self._link, self.openers[index], index, self.targets[index])
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

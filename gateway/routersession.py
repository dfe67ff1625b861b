"""The router tier over one long-lived Session per replica (``router_transport: session``).

:class:`SessionRouterTier` implements :class:`gateway.core.RouterTier` like
:class:`gateway.tiers.GrpcRouterTier`, but instead of one server-streaming Generate call
per request it keeps one bidirectional RouterService.Session call per router replica and
multiplexes every request over it:

- submissions and aborts made in the same event-loop tick go out as one SessionRequest;
- the router answers with frames in column layout (one per tick on its side, so one
  worker step for many requests is one message); a reader task splits each frame into
  per-request queues, keyed by a handle this side allocates;
- a request's refusal (RequestError) is raised in that request only, as the domain error
  a Generate call would have raised; a broken Session call raises TierUnavailable in
  every request it carried (the gateway core resumes each through another replica) and
  the next request opens a new call; a refused one (PERMISSION_DENIED, UNAUTHENTICATED)
  raises that error in each;
- a replica without Session (an older release, during a rolling upgrade) gets the
  Generate calls of :class:`gateway.tiers.GrpcRouterTier`: the requests that were on the
  failed Session call run again over them (none had received anything), and so do the
  replica's next requests until Session is asked for again;
- leaving ``generate()`` before the final (cancelled, closed) aborts the request by handle.

The per-replica call, its write coalescing, reader and failing of every request on a
break, and the rule for what a failed call means, are :mod:`gateway.sessionlink`'s; here
are what a router message and frame hold and what a router's error means. Each
submission carries the W3C ``traceparent`` of the request's current span, and the router
starts the request's span under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from gateway import convert
from gateway.sessionlink import NoSession, ReplicaLinks, SessionLink
from gateway.tiers import ROUTER_FIELD_PREFIXES, GrpcRouterTier, request_error
from gateway.types import RouterDelta, RouterFinal, TokenGeneration
from llmesh.router.v1 import router_pb2, router_pb2_grpc
from services.common import errors, generation_convert
from services.common.sessionwire import SessionOpener
from services.common.settings import TlsSettings
from services.common.tracing import current_traceparent

SESSION_METHOD = "/llmesh.router.v1.RouterService/Session"

_Item = RouterDelta | RouterFinal | errors.LlmeshError


class RequestEvents(asyncio.Queue[_Item]):
    """The events of one request on a link, in order; its deltas go straight to
    :attr:`on_delta` when one is set (nothing queued or woken per frame), and the token
    ids of a frame that carries no logprobs for it to :attr:`step_tokens` when that is
    set too (no RouterDelta built)."""

    on_delta: Callable[[RouterDelta], None] | None = None
    step_tokens: Callable[[list[int]], None] | None = None

    def deliver(self, item: _Item) -> None:
        if self.on_delta is not None and isinstance(item, RouterDelta):
            self.on_delta(item)
            return
        self.put_nowait(item)


class RouterSessionLink(SessionLink[router_pb2.SessionRequest, router_pb2.SessionResponse, RequestEvents]):
    """One Session call to one router replica and the requests it carries."""

    tier = "router"
    field_prefixes = ROUTER_FIELD_PREFIXES
    ended_message = "router replica {replica}: session ended"
    closed_message = "router: session closed"

    @property
    def carried(self) -> int:
        """Requests this link still carries."""
        return len(self.requests)

    def submit(self, message: router_pb2.GenerateRequest, timeout: float | None,
               traceparent: str) -> tuple[int, RequestEvents]:
        """Start one request; its events arrive in the returned queue."""
        handle = self._allocate()
        queue = self.requests[handle] = RequestEvents()
        if timeout is not None:
            timeout = max(timeout, 0.001)  # 0 would mean "no deadline" on the wire
        self._pending.submit.append(router_pb2.SessionSubmit(
            handle=handle, request=message, timeout_s=timeout or 0.0, traceparent=traceparent,
        ))
        self._schedule()
        return handle, queue

    def abort(self, handle: int) -> None:
        """Stop a request (it was left before its final); nothing more arrives for it."""
        if self.requests.pop(handle, None) is not None and not self.broken:
            self._pending.abort.append(handle)
            self._schedule()

    # -- internals -------------------------------------------------------------------
    def _open(self, opener: SessionOpener, messages: AsyncIterator[router_pb2.SessionRequest]) -> Any:
        stub = router_pb2_grpc.RouterServiceStub(opener.channel)
        return opener.open(SESSION_METHOD, stub.Session, messages, router_pb2.SessionResponse,
                           awaiting=self.awaiting)

    def _new_message(self) -> router_pb2.SessionRequest:
        return router_pb2.SessionRequest()

    def _dispatch(self, frame: router_pb2.SessionResponse) -> None:
        queues = self.requests
        logprobs = {entry.handle: entry.logprobs for entry in frame.logprobs} if frame.logprobs else None
        token_ids = list(frame.token_ids)  # plain ints once, sliced per request
        offset = 0
        for handle, count in zip(frame.handles, frame.token_counts, strict=True):
            end = offset + count
            queue = queues.get(handle)
            if queue is not None:  # else aborted by us: late tokens are dropped
                entries = logprobs.get(handle) if logprobs else None
                step_tokens = queue.step_tokens
                if step_tokens is not None and not entries:
                    step_tokens(token_ids[offset:end])
                else:
                    queue.deliver(RouterDelta(
                        token_ids=token_ids[offset:end],
                        logprobs=convert.logprobs_from_common(entries) if entries else [],
                    ))
            offset = end
        for final in frame.finals:
            self._finish(final.handle, generation_convert.router_final_from_proto(final.final))
        for failure in frame.errors:
            self._finish(failure.handle,
                         request_error(failure.error, tier="router", strip=ROUTER_FIELD_PREFIXES))


class SessionRouterTier(GrpcRouterTier):
    """Router replicas reached through one Session call each (Abort by id stays unary)."""

    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        super().__init__(targets, tls, server_name)
        self.links = ReplicaLinks(RouterSessionLink, self.targets, tls, server_name)

    @property
    def links_opened(self) -> int:
        return self.links.opened

    def link(self, replica: int) -> RouterSessionLink:
        """The replica's Session call, opened now if there is none or it broke."""
        return self.links.current(replica)

    async def generate(
        self, replica: int, request: TokenGeneration, *, resume_token_ids: list[int],
        resumed: int, timeout: float | None,
        on_delta: Callable[[RouterDelta], None] | None = None,
    ) -> AsyncIterator[RouterDelta | RouterFinal]:
        if timeout is not None and not math.isfinite(timeout):
            timeout = None
        if not self.links.uses_calls(replica):
            started = time.monotonic()
            try:
                # Closed with this generator, so leaving early aborts the request at once.
                async with contextlib.aclosing(
                    self._over_session(replica, request, resume_token_ids, resumed, timeout, on_delta)
                ) as events:
                    async for item in events:
                        yield item
                return
            except NoSession:
                # The call failed before its first frame, so nothing of this request
                # reached the caller: it runs again over a Generate call, unnoticed.
                if timeout is not None:
                    timeout -= time.monotonic() - started
                    if timeout <= 0:
                        raise errors.DeadlineExceeded("router: deadline passed") from None
        async for item in super().generate(replica, request, resume_token_ids=resume_token_ids,
                                           resumed=resumed, timeout=timeout, on_delta=on_delta):
            yield item

    async def _over_session(
        self, replica: int, request: TokenGeneration, resume_token_ids: list[int], resumed: int,
        timeout: float | None, on_delta: Callable[[RouterDelta], None] | None,
    ) -> AsyncGenerator[RouterDelta | RouterFinal, None]:
        """One request over the replica's Session call; raises :class:`NoSession` when the
        replica turns out to have none."""
        message = convert.router_generate_request(request, resume_token_ids, resumed)
        link = self.link(replica)
        handle, queue = link.submit(message, timeout, current_traceparent())  # this request's span
        queue.on_delta = on_delta
        # A TokenSink-like on_delta (see gateway.core.RouterTier.generate) takes plain ids.
        queue.step_tokens = getattr(on_delta, "step_tokens", None) if on_delta is not None else None
        # The router enforces the deadline (and answers DEADLINE_EXCEEDED); this timer is
        # the guard for a router that stops answering without breaking the call.
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_at(
                asyncio.get_running_loop().time() + max(timeout, 0.0) + 0.5, queue.put_nowait,
                errors.DeadlineExceeded("router: deadline passed"),
            )
        try:
            while True:
                item = await queue.get()
                if isinstance(item, errors.LlmeshError):
                    raise item
                yield item
                if isinstance(item, RouterFinal):
                    return
        finally:
            if timer is not None:
                timer.cancel()
            # Left before the router ended the request (cancelled, closed, our deadline
            # guard): abort it there. A no-op once its final or error arrived.
            link.abort(handle)

    async def close(self) -> None:
        await self.links.close()
        await super().close()

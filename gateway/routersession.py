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
  the next request opens a new call;
- leaving ``generate()`` before the final (cancelled, closed) aborts the request by handle.

The Session calls go over channels without the tracing interceptor: one span for a call
that lives as long as the gateway would say nothing; instead each submission carries the
W3C ``traceparent`` of the request's current span, and the router starts the request's
span under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import math
from collections.abc import AsyncIterator, Sequence

import grpc
from opentelemetry import propagate

from gateway import convert
from gateway.core import TierUnavailable
from gateway.tiers import ROUTER_FIELD_PREFIXES, GrpcRouterTier, domain_error
from gateway.types import RouterDelta, RouterFinal, TokenGeneration
from llmesh.common.v1 import common_pb2
from llmesh.router.v1 import router_pb2, router_pb2_grpc
from services.common import errors
from services.common.channels import broken_link, create_channel
from services.common.settings import TlsSettings

log = logging.getLogger(__name__)

_Item = RouterDelta | RouterFinal | errors.LlmeshError

_TRANSPORT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}
"""A request failing with one of these moves to another replica (as a Generate call's would)."""

_REFUSED_CODES = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                  grpc.StatusCode.UNIMPLEMENTED}
"""A Session call ended with one of these was refused, not broken: another replica would
refuse the same way, so the requests fail with the error instead of moving."""


def request_error(proto: common_pb2.RequestError) -> errors.LlmeshError:
    """The domain error of one refused request, as a Generate call's status would give it
    (see :func:`gateway.tiers.domain_error`): public field paths, RetryInfo delay kept."""
    code, mapped = errors.request_error_from_proto(proto, field_prefixes=ROUTER_FIELD_PREFIXES)
    message = proto.message or code.name
    if code in _TRANSPORT_CODES or (code is grpc.StatusCode.INTERNAL and broken_link(message)):
        return TierUnavailable(f"router: {message}")
    if not isinstance(mapped, errors.InvalidArgument | errors.ResourceExhausted):
        mapped.message = f"router: {mapped.message}"
        mapped.args = (mapped.message,)
    return mapped


class RouterSessionLink:
    """One Session call to one router replica and the requests it carries."""

    def __init__(self, stub: router_pb2_grpc.RouterServiceStub, replica: int) -> None:
        self.replica = replica
        self.broken = False
        self._outbox: asyncio.Queue[router_pb2.SessionRequest | None] = asyncio.Queue()
        self._submits: list[router_pb2.SessionSubmit] = []
        self._aborts: list[int] = []
        self._flush_scheduled = False
        self._queues: dict[int, asyncio.Queue[_Item]] = {}
        self._handles = itertools.count(1)
        self.frames_received = 0
        self._call = stub.Session(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    @property
    def carried(self) -> int:
        """Requests this link still carries."""
        return len(self._queues)

    def submit(self, message: router_pb2.GenerateRequest, timeout: float | None,
               traceparent: str) -> tuple[int, asyncio.Queue[_Item]]:
        """Start one request; its events arrive in the returned queue."""
        handle = next(self._handles) & 0xFFFFFFFF
        while handle in self._queues or handle == 0:
            handle = next(self._handles) & 0xFFFFFFFF
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._queues[handle] = queue
        if timeout is not None:
            timeout = max(timeout, 0.001)  # 0 would mean "no deadline" on the wire
        self._submits.append(router_pb2.SessionSubmit(
            handle=handle, request=message, timeout_s=timeout or 0.0, traceparent=traceparent,
        ))
        self._schedule()
        return handle, queue

    def abort(self, handle: int) -> None:
        """Stop a request (it was left before its final); nothing more arrives for it."""
        if self._queues.pop(handle, None) is not None and not self.broken:
            self._aborts.append(handle)
            self._schedule()

    async def close(self) -> None:
        self._fail(TierUnavailable("router: session closed"))
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader

    # -- internals -------------------------------------------------------------------
    def _schedule(self) -> None:
        # Everything asked for in this tick goes out as one message.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.broken or not (self._submits or self._aborts):
            return
        self._outbox.put_nowait(router_pb2.SessionRequest(submit=self._submits, abort=self._aborts))
        self._submits, self._aborts = [], []

    async def _requests(self) -> AsyncIterator[router_pb2.SessionRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        error: errors.LlmeshError = TierUnavailable(f"router replica {self.replica}: session ended")
        try:
            async for frame in self._call:
                self.frames_received += 1
                self._dispatch(frame)
        except grpc.aio.AioRpcError as err:
            if err.code() in _REFUSED_CODES:
                error = domain_error(err, tier="router", strip=ROUTER_FIELD_PREFIXES)
            else:
                error = TierUnavailable(f"router: {err.details() or err.code().name}")
        except asyncio.CancelledError:
            error = TierUnavailable("router: session closed")
            raise
        finally:
            self._fail(error)

    def _dispatch(self, frame: router_pb2.SessionResponse) -> None:
        queues = self._queues
        logprobs = {entry.handle: entry.logprobs for entry in frame.logprobs} if frame.logprobs else {}
        token_ids = frame.token_ids
        offset = 0
        for handle, count in zip(frame.handles, frame.token_counts, strict=True):
            end = offset + count
            queue = queues.get(handle)
            if queue is not None:  # else aborted by us: late tokens are dropped
                entries = logprobs.get(handle)
                queue.put_nowait(RouterDelta(
                    token_ids=list(token_ids[offset:end]),
                    logprobs=convert.logprobs_from_common(entries) if entries else [],
                ))
            offset = end
        for final in frame.finals:
            queue = queues.pop(final.handle, None)
            if queue is not None:
                queue.put_nowait(convert.router_final(final.final))
        for failure in frame.errors:
            queue = queues.pop(failure.handle, None)
            if queue is not None:
                queue.put_nowait(request_error(failure.error))

    def _fail(self, error: errors.LlmeshError) -> None:
        """The call is over: every request it still carries ends with ``error``."""
        self.broken = True
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(error)


class SessionRouterTier(GrpcRouterTier):
    """Router replicas reached through one Session call each (Abort by id stays unary)."""

    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        super().__init__(targets, tls, server_name)
        # Untraced: each submission carries its own trace context (module docstring).
        self.session_channels = [
            create_channel(t, tls=tls, server_name_override=server_name, interceptors=[])
            for t in self.targets
        ]
        self.session_stubs = [router_pb2_grpc.RouterServiceStub(c) for c in self.session_channels]
        self.links: list[RouterSessionLink | None] = [None] * len(self.targets)
        self.links_opened = 0

    def link(self, replica: int) -> RouterSessionLink:
        """The replica's Session call, opened now if there is none or it broke."""
        index = replica % self.replicas
        current = self.links[index]
        if current is None or current.broken:
            if current is not None:
                log.info("router replica %d: session broke; opening a new one", index)
            # Opened in an empty context: the call and its reader serve every request, so
            # they must not carry this request's span or log fields.
            current = contextvars.Context().run(RouterSessionLink, self.session_stubs[index], index)
            self.links[index] = current
            self.links_opened += 1
        return current

    async def generate(
        self, replica: int, request: TokenGeneration, *, resume_token_ids: list[int],
        resumed: int, timeout: float | None,
    ) -> AsyncIterator[RouterDelta | RouterFinal]:
        message = router_pb2.GenerateRequest(
            request=convert.token_request(request), resume_token_ids=resume_token_ids, resumed=resumed,
            tenant=request.tenant,
        )
        if timeout is not None and not math.isfinite(timeout):
            timeout = None
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the current span of this request
        link = self.link(replica)
        handle, queue = link.submit(message, timeout, carrier.get("traceparent", ""))
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
        for link in self.links:
            if link is not None:
                await link.close()
        for channel in self.session_channels:
            await channel.close()
        await super().close()

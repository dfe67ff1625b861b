"""The in-process router called directly (``router_transport: local``).

With router_transport ``local`` the gateway runs the router tier's own server in its
event loop (:class:`gateway.server.LocalRouter`: health checks of the workers, breakers,
zone failover, batching windows, admission, its metrics and its gRPC port for readiness
and Abort). :class:`LocalRouterTier` is how the gateway's core reaches it: it calls that
server's :class:`~services.router.core.Router` in this process, so a request is a call
and its tokens a callback, with nothing serialized, written to a loopback socket, read
back by the same process's gRPC poller thread and parsed again on the way.

Per engine step the worker link's reader hands each request's new token ids to the
router core, which hands them on to the gateway's stream (``on_delta`` /
``step_tokens``, see :meth:`gateway.core.RouterTier.generate`) in the same callback:
no router frame is built and no task wakes per token. Each request still runs the
router's code in a task of its own (as a router Session runs it), with the router's
rules: its deadline (DEADLINE_EXCEEDED, the worker request aborted), abort by id and on
leaving early, retry and resume across workers, a span of its own under the request's
span, and the router's per-request metrics. Errors are the ones the router's answer over
a Session gives the gateway (field violations with the public field paths, UNAVAILABLE
as the tier being unavailable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable

from opentelemetry import trace

from gateway.convert import token_request_of
from gateway.tiers import ROUTER_FIELD_PREFIXES, request_error
from gateway.types import RouterDelta, RouterFinal, TokenGeneration, TokenLogprob, TopLogprob
from services.common import errors
from services.common.generation import Delta
from services.common.generation import TokenLogprob as EngineLogprob
from services.common.metrics import record_request
from services.common.tracing import tracer
from services.router.core import Router, RouteRequest
from services.router.session import RouterSession

log = logging.getLogger(__name__)

_Item = RouterDelta | RouterFinal | BaseException


def route_request(request: TokenGeneration, resume_token_ids: list[int], resumed: int) -> RouteRequest:
    """One generation (or its resumption after ``resume_token_ids``) as the router core
    takes it: the domain form of the router's GenerateRequest."""
    return RouteRequest(request=token_request_of(request), resume_token_ids=tuple(resume_token_ids),
                        resumed=resumed, tenant=request.tenant)


def _logprobs(items: list[EngineLogprob] | None) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=i.token_id, logprob=i.logprob,
                         top=tuple(TopLogprob(t, p) for t, p in i.top)) for i in items or ()]


def _router_delta(delta: Delta) -> RouterDelta:
    return RouterDelta(token_ids=delta.token_ids, logprobs=_logprobs(delta.logprobs))


def router_error(exc: BaseException) -> errors.LlmeshError:
    """The error the gateway gets for a request the router failed with ``exc``: exactly
    what the router's answer over a Session would give (the same mapping, through the
    request's error as a Session frame carries it; errors only, never per token)."""
    return request_error(errors.request_error_to_proto(exc), tier="router", strip=ROUTER_FIELD_PREFIXES)


class LocalRouterTier:
    """The router tier as the one in-process replica (the gateway's RouterTier)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    @property
    def replicas(self) -> int:
        return 1

    async def generate(
        self, replica: int, request: TokenGeneration, *, resume_token_ids: list[int],
        resumed: int, timeout: float | None,
        on_delta: Callable[[RouterDelta], None] | None = None,
    ) -> AsyncGenerator[RouterDelta | RouterFinal, None]:
        if timeout is not None and not math.isfinite(timeout):
            timeout = None
        route = route_request(request, resume_token_ids, resumed)
        events: asyncio.Queue[_Item] = asyncio.Queue()
        # In a task of its own, as a router Session runs a request: the router's span is
        # current there only (the task has a copy of this context), and the worker link's
        # reader hands it the tokens without this generator's task waking.
        task = asyncio.ensure_future(self._run(route, timeout, events, on_delta))
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, RouterFinal):
                    return
        finally:
            # Left before the router ended the request (cancelled, closed): closing the
            # router's generation in its task aborts the worker request.
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _run(self, route: RouteRequest, timeout: float | None, events: asyncio.Queue[_Item],
                   on_delta: Callable[[RouterDelta], None] | None) -> None:
        deliver: Callable[[Delta], None] | None = None
        deliver_tokens: Callable[[list[int]], None] | None = None
        if on_delta is not None:
            sink = on_delta

            def deliver(delta: Delta) -> None:
                sink(_router_delta(delta))

            # A TokenSink-like on_delta takes plain ids (see gateway.core.RouterTier.generate).
            deliver_tokens = getattr(on_delta, "step_tokens", None) or (lambda ids: sink(RouterDelta(ids)))
        start = time.perf_counter()
        code = "CANCELLED"
        with tracer().start_as_current_span(
            "llmesh.router/generate", kind=trace.SpanKind.INTERNAL,
            attributes={"llmesh.request_id": route.request.request_id},
        ):
            try:
                # Closing the core's generation (the timeout, or a cancel) aborts the worker request.
                async with asyncio.timeout(timeout):
                    generation = self.router.generate(route, timeout, deliver, deliver_tokens)
                    async with contextlib.aclosing(generation) as stream:
                        async for event in stream:
                            events.put_nowait(_router_delta(event) if isinstance(event, Delta) else event)
                code = "OK"
            except TimeoutError:
                code = "DEADLINE_EXCEEDED"
                events.put_nowait(router_error(errors.DeadlineExceeded(RouterSession.deadline_message)))
            except Exception as exc:
                if not isinstance(exc, errors.LlmeshError):
                    log.exception("in-process router: request %s failed", route.request.request_id)
                code = errors.map_exception(exc).code.name
                events.put_nowait(router_error(exc))
            finally:
                record_request("router", "Generate", code, time.perf_counter() - start, transport="local")

    async def abort(self, replica: int, request_id: str) -> None:
        await self.router.abort(request_id)

    async def close(self) -> None:
        """Nothing of its own: the router is the in-process server's, stopped after the gateway."""

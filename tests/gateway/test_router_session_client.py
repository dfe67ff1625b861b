"""SessionRouterTier against a scripted RouterService.Session, over a real channel.

What the client itself promises: one call per replica, submissions of one tick in one
message, frames split per request, RequestErrors raised as the Generate call's domain
errors, a broken call failing every request it carried with TierUnavailable (and the
next request opening a new call), an abort for a request left early, and the traceparent
and deadline of each request on its submission. A rolling upgrade: a router without
Session gets Generate calls (none of its requests fails or moves) until Session is asked
again; a whole Session refused fails its requests with the refusal, any other failure of
it is a broken link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider

from gateway import sessionlink
from gateway.core import TierUnavailable
from gateway.routersession import SessionRouterTier
from gateway.types import FinishReason, RouterDelta, RouterFinal, Sampling, TokenGeneration
from llmesh.common.v1 import common_pb2
from llmesh.router.v1 import router_pb2, router_pb2_grpc
from services.common import errors
from tests.router.helpers import wait_for

OK, BAD, BUSY, NO_WORKER, HANG, BREAK = 1, 2, 3, 4, 5, 6
"""What the scripted router does with a submission, by its first prompt token."""


def _final() -> router_pb2.RouterFinal:
    return router_pb2.RouterFinal(
        final=common_pb2.TokenFinal(finish_reason=common_pb2.ENGINE_FINISH_REASON_LENGTH,
                                    completion_tokens=3),
        served_by=router_pb2.ServedBy(worker_id="w", zone="zone-a"))


class ScriptedRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.messages: list[router_pb2.SessionRequest] = []
        self.sessions = 0
        self.generates = 0
        """Generate calls (the calls transport), each an OK request."""
        self.has_session = True
        """False: answer Session with UNIMPLEMENTED, as a release before it does."""
        self.refuse_with: grpc.StatusCode | None = None
        """End every Session at once with this code, as an authorization interceptor does."""
        self.break_with: grpc.StatusCode | None = None
        """End a Session with this code when its first message arrives (one that writes
        nothing still ends OK: this router has Session)."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.generates += 1
        if request.request.prompt_token_ids[0] != OK:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scripted: OK requests only")
        yield router_pb2.GenerateResponse(delta=common_pb2.TokenDelta(token_ids=[0, 100, 200]))
        yield router_pb2.GenerateResponse(final=_final())

    async def Session(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self.sessions += 1
        if not self.has_session:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        if self.refuse_with is not None:
            await context.abort(self.refuse_with, "refused")
        if self.break_with is not None:
            async for _ in request_iterator:
                await context.abort(self.break_with, "session failed")
            return
        out: asyncio.Queue[router_pb2.SessionResponse | None] = asyncio.Queue()

        async def read() -> None:
            async for message in request_iterator:
                self.messages.append(message)
                frame = router_pb2.SessionResponse()
                for sub in message.submit:
                    kind = sub.request.request.prompt_token_ids[0]
                    if kind == OK:
                        frame.handles.append(sub.handle)
                        frame.token_counts.append(3)
                        frame.token_ids.extend([sub.handle, 100, 200])
                        frame.logprobs.append(router_pb2.SessionLogprobs(
                            handle=sub.handle, logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=-0.5)
                                                         for t in (sub.handle, 100, 200)]))
                        frame.finals.append(router_pb2.SessionFinal(handle=sub.handle, final=_final()))
                    elif kind in (BAD, BUSY, NO_WORKER):
                        error = {
                            BAD: errors.InvalidArgument("request.sampling.temperature", "too hot"),
                            BUSY: errors.ResourceExhausted("queue full", retry_after_s=2.5),
                            NO_WORKER: errors.Unavailable("no worker can serve"),
                        }[kind]
                        frame.errors.append(router_pb2.SessionError(
                            handle=sub.handle, error=errors.request_error_to_proto(error)))
                    elif kind == BREAK:
                        await out.put(None)
                if frame.ByteSize():
                    await out.put(frame)

        reader = asyncio.ensure_future(read())
        try:
            while (frame := await out.get()) is not None:
                yield frame
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router going away")
        finally:
            reader.cancel()


@pytest.fixture
async def tier() -> AsyncIterator[tuple[SessionRouterTier, ScriptedRouter]]:
    router = ScriptedRouter()
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = SessionRouterTier([f"127.0.0.1:{port}"])
    yield client, router
    await client.close()
    await server.stop(0)


def generation(kind: int, request_id: str = "r") -> TokenGeneration:
    return TokenGeneration(request_id=request_id, model="m", prompt_token_ids=[kind, 7],
                           sampling=Sampling(max_tokens=3))


async def run(client: SessionRouterTier, kind: int, *, timeout: float | None = None,
              request_id: str = "r") -> list[RouterDelta | RouterFinal]:
    return [event async for event in client.generate(
        0, generation(kind, request_id), resume_token_ids=[], resumed=0, timeout=timeout)]


async def test_requests_of_one_tick_share_a_message_and_get_their_tokens(tier) -> None:  # type: ignore[no-untyped-def]
    client, router = tier
    results = await asyncio.gather(*(run(client, OK, request_id=f"r{i}") for i in range(8)))
    assert router.sessions == 1 and len(router.messages) == 1
    assert len(router.messages[0].submit) == 8
    for events in results:
        delta, final = events
        assert isinstance(delta, RouterDelta) and isinstance(final, RouterFinal)
        assert delta.token_ids[1:] == [100, 200]
        assert [lp.token_id for lp in delta.logprobs] == delta.token_ids
        assert final.final.finish_reason is FinishReason.LENGTH and final.served_by.worker_id == "w"
    assert len({events[0].token_ids[0] for events in results}) == 8  # one handle each
    # The next requests reuse the same call.
    await run(client, OK)
    assert router.sessions == 1 and client.links_opened == 1


async def test_request_errors_are_the_domain_errors_of_a_generate_call(tier) -> None:  # type: ignore[no-untyped-def]
    client, router = tier
    with pytest.raises(errors.InvalidArgument) as bad:
        await run(client, BAD)
    assert bad.value.field == "sampling.temperature"  # the public path
    with pytest.raises(errors.ResourceExhausted) as busy:
        await run(client, BUSY)
    assert busy.value.retry_after_s == 2.5
    with pytest.raises(TierUnavailable):  # as a Generate call's UNAVAILABLE: try another replica
        await run(client, NO_WORKER)
    assert await run(client, OK)  # the session goes on
    assert router.sessions == 1


async def test_a_broken_call_fails_every_request_and_the_next_opens_a_new_one(tier) -> None:  # type: ignore[no-untyped-def]
    client, router = tier
    hanging = [asyncio.ensure_future(run(client, HANG, request_id=f"h{i}")) for i in range(3)]
    await wait_for(lambda: sum(len(m.submit) for m in router.messages) == 3)
    breaker = asyncio.ensure_future(run(client, BREAK))
    for task in [*hanging, breaker]:
        with pytest.raises(TierUnavailable):
            await task
    assert await run(client, OK)
    assert router.sessions == 2 and client.links_opened == 2


async def test_leaving_early_aborts_and_submissions_carry_deadline_and_trace(tier) -> None:  # type: ignore[no-untyped-def]
    client, router = tier
    provider = TracerProvider()
    with provider.get_tracer("test").start_as_current_span("client") as span:
        task = asyncio.ensure_future(run(client, HANG, timeout=30.0))
        await wait_for(lambda: router.messages)
    sub = router.messages[0].submit[0]
    assert 29 < sub.timeout_s <= 30
    trace_id = f"{span.get_span_context().trace_id:032x}"
    assert sub.traceparent.split("-")[1] == trace_id
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await wait_for(lambda: any(m.abort for m in router.messages))
    assert [h for m in router.messages for h in m.abort] == [sub.handle]
    # A request without a deadline sends 0; a finished one is never aborted.
    await run(client, OK)
    assert router.messages[-1].submit[0].timeout_s == 0
    assert [h for m in router.messages for h in m.abort] == [sub.handle]


def _assert_ok(events: list[RouterDelta | RouterFinal]) -> None:
    delta, final = events
    assert isinstance(delta, RouterDelta) and delta.token_ids[1:] == [100, 200]
    assert isinstance(final, RouterFinal) and final.final.finish_reason is FinishReason.LENGTH


async def test_a_router_without_session_gets_generate_calls_until_it_is_asked_again(  # type: ignore[no-untyped-def]
    tier, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A rolling upgrade: the router is a release without Session. The requests sent into
    the failed Session run again over Generate calls (none fails, none would move to another
    replica), the router gets calls until the retry time, then is asked for a Session again."""
    client, router = tier
    monkeypatch.setattr(sessionlink, "SESSION_RETRY_S", 1.0)
    caplog.set_level(logging.WARNING, logger="gateway.sessionlink")
    router.has_session = False
    for events in await asyncio.gather(*(run(client, OK, request_id=f"r{i}") for i in range(6))):
        _assert_ok(events)
    assert router.generates == 6  # each ran once, over a call
    assert router.sessions == 2  # the session, and the one that asked why it failed
    warnings = [r.getMessage() for r in caplog.records if "has no Session" in r.getMessage()]
    assert len(warnings) == 1 and client.targets[0] in warnings[0], warnings
    # Calls until the retry time, without asking again.
    _assert_ok(await run(client, OK))
    assert router.generates == 7 and router.sessions == 2 and client.links_opened == 1
    # Upgraded meanwhile: after the retry time the next request opens a Session again.
    router.has_session = True
    await wait_for(lambda: not client.links.uses_calls(0))
    _assert_ok(await run(client, OK))
    assert router.generates == 7 and router.sessions == 3 and client.links_opened == 2
    assert router.messages  # and that one went over the Session


@pytest.mark.parametrize(("knob", "code", "raised"), [
    # Refused: another replica would refuse the same, so the requests fail with it (the
    # refusal may reach the client as INTERNAL; the Session that writes nothing gets it).
    ("refuse_with", grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
    ("refuse_with", grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    # The router has Session: the call's own failure is a broken link (failover/resume).
    ("break_with", grpc.StatusCode.UNIMPLEMENTED, TierUnavailable),
    ("break_with", grpc.StatusCode.INTERNAL, TierUnavailable),
    ("break_with", grpc.StatusCode.RESOURCE_EXHAUSTED, TierUnavailable),
    ("break_with", grpc.StatusCode.UNAVAILABLE, TierUnavailable),
])
async def test_a_whole_session_failure_is_a_refusal_or_a_broken_link(  # type: ignore[no-untyped-def]
    tier, knob: str, code: grpc.StatusCode, raised: type[Exception],
) -> None:
    client, router = tier
    setattr(router, knob, code)
    results = await asyncio.gather(*(run(client, OK, request_id=f"r{i}") for i in range(3)),
                                   return_exceptions=True)
    assert [type(r) for r in results] == [raised] * 3, results  # NoSession is none of them
    if raised is not TierUnavailable:
        assert all(str(r).startswith("router: ") for r in results)
    assert router.generates == 0 and not client.links.uses_calls(0)  # nothing went over calls

"""The gateway's in-process router called directly (:class:`gateway.localrouter.LocalRouterTier`).

A real router (services/router) over WorkerService doubles, reached once through the
direct link and once through a router Session over its gRPC port (what
``router_transport: session`` uses): the same tokens, finals and errors, the router's
deadline, abort by id and on leaving early, its span under the caller's, its metrics, and
no Session call on the router's port.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from gateway.localrouter import LocalRouterTier
from gateway.routersession import SessionRouterTier
from gateway.types import FinishReason, RouterDelta, RouterFinal, TokenGeneration
from services.common import errors
from services.common.sampling import Sampling
from tests.router.fakeworker import FakeWorker, RunningFake, next_token, start_fake
from tests.router.helpers import RouterUnderTest, start_router, wait_for

MODEL = "fake-model"


def expected_tokens(prompt: Sequence[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def generation(prompt: Sequence[int], max_tokens: int = 8, request_id: str = "r", **sampling: Any
               ) -> TokenGeneration:
    return TokenGeneration(request_id=request_id, model=MODEL, prompt_token_ids=list(prompt),
                           sampling=Sampling(**{"max_tokens": max_tokens, "temperature": 0.0, **sampling}))


class Sink:
    """An on_delta as the gateway's stream passes it: deltas, and plain token ids of a step."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.deltas = 0
        self.steps = 0

    def __call__(self, delta: RouterDelta) -> None:
        self.deltas += 1
        self.tokens.extend(delta.token_ids)

    def step_tokens(self, token_ids: list[int]) -> None:
        self.steps += 1
        self.tokens.extend(token_ids)


async def run(tier: Any, request: TokenGeneration, *, timeout: float | None = 10.0, sink: Any = None,
              resume: Sequence[int] = (), resumed: int = 0) -> tuple[list[int], RouterFinal]:
    tokens: list[int] = []
    final = None
    async for item in tier.generate(0, request, resume_token_ids=list(resume), resumed=resumed,
                                    timeout=timeout, on_delta=sink):
        if isinstance(item, RouterDelta):
            tokens.extend(item.token_ids)
        else:
            final = item
    assert final is not None
    return (sink.tokens if sink is not None else tokens), final


@pytest.fixture
async def mesh() -> AsyncIterator[tuple[RouterUnderTest, RunningFake]]:
    fake = await start_fake(FakeWorker(token_delay_s=0.002))
    rut = await start_router([(fake.address, "zone-a")])
    try:
        yield rut, fake
    finally:
        await rut.close()
        await fake.stop()


@pytest.fixture
async def both(mesh: tuple[RouterUnderTest, RunningFake]) -> AsyncIterator[tuple[LocalRouterTier,
                                                                                SessionRouterTier]]:
    """The direct link to the mesh's router, and a router Session to its port."""
    rut, _ = mesh
    remote = SessionRouterTier([f"127.0.0.1:{rut.server.port}"])
    try:
        yield LocalRouterTier(rut.router), remote
    finally:
        await remote.close()


def _requests(code: str, transport: str = "local") -> float:
    value = REGISTRY.get_sample_value("llmesh_rpc_requests_total", {
        "tier": "router", "method": "Generate", "code": code, "transport": transport})
    return value or 0.0


async def test_tokens_and_final_as_over_a_session(both: tuple[LocalRouterTier, SessionRouterTier]) -> None:
    local, remote = both
    before, before_session = _requests("OK"), _requests("OK", "session")
    prompt = [5, 6, 7]
    sink = Sink()
    mine, final = await run(local, generation(prompt, 12, "direct-1"), sink=sink)
    # The steady state: plain token ids of each step, no RouterDelta built.
    assert mine == expected_tokens(prompt, 12) and sink.steps >= 1 and sink.deltas == 0
    # Without an on_delta the deltas are yielded.
    yielded, _ = await run(local, generation(prompt, 12, "direct-2"))
    theirs, their_final = await run(remote, generation(prompt, 12, "session-1"), sink=Sink())
    assert yielded == theirs == mine
    assert final.final.finish_reason is their_final.final.finish_reason is FinishReason.LENGTH
    assert final.final.completion_tokens == their_final.final.completion_tokens == 12
    assert final.served_by.worker_id == their_final.served_by.worker_id
    # Resume after tokens an earlier router delivered: the rest of the same text.
    rest, _ = await run(local, generation(prompt, 12, "direct-3"), sink=Sink(), resume=mine[:5],
                        resumed=5)
    assert rest == mine[5:]
    # Counted as the router's requests, the direct ones as in this process: the only
    # request the router's Session served is the session tier's.
    assert _requests("OK") - before == 3
    assert _requests("OK", "session") - before_session == 1


async def test_a_worker_refusal_is_the_error_a_session_gives(
    both: tuple[LocalRouterTier, SessionRouterTier],
) -> None:
    local, remote = both
    refused = generation([1, 2], 4, temperature=3.0)
    with pytest.raises(errors.InvalidArgument) as mine:
        await run(local, refused, sink=Sink())
    with pytest.raises(errors.InvalidArgument) as theirs:
        await run(remote, refused, sink=Sink())
    # The public field path (the router's "request." stripped), as over the wire.
    assert [(v.field, v.description) for v in mine.value.violations] == [
        (v.field, v.description) for v in theirs.value.violations]
    assert mine.value.violations[0].field == "sampling.temperature"
    assert str(mine.value) == str(theirs.value)
    # The tier stays usable.
    tokens, _ = await run(local, generation([1, 2], 4), sink=Sink())
    assert tokens == expected_tokens([1, 2], 4)


async def test_the_deadline_ends_the_request_and_aborts_it_on_the_worker(
    mesh: tuple[RouterUnderTest, RunningFake],
) -> None:
    rut, fake = mesh
    fake.worker.token_delay_s = 0.05
    local = LocalRouterTier(rut.router)
    with pytest.raises(errors.DeadlineExceeded, match="router: the request's deadline passed on the router"):
        await run(local, generation([3, 4], 200, "late"), timeout=0.3, sink=Sink())
    await wait_for(lambda: "late" not in fake.worker.running)
    assert _requests("DEADLINE_EXCEEDED") >= 1


async def test_leaving_early_and_abort_by_id_stop_the_worker_request(
    mesh: tuple[RouterUnderTest, RunningFake],
) -> None:
    rut, fake = mesh
    fake.worker.token_delay_s = 0.02
    local = LocalRouterTier(rut.router)
    # Leaving before the final (the client went away): the worker request is aborted.
    sink = Sink()
    stream = local.generate(0, generation([8, 9], 500, "left"), resume_token_ids=[], resumed=0,
                            timeout=30.0, on_delta=sink)
    first = asyncio.ensure_future(anext(stream))
    await wait_for(lambda: len(sink.tokens) >= 2)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    await stream.aclose()
    await wait_for(lambda: "left" not in fake.worker.running)
    # Abort by id (the gateway's Abort): the request ends with finish reason ABORT.
    running = asyncio.ensure_future(run(local, generation([8, 9], 500, "by-id"), timeout=30.0, sink=Sink()))
    await wait_for(lambda: "by-id" in fake.worker.running)
    await local.abort(0, "by-id")
    _, final = await asyncio.wait_for(running, 10)
    assert final.final.finish_reason is FinishReason.ABORT
    await wait_for(lambda: "by-id" not in fake.worker.running)


async def test_the_router_span_is_under_the_callers_and_reaches_the_worker(
    mesh: tuple[RouterUnderTest, RunningFake], monkeypatch: pytest.MonkeyPatch,
) -> None:
    rut, fake = mesh
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr("services.common.tracing.tracer", lambda: provider.get_tracer("test"))
    monkeypatch.setattr("gateway.localrouter.tracer", lambda: provider.get_tracer("test"))
    local = LocalRouterTier(rut.router)
    with provider.get_tracer("test").start_as_current_span("gateway request") as caller:
        await run(local, generation([2, 3], 4, "traced"), sink=Sink())
        # The caller's context is its own again between and after the router's events.
        assert trace.get_current_span() is caller
    spans = {s.name: s for s in exporter.get_finished_spans()}
    router_span = spans["llmesh.router/generate"]
    assert router_span.parent is not None and router_span.parent.span_id == caller.get_span_context().span_id
    assert router_span.context.trace_id == caller.get_span_context().trace_id
    assert router_span.attributes is not None and router_span.attributes["llmesh.request_id"] == "traced"
    # The worker's submission carries the trace (its span is a child of the router's).
    traceparent = fake.worker.traceparents["traced"]
    assert traceparent.split("-")[1] == f"{caller.get_span_context().trace_id:032x}"

"""RouterService.Session over real channels: a real router over WorkerService doubles.

Many requests share one bidirectional call; each gets exactly the tokens a Generate call
gives it, refusals and aborts stay per handle, frames carry many handles, and closing
the session aborts the worker requests.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from llmesh.common.v1 import common_pb2
from llmesh.router.v1 import router_pb2
from services.common import errors
from services.common.generation import Delta, TokenRequest
from services.common.sampling import Sampling
from services.router import batching
from services.router import session as session_module
from services.router.breaker import Circuit
from services.router.core import RouteRequest
from services.worker.fake_engine import FakeModel, fake_greedy
from tests.router.fakeworker import FakeWorker, RunningFake, next_token, start_fake
from tests.router.helpers import request, start_router, wait_for
from tests.worker.conftest import RunningWorker, start_running_worker


def expected_tokens(prompt: Sequence[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def submit(handle: int, prompt: Sequence[int], max_tokens: int = 8, *, timeout_s: float = 0.0,
           traceparent: str = "", **fields: Any) -> router_pb2.SessionSubmit:
    return router_pb2.SessionSubmit(handle=handle, request=request(prompt, max_tokens, **fields),
                                    timeout_s=timeout_s, traceparent=traceparent)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    final: router_pb2.RouterFinal | None = None
    error: common_pb2.RequestError | None = None
    frames: int = 0
    """Frames that carried tokens of this handle."""


class SessionClient:
    """One Session call, written and read by hand."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.Session()
        self.outcomes: dict[int, Outcome] = {}
        self.frames: list[router_pb2.SessionResponse] = []

    async def send(
        self, submits: Sequence[router_pb2.SessionSubmit] = (), aborts: Sequence[int] = ()
    ) -> None:
        for s in submits:
            self.outcomes.setdefault(s.handle, Outcome())
        await self.call.write(router_pb2.SessionRequest(submit=list(submits), abort=list(aborts)))

    async def read_frame(self) -> router_pb2.SessionResponse:
        frame = await self.call.read()
        assert frame is not grpc.aio.EOF, "the session ended"
        self.frames.append(frame)
        offset = 0
        for handle, count in zip(frame.handles, frame.token_counts, strict=True):
            outcome = self.outcomes.setdefault(handle, Outcome())
            assert outcome.final is None and outcome.error is None, f"tokens after the end of {handle}"
            outcome.tokens += frame.token_ids[offset:offset + count]
            outcome.frames += 1
            offset += count
        assert offset == len(frame.token_ids)
        assert len(set(frame.handles)) == len(frame.handles), "a handle twice in one frame"
        for final in frame.finals:
            self.outcomes[final.handle].final = final.final
        for failure in frame.errors:
            self.outcomes[failure.handle].error = failure.error
        return frame

    def ended(self, handle: int) -> bool:
        outcome = self.outcomes.get(handle)
        return outcome is not None and (outcome.final is not None or outcome.error is not None)

    async def until_ended(self, handles: Sequence[int], timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while not all(self.ended(h) for h in handles):
                await self.read_frame()


async def fakes(*zones: str, **kwargs: Any) -> list[RunningFake]:
    return [await start_fake(FakeWorker(zone=z, worker_id=f"{z}-{i}", **kwargs)) for i, z in enumerate(zones)]


async def stop_all(rut: Any, workers: Sequence[RunningFake]) -> None:
    await rut.close()
    for worker in workers:
        await worker.stop()


def running(workers: Sequence[RunningFake]) -> int:
    return sum(len(w.worker.running) for w in workers)


async def test_interleaved_requests_get_exactly_the_tokens_of_generate_calls() -> None:
    workers = await fakes("zone-a", "zone-b")
    rut = await start_router([(w.address, w.worker.zone) for w in workers])
    try:
        prompts = {h: [3, h, h + 1] for h in range(1, 17)}
        lengths = {h: 4 + h % 7 for h in prompts}
        reference = {h: await rut.generate(prompts[h], lengths[h]) for h in prompts}
        client = SessionClient(rut.stub)
        # Submissions arrive in three messages while earlier requests already stream.
        await client.send([submit(h, prompts[h], lengths[h]) for h in range(1, 7)])
        await client.read_frame()
        await client.send([submit(h, prompts[h], lengths[h]) for h in range(7, 12)])
        await client.read_frame()
        await client.send([submit(h, prompts[h], lengths[h]) for h in range(12, 17)])
        await client.until_ended(list(prompts))
        for h, (tokens, final) in reference.items():
            outcome = client.outcomes[h]
            assert outcome.error is None
            assert outcome.tokens == tokens == expected_tokens(prompts[h], lengths[h])
            assert outcome.final is not None
            assert outcome.final.final.finish_reason == final.final.finish_reason
            assert outcome.final.final.completion_tokens == lengths[h]
            assert outcome.final.served_by.worker_id in {"zone-a-0", "zone-b-1"}
        # Handles are per session: a second session may reuse them.
        other = SessionClient(rut.stub)
        await other.send([submit(1, prompts[1], lengths[1])])
        await other.until_ended([1])
        assert other.outcomes[1].tokens == reference[1][0]
        client.call.cancel()
        other.call.cancel()
    finally:
        await stop_all(rut, workers)


async def test_one_bad_submission_fails_only_its_handle() -> None:
    workers = await fakes("zone-a")
    rut = await start_router([(workers[0].address, "zone-a")])
    def counted(code: str) -> float:
        labels = {"tier": "router", "method": "Generate", "code": code, "transport": "session"}
        return REGISTRY.get_sample_value("llmesh_rpc_requests_total", labels) or 0.0

    before = {code: counted(code) for code in ("OK", "INVALID_ARGUMENT")}
    try:
        client = SessionClient(rut.stub)
        await client.send([
            submit(1, [1, 2], 5),
            router_pb2.SessionSubmit(handle=2),  # no request at all
            router_pb2.SessionSubmit(handle=3, request=router_pb2.GenerateRequest(tenant="t")),
            submit(4, [1, 2], 3, temperature=5.0),  # the worker refuses it
            submit(5, [], 3),  # the router refuses an empty prompt
            submit(6, [4, 5], 6),
        ])
        await client.until_ended([1, 2, 3, 4, 5, 6])
        # Each request of the session counts as the Generate call it stands for.
        assert counted("OK") - before["OK"] == 2
        assert counted("INVALID_ARGUMENT") - before["INVALID_ARGUMENT"] == 4
        for handle, path in ((2, "request"), (3, "request"),
                             (4, "request.sampling.temperature"), (5, "request.prompt_token_ids")):
            error = client.outcomes[handle].error
            assert error is not None, handle
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert [v.field for v in error.field_violations] == [path]
            assert not client.outcomes[handle].tokens
        assert client.outcomes[1].tokens == expected_tokens([1, 2], 5)
        assert client.outcomes[6].tokens == expected_tokens([4, 5], 6)
        # The error round-trips into the same domain error a Generate call's status gives.
        error = client.outcomes[4].error
        assert error is not None
        _, back = errors.request_error_from_proto(error, field_prefixes=("request.",))
        assert isinstance(back, errors.InvalidArgument) and back.field == "sampling.temperature"
        client.call.cancel()
    finally:
        await stop_all(rut, workers)


async def test_abort_by_handle_ends_it_and_frees_the_worker_request() -> None:
    workers = await fakes("zone-a")
    rut = await start_router([(workers[0].address, "zone-a")])
    try:
        client = SessionClient(rut.stub)
        await client.send([submit(1, [9, 9], 1500, ignore_eos=True),
                           submit(2, [8, 8], 1500, ignore_eos=True)])
        while not (client.outcomes[1].tokens and client.outcomes[2].tokens):
            await client.read_frame()
        await client.send(aborts=[1])
        await wait_for(lambda: running(workers) == 1)  # handle 1's worker request is gone
        assert len(rut.router._active) == 1
        # Handle 2 goes on: several more frames carry it, none carries handle 1 (a frame
        # already on its way when the abort landed may still carry it).
        for _ in range(2):
            await client.read_frame()
        seen = len(client.frames)
        for _ in range(5):
            frame = await client.read_frame()
            assert 1 not in frame.handles and 2 in frame.handles
        assert client.outcomes[1].final is None and client.outcomes[1].error is None
        # An unknown handle is ignored; a new request on the same session still runs.
        await client.send([submit(3, [7], 3)], aborts=[99])
        await client.until_ended([3])
        assert client.outcomes[3].tokens == expected_tokens([7], 3)
        assert len(client.frames) > seen
        # Ending the session aborts what still runs there.
        client.call.cancel()
        await wait_for(lambda: running(workers) == 0)
        await wait_for(lambda: not rut.router._active)
    finally:
        await stop_all(rut, workers)


async def test_an_abort_in_the_submitting_message_frees_the_handle() -> None:
    """A request cancelled in the tick it was submitted reaches the router as a submission
    and its abort in one message: the handle must be free again and the session must end
    when the caller's input does (its task was cancelled before it ever ran)."""
    workers = await fakes("zone-a")
    rut = await start_router([(workers[0].address, "zone-a")])
    try:
        client = SessionClient(rut.stub)
        await client.send([submit(1, [5, 6], 1500, ignore_eos=True)], aborts=[1])
        await client.send([submit(1, [7], 3)])  # the same handle again
        await client.until_ended([1])
        assert client.outcomes[1].error is None, client.outcomes[1].error
        assert client.outcomes[1].tokens == expected_tokens([7], 3)
        await client.call.done_writing()
        async with asyncio.timeout(10):
            while await client.call.read() is not grpc.aio.EOF:
                pass
        await wait_for(lambda: running(workers) == 0)
    finally:
        await stop_all(rut, workers)


async def test_deadline_per_submission() -> None:
    workers = await fakes("zone-a")
    rut = await start_router([(workers[0].address, "zone-a")])
    try:
        client = SessionClient(rut.stub)
        await client.send([submit(1, [9], 1500, ignore_eos=True, timeout_s=0.3), submit(2, [8], 20)])
        await client.until_ended([1, 2])
        error = client.outcomes[1].error
        assert error is not None and error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert client.outcomes[1].tokens  # it ran until its deadline
        assert client.outcomes[2].tokens == expected_tokens([8], 20)
        await wait_for(lambda: running(workers) == 0)
        client.call.cancel()
    finally:
        await stop_all(rut, workers)


async def test_resource_exhausted_keeps_its_retry_delay() -> None:
    workers = await fakes("zone-a", token_delay_s=0.05)
    rut = await start_router([(workers[0].address, "zone-a")], worker_capacity=1, max_queue=1)
    try:
        client = SessionClient(rut.stub)
        await client.send([submit(1, [1], 20)])
        await wait_for(lambda: rut.router.registry.workers[workers[0].address].in_flight == 1)
        await client.send([submit(2, [2], 2)])
        await wait_for(lambda: rut.router.admission.depth() == 1)
        await client.send([submit(3, [3], 2)])
        while not client.ended(3):
            await client.read_frame()
        error = client.outcomes[3].error
        assert error is not None and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert error.retry_after_s >= 0.1
        _, back = errors.request_error_from_proto(error)
        assert isinstance(back, errors.ResourceExhausted) and back.retry_after_s == error.retry_after_s
        await client.until_ended([1, 2])
        assert client.outcomes[1].tokens == expected_tokens([1], 20)
        assert client.outcomes[2].tokens == expected_tokens([2], 2)
        client.call.cancel()
    finally:
        await stop_all(rut, workers)


def test_request_error_round_trip_keeps_retry_after() -> None:
    proto = errors.request_error_to_proto(errors.ResourceExhausted("queue full", retry_after_s=2.5))
    assert proto.retry_after_s == 2.5
    code, back = errors.request_error_from_proto(proto)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(back, errors.ResourceExhausted) and back.retry_after_s == 2.5
    bad = errors.request_error_to_proto(errors.InvalidArgument("request.sampling.top_k", "too big"))
    _, back = errors.request_error_from_proto(bad, field_prefixes=("request.",))
    assert isinstance(back, errors.InvalidArgument) and back.field == "sampling.top_k"


async def test_each_request_has_a_span_under_its_traceparent(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(session_module, "tracer", lambda: provider.get_tracer("test"))
    workers = await fakes("zone-a")
    rut = await start_router([(workers[0].address, "zone-a")])
    try:
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        client = SessionClient(rut.stub)
        await client.send([submit(1, [5], 3, traceparent=parent, request_id="traced"), submit(2, [6], 3)])
        await client.until_ended([1, 2])
        client.call.cancel()
        spans = {s.attributes["llmesh.request_id"]: s for s in exporter.get_finished_spans()
                 if s.name == "llmesh.router/Session.generate"}
        traced = spans["traced"]
        assert traced.kind is trace.SpanKind.SERVER
        assert f"{traced.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
        assert traced.parent is not None and f"{traced.parent.span_id:016x}" == "b7ad6b7169203331"
        assert traced.attributes["llmesh.router.worker"] == "zone-a-0"  # annotated by the core
        assert len(spans) == 2
    finally:
        await stop_all(rut, workers)


@pytest.fixture
async def engine_workers(tiny_deepseek_dir: Path) -> AsyncIterator[list[RunningWorker]]:
    """Real worker servicers on the step-based fake engine (one frame per engine step)."""
    workers = [
        await start_running_worker(tiny_deepseek_dir, zone="zone-a", worker_id="w-a",
                                   fake_token_delay_ms=5, fake_max_running=64,
                                   canary_interval_s=5.0, canary_timeout_s=5.0)
    ]
    yield workers
    for worker in workers:
        await worker.close()


async def test_frames_carry_many_handles(
    engine_workers: list[RunningWorker], tiny_deepseek_dir: Path
) -> None:
    model = FakeModel.from_dir(tiny_deepseek_dir)
    worker = engine_workers[0]
    rut = await start_router([(f"127.0.0.1:{worker.server.port}", "zone-a")],
                             worker_transport="session", worker_capacity=64)
    try:
        client = SessionClient(rut.stub)
        handles = list(range(1, 33))
        await client.send([submit(h, [5, h, h + 1], 12) for h in handles])
        await client.until_ended(handles)
        for h in handles:
            assert client.outcomes[h].tokens == fake_greedy([5, h, h + 1], 12, model)
        tokens = sum(len(f.token_ids) for f in client.frames)
        token_frames = [f for f in client.frames if f.handles]
        assert tokens == 32 * 12
        # One message per token per request would be 384 messages; frames follow the
        # engine's steps (12 for 32 requests started together, a few dozen on a busy box).
        assert len(token_frames) <= tokens / 4, (len(token_frames), tokens)
        assert max(len(f.handles) for f in token_frames) >= 8
        client.call.cancel()
    finally:
        await rut.close()


async def test_a_worker_without_session_gets_calls_and_keeps_its_circuit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rolling upgrade: the router defaults to worker Sessions, the worker is a release
    without them and answers UNIMPLEMENTED. The requests sent into that session run again
    over calls, none fails, the circuit stays closed, and Session is asked for again once
    the retry time has passed."""
    monkeypatch.setattr(batching, "SESSION_RETRY_S", 0.5)
    workers = await fakes("zone-a", has_session=False)
    rut = await start_router([(workers[0].address, "zone-a")], worker_transport="session")
    try:
        prompts = [[4, i, i + 2] for i in range(6)]
        results = await asyncio.gather(*(rut.generate(p, 5) for p in prompts))
        for prompt, (tokens, _final) in zip(prompts, results, strict=True):
            assert tokens == expected_tokens(prompt, 5)
        state = rut.router.registry.workers[workers[0].address]
        assert state.breaker.state is Circuit.CLOSED
        assert len(workers[0].worker.requests) == 6  # each ran once, over a call
        asked = workers[0].worker.session_calls  # the session, and the probe that told why it failed
        assert asked >= 2
        tokens, _ = await rut.generate([8, 8], 3)
        assert tokens == expected_tokens([8, 8], 3)
        assert workers[0].worker.session_calls == asked  # calls until the retry time
        # Upgraded meanwhile: after the retry time the router opens a Session again.
        workers[0].worker.has_session = True
        await asyncio.sleep(0.6)
        tokens, _ = await rut.generate([9, 9], 3)
        assert tokens == expected_tokens([9, 9], 3)
        assert workers[0].worker.session_calls == asked + 1
        assert workers[0].worker.frames
    finally:
        await stop_all(rut, workers)


@pytest.mark.parametrize("transport", ["session", "calls"])
async def test_tokens_reach_the_frame_without_waking_the_request_task(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """The steady state: a request's tokens go from the worker link into the session's
    frame directly; its task wakes for the end of an attempt only. Counted through the
    attempt stream's queue (each event taken from it is one wake-up of the request's
    task and one trip through the generators above it), not timed."""
    taken: list[object] = []
    original = batching.AttemptStream.events

    async def counted(self: batching.AttemptStream) -> AsyncIterator[object]:
        async for event in original(self):
            taken.append(event)
            yield event

    monkeypatch.setattr(batching.AttemptStream, "events", counted)
    workers = await fakes("zone-a", token_delay_s=0.002)
    rut = await start_router([(workers[0].address, "zone-a")], worker_transport=transport)
    try:
        client = SessionClient(rut.stub)
        handles = [1, 2, 3]
        await client.send([submit(h, [6, h], 24) for h in handles])
        await client.until_ended(handles)
        for h in handles:
            assert client.outcomes[h].tokens == expected_tokens([6, h], 24)
            assert client.outcomes[h].frames > 1  # the tokens came over many frames
        assert len(taken) == len(handles), taken  # the finals, and not one token
        client.call.cancel()
        # A Generate call still streams its deltas through the loop.
        taken.clear()
        tokens, _ = await rut.generate([7, 7], 5)
        assert tokens == expected_tokens([7, 7], 5)
        assert len(taken) == 6
    finally:
        await stop_all(rut, workers)


@pytest.mark.parametrize("transport", ["session", "calls"])
async def test_plain_tokens_cross_the_router_without_a_delta_per_request(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """Over a worker session the tokens of requests without logprobs reach the router
    session's frame as plain token ids (push_tokens, no Delta per request and frame);
    over Generate calls they come as Deltas. Counted, not timed. (A worker frame's
    requests with logprobs come as Deltas: tests/router/test_units.py.)"""
    pushed: list[str] = []
    original_push, original_tokens = batching.AttemptStream.push, batching.AttemptStream.push_tokens

    def push(self: batching.AttemptStream, item: object) -> None:
        pushed.append(type(item).__name__)
        original_push(self, item)

    def push_tokens(self: batching.AttemptStream, token_ids: list[int]) -> None:
        pushed.append("tokens")
        original_tokens(self, token_ids)

    monkeypatch.setattr(batching.AttemptStream, "push", push)
    monkeypatch.setattr(batching.AttemptStream, "push_tokens", push_tokens)
    workers = await fakes("zone-a", token_delay_s=0.002)
    rut = await start_router([(workers[0].address, "zone-a")], worker_transport=transport)
    try:
        client = SessionClient(rut.stub)
        await client.send([submit(1, [6, 1], 12), submit(2, [6, 2], 12)])
        await client.until_ended([1, 2])
        assert client.outcomes[1].tokens == expected_tokens([6, 1], 12)
        assert client.outcomes[2].tokens == expected_tokens([6, 2], 12)
        counts = Counter(pushed)
        if transport == "session":
            assert counts["tokens"] >= 20 and counts["Delta"] == 0, counts
        else:
            assert counts["tokens"] == 0 and counts["Delta"] >= 22, counts
    finally:
        await stop_all(rut, workers)


async def test_a_request_resumes_on_another_worker_with_exact_tokens() -> None:
    """The direct token path keeps resume: tokens delivered before the worker stopped are
    replayed to the next one, and the caller gets each token once."""
    workers = await fakes("zone-a", "zone-b", token_delay_s=0.01)
    rut = await start_router([(w.address, w.worker.zone) for w in workers])
    try:
        client = SessionClient(rut.stub)
        await client.send([submit(1, [2, 9], 40)])
        while len(client.outcomes[1].tokens) < 5:
            await client.read_frame()
        await workers[0].stop()
        await client.until_ended([1])
        outcome = client.outcomes[1]
        assert outcome.error is None
        assert outcome.tokens == expected_tokens([2, 9], 40)
        assert outcome.final is not None
        assert outcome.final.served_by.worker_id == "zone-b-1"
        assert outcome.final.served_by.resumed == 1
        assert outcome.final.final.completion_tokens == 40
        client.call.cancel()
    finally:
        await stop_all(rut, workers[1:])


async def test_no_token_reaches_the_frame_after_an_abort() -> None:
    """Tokens go to the frame without the request's task: between an abort and that task
    closing the generation, a worker frame may still bring the request's tokens. They
    must not reach the handle, which may already run another request. Driven by hand, in
    one tick, on a RouterSession over the router's core."""
    workers = await fakes("zone-a")
    rut = await start_router([(workers[0].address, "zone-a")])
    try:
        session = session_module.RouterSession(rut.router)
        route = RouteRequest(TokenRequest(
            request_id="late", prompt_token_ids=(4, 4),
            sampling=Sampling(max_tokens=1500, ignore_eos=True),
        ))
        session.submit(session_module.Submission(1, route, timeout_s=30.0))
        frames = session.frames()
        async with asyncio.timeout(10):
            while 1 not in (await anext(frames)).tokens:
                pass
        stream = rut.router._active["late"].stream
        assert stream is not None
        session.abort(1)
        stream.push(Delta([42]))  # a worker frame read in the same tick
        assert 1 not in session._frame.tokens
        await session.close()
        await wait_for(lambda: running(workers) == 0)
    finally:
        await stop_all(rut, workers)

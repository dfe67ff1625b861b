"""The worker's Session: many requests over one stream, one frame per engine step."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from llmesh.worker.v1 import worker_pb2
from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.worker import convert
from services.worker import session as session_module
from services.worker.core import Final, WorkerCore, WorkerIdentity
from services.worker.engine import (
    EngineRequest,
    FinishReason,
    OutputSink,
    RequestRejected,
    Sampling,
)
from services.worker.fake_engine import FakeEngine, FakeModel, fake_greedy
from services.worker.metrics import REJECTED
from services.worker.session import Frame, Submission, WorkerSession

from .conftest import Bridged, RunningWorker, token_request


@pytest.fixture(scope="module")
def model(tiny_deepseek_dir: Path) -> FakeModel:
    return FakeModel.from_dir(tiny_deepseek_dir)



def submit(handle: int, prompt: list[int], **sampling: object) -> worker_pb2.SessionSubmit:
    return worker_pb2.SessionSubmit(handle=handle, request=token_request(f"s-{handle}", prompt, **sampling))


async def collect(responses) -> tuple[dict[int, list[int]], dict, dict, int]:  # type: ignore[no-untyped-def]
    tokens: dict[int, list[int]] = defaultdict(list)
    finals, errors, frames = {}, {}, 0
    async for frame in responses:
        frames += 1
        offset = 0
        for handle, count in zip(frame.handles, frame.token_counts, strict=True):
            tokens[handle] += frame.token_ids[offset:offset + count]
            offset += count
        assert offset == len(frame.token_ids)
        finals.update({f.handle: f.final for f in frame.finals})
        errors.update({e.handle: e.error for e in frame.errors})
    return tokens, finals, errors, frames


async def test_many_requests_share_frames_and_get_exactly_their_tokens(
    stepped_worker: RunningWorker, model: FakeModel
) -> None:
    prompts = {h: [5, h, h + 1] for h in range(1, 17)}
    request = worker_pb2.SessionRequest(submit=[submit(h, p, max_tokens=12) for h, p in prompts.items()])
    tokens, finals, errors, frames = await collect(stepped_worker.stub.Session(iter([request]), timeout=30))
    assert not errors
    for handle, prompt in prompts.items():
        assert tokens[handle] == fake_greedy(prompt, 12, model)
        assert finals[handle].completion_tokens == 12
    # 16 requests x 12 tokens = 192 deltas, but the step-based engine wakes them together:
    # about one frame per step (12), not one message per token per request.
    assert frames <= 30, frames


async def test_refusals_aborts_and_deadlines_are_per_request(stepped_worker: RunningWorker) -> None:
    queue: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()

    async def requests():  # type: ignore[no-untyped-def]
        while (item := await queue.get()) is not None:
            yield item

    bad = worker_pb2.SessionSubmit(handle=2, request=token_request("s-bad", [5], temperature=5.0))
    slow = submit(3, [7, 7], ignore_eos=True)
    timed = submit(4, [8, 8], ignore_eos=True)
    timed.timeout_s = 0.2
    queue.put_nowait(worker_pb2.SessionRequest(submit=[submit(1, [5, 6], max_tokens=3), bad, slow, timed]))
    call = stepped_worker.stub.Session(requests(), timeout=30)
    seen: dict[int, list[int]] = defaultdict(list)
    finals, errors = {}, {}
    async for frame in call:
        offset = 0
        for handle, count in zip(frame.handles, frame.token_counts, strict=True):
            seen[handle] += frame.token_ids[offset:offset + count]
            offset += count
        finals.update({f.handle: f.final for f in frame.finals})
        errors.update({e.handle: e.error for e in frame.errors})
        if len(seen[3]) >= 3 and 3 not in finals and not queue.qsize():
            queue.put_nowait(worker_pb2.SessionRequest(abort=[3]))
            queue.put_nowait(None)  # no more submissions: the call ends when all are done
    assert finals[1].completion_tokens == 3
    assert errors[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [v.field for v in errors[2].field_violations] == ["request.sampling.temperature"]
    assert finals[3].finish_reason == 3  # ENGINE_FINISH_REASON_ABORT
    assert errors[4].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    # Nothing is left running in the engine.
    load = await stepped_worker.stub.GetLoad(worker_pb2.GetLoadRequest())
    assert load.load.in_flight == 0


async def test_closing_the_session_aborts_what_still_runs(stepped_worker: RunningWorker) -> None:
    call = stepped_worker.stub.Session(iter([worker_pb2.SessionRequest(
        submit=[submit(h, [9, h], ignore_eos=True) for h in range(1, 5)])]))
    await call.read()
    call.cancel()
    for _ in range(200):
        load = await stepped_worker.stub.GetLoad(worker_pb2.GetLoadRequest())
        if load.load.in_flight == 0 and load.load.running == 0:
            break
        await asyncio.sleep(0.02)
    assert load.load.in_flight == 0 and load.load.running == 0


async def test_an_id_aborted_and_sent_again_at_once_waits_instead_of_being_refused(
    stepped_worker: RunningWorker, model: FakeModel
) -> None:
    """A caller that cancels a request and at once sends it again under the same id (the
    abort, then the new submission in the next message, before the engine let go of the
    first) gets the new request served: it waits for the aborted one to leave the engine.
    A second request under the id of one still running (not aborted) is refused at once,
    naming the field."""
    queue: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()

    async def requests():  # type: ignore[no-untyped-def]
        while (item := await queue.get()) is not None:
            yield item

    first = worker_pb2.SessionSubmit(handle=1, request=token_request("again", [5, 6], ignore_eos=True))
    queue.put_nowait(worker_pb2.SessionRequest(submit=[first]))
    call = stepped_worker.stub.Session(requests(), timeout=30)
    seen: dict[int, list[int]] = defaultdict(list)
    finals, errors = {}, {}
    sent = False
    async for frame in call:
        offset = 0
        for handle, count in zip(frame.handles, frame.token_counts, strict=True):
            seen[handle] += frame.token_ids[offset:offset + count]
            offset += count
        finals.update({f.handle: f.final for f in frame.finals})
        errors.update({e.handle: e.error for e in frame.errors})
        if len(seen[1]) >= 2 and not sent:
            sent = True
            duplicate = worker_pb2.SessionSubmit(handle=3, request=token_request("again", [1], max_tokens=2))
            queue.put_nowait(worker_pb2.SessionRequest(submit=[duplicate]))
            again = worker_pb2.SessionSubmit(handle=2, request=token_request("again", [7, 8], max_tokens=4))
            queue.put_nowait(worker_pb2.SessionRequest(abort=[1]))
            queue.put_nowait(worker_pb2.SessionRequest(submit=[again]))
            queue.put_nowait(None)
    assert [v.field for v in errors[3].field_violations] == ["request.request_id"]
    assert finals[1].finish_reason == 3  # ENGINE_FINISH_REASON_ABORT
    assert 2 not in errors, errors.get(2)
    assert seen[2] == fake_greedy([7, 8], 4, model), (finals.get(2), dict(seen))
    assert finals[2].completion_tokens == 4


# -- in process: the session fed by the engine's step callbacks --------------------------

class Collected:
    """What a session's frames carried, per handle, gathered by a task of its own."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session
        self.frames: list[Frame] = []
        self.changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._collect())

    async def _collect(self) -> None:
        async for frame in self.session.frames():
            self.frames.append(frame)
            self.changed.set()

    def tokens(self, handle: int) -> list[int]:
        return [t for f in self.frames if handle in f.tokens for t in f.tokens[handle].token_ids]

    def finals(self) -> dict[int, Final]:
        return {h: final for f in self.frames for h, final in f.finals}

    def errors(self) -> dict[int, Exception]:
        return {h: error for f in self.frames for h, error in f.errors}

    async def until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                self.changed.clear()
                await self.changed.wait()


def in_process(
    tiny_deepseek_dir: Path, bridged: bool = False, **engine: Any
) -> tuple[FakeEngine, WorkerCore]:
    fake = FakeEngine(tiny_deepseek_dir, **{"token_delay_ms": 2, "max_running": 64, **engine})
    identity = WorkerIdentity("m", "sha256:x", "cpu", "z", "w", 1)
    return fake, WorkerCore(Bridged(fake) if bridged else fake, identity)  # type: ignore[arg-type]


def submission(handle: int, prompt: list[int], timeout_s: float | None = None, **sampling: Any) -> Submission:
    return Submission(handle, EngineRequest(f"p-{handle}", tuple(prompt), Sampling(**sampling)), timeout_s)


async def test_each_frame_is_one_engine_step_with_every_running_requests_token(
    tiny_deepseek_dir: Path, model: FakeModel
) -> None:
    """The engine's step callback feeds the frame directly: a frame carries the same number
    of new tokens (one per step it covers) for every one of the 16 running requests."""
    fake, core = in_process(tiny_deepseek_dir)
    session = WorkerSession(core)
    collected = Collected(session)
    for h in range(1, 17):
        session.submit(submission(h, [5, h, h + 1], max_tokens=12))
    session.input_done()
    await asyncio.wait_for(collected.task, 10)
    for h in range(1, 17):
        assert collected.tokens(h) == fake_greedy([5, h, h + 1], 12, model)
    token_frames = [f for f in collected.frames if f.tokens]
    for frame in token_frames:
        counts = {h: len(t.token_ids) for h, t in frame.tokens.items()}
        assert sorted(counts) == list(range(1, 17)), counts
        assert len(set(counts.values())) == 1, counts
    assert len(token_frames) <= fake.steps == 12


async def test_a_frame_over_several_steps_names_each_request_once_with_its_logprobs(
    tiny_deepseek_dir: Path, model: FakeModel
) -> None:
    """A frame holds every step since the previous one was taken, so when a frame's write
    outlasts a step (a busy box), the next one covers several steps. Each request is still
    named once on the wire, with all its new tokens and their logprobs in step order. (Named
    once per step, its logprobs entries shared one handle, and the router's reader paired
    every token of the frame with the last step's logprobs: a unary reply's logprobs showed
    a repeated token where the frame's earlier tokens were.)"""
    fake, core = in_process(tiny_deepseek_dir, token_delay_ms=1)
    three_steps = asyncio.Event()
    engine_step = fake._step

    def step() -> None:
        engine_step()
        if fake.steps >= 3:
            three_steps.set()

    fake._step = step  # type: ignore[method-assign]
    session = WorkerSession(core)
    prompts = {h: [5, h, h + 1] for h in (1, 2)}
    for h, prompt in prompts.items():
        session.submit(submission(h, prompt, max_tokens=8, ignore_eos=True, logprobs=1))
    session.input_done()
    # No frame is taken until three steps ran, as if the previous frame's write took that long.
    await asyncio.wait_for(three_steps.wait(), 10)
    tokens: dict[int, list[int]] = defaultdict(list)
    logprob_ids: dict[int, list[int]] = defaultdict(list)
    messages = [convert.frame_to_proto(frame) async for frame in session.frames()]
    assert len(messages[0].token_ids) >= 2 * 3  # the first frame covers the three steps
    for message in messages:
        assert len(set(message.handles)) == len(message.handles), list(message.handles)
        offset = 0
        for handle, count in zip(message.handles, message.token_counts, strict=True):
            tokens[handle] += message.token_ids[offset:offset + count]
            offset += count
        for entry in message.logprobs:
            logprob_ids[entry.handle] += [lp.token_id for lp in entry.logprobs]
    for h, prompt in prompts.items():
        assert tokens[h] == fake_greedy(prompt, 8, model)
        assert logprob_ids[h] == tokens[h]


async def test_no_task_per_running_request(tiny_deepseek_dir: Path) -> None:
    """50 requests running in a session add no task each: the engine's step callback
    reaches them, not 50 tasks and generators."""
    _, core = in_process(tiny_deepseek_dir)
    session = WorkerSession(core)
    collected = Collected(session)
    baseline = len(asyncio.all_tasks())
    for h in range(1, 51):
        session.submit(submission(h, [7, h], ignore_eos=True))
    await collected.until(lambda: all(collected.tokens(h) for h in range(1, 51)))
    assert session.running == 50 and len(core.in_flight_ids()) == 50
    assert len(asyncio.all_tasks()) <= baseline + 1, asyncio.all_tasks()
    await session.close()
    assert core.in_flight_ids() == [] and core.engine.load().running == 0
    collected.task.cancel()


@pytest.mark.parametrize("bridged", [False, True], ids=["step-loop", "generator-bridge"])
async def test_deadline_abort_death_and_rejection_per_request(tiny_deepseek_dir: Path, bridged: bool) -> None:
    """Over the sink path each request still ends on its own: a passed deadline (aborted in
    the engine, DEADLINE_EXCEEDED), an abort by handle (ABORT final), an abort in the
    message that submitted it (ABORT final; it never reaches the engine), the engine
    refusing one request (its INVALID_ARGUMENT only), then the engine's death (UNAVAILABLE
    for every request still running). The same with an engine that bridges its
    per-request generators into the sinks, as the vLLM adapter does today."""
    fake, core = in_process(tiny_deepseek_dir, bridged)
    real_start = fake.start
    reached_engine: list[str] = []

    async def start(request: EngineRequest, sink: OutputSink) -> None:
        reached_engine.append(request.request_id)
        if request.request_id == "p-5":  # refused from the step loop, as a native engine does
            asyncio.get_running_loop().call_soon(sink, RequestRejected("request.sampling.seed", "refused"))
            return
        await real_start(request, sink)

    fake.start = start  # type: ignore[method-assign]
    rejected_before = REJECTED._value.get()
    session = WorkerSession(core)
    collected = Collected(session)
    session.submit(submission(1, [5, 6], timeout_s=0.05, ignore_eos=True))
    session.submit(submission(2, [5, 7], ignore_eos=True))
    session.submit(submission(3, [5, 8], ignore_eos=True))
    session.submit(submission(4, [5, 9], ignore_eos=True))
    session.abort(4)  # in the message that submitted it
    session.submit(submission(5, [5, 10], ignore_eos=True))
    await collected.until(lambda: len(collected.tokens(2)) >= 3)
    session.abort(2)
    await collected.until(lambda: {1, 5} <= collected.errors().keys() and {2, 4} <= collected.finals().keys())
    errors, finals = collected.errors(), collected.finals()
    assert isinstance(errors[1], DeadlineExceeded)
    assert finals[2].finish_reason is FinishReason.ABORT and finals[2].completion_tokens >= 3
    assert finals[4].finish_reason is FinishReason.ABORT and finals[4].completion_tokens == 0
    assert "p-4" not in reached_engine
    assert isinstance(errors[5], InvalidArgument) and errors[5].field == "request.sampling.seed"
    assert REJECTED._value.get() == rejected_before + 1
    assert sorted(core.in_flight_ids()) == ["p-3"] and fake.load().running == 1
    fake.kill()
    await collected.until(lambda: 3 in collected.errors())
    assert isinstance(collected.errors()[3], Unavailable)
    assert core.health.engine_dead and core.in_flight_ids() == []
    session.input_done()
    await asyncio.wait_for(collected.task, 5)
    assert session.running == 0


async def test_each_request_has_a_span_under_its_traceparent(
    tiny_deepseek_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(session_module, "tracer", lambda: provider.get_tracer("test"))
    _, core = in_process(tiny_deepseek_dir)
    session = WorkerSession(core)
    collected = Collected(session)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = submission(1, [5, 6], max_tokens=3)
    session.submit(Submission(1, traced.request, trace_context={"traceparent": parent}))
    session.submit(submission(2, [5, 7], timeout_s=0.02, ignore_eos=True))
    session.input_done()
    await asyncio.wait_for(collected.task, 10)
    spans = {s.attributes["llmesh.request_id"]: s for s in exporter.get_finished_spans()}  # type: ignore[index]
    assert spans.keys() == {"p-1", "p-2"}
    span = spans["p-1"]
    assert span.kind is trace.SpanKind.SERVER and span.name == "llmesh.worker/Session.generate"
    assert f"{span.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    assert span.attributes["llmesh.worker.finish_reason"] == "length"  # type: ignore[index]
    assert span.attributes["llmesh.worker.completion_tokens"] == 3  # type: ignore[index]
    assert spans["p-2"].status.status_code is StatusCode.ERROR

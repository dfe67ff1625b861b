"""The worker's Session: many requests over one stream, one frame per engine step."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import grpc
import pytest

from llmesh.worker.v1 import worker_pb2
from services.worker.fake_engine import FakeModel, fake_greedy

from .conftest import RunningWorker, start_running_worker, token_request


@pytest.fixture(scope="module")
def model(tiny_deepseek_dir: Path) -> FakeModel:
    return FakeModel.from_dir(tiny_deepseek_dir)


@pytest.fixture
async def stepped_worker(tiny_deepseek_dir: Path):  # type: ignore[no-untyped-def]
    worker = await start_running_worker(tiny_deepseek_dir, fake_token_delay_ms=5, fake_max_running=64,
                                        canary_interval_s=5.0, canary_timeout_s=5.0)
    yield worker
    await worker.close()


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

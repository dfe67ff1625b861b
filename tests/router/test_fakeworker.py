"""The router tests' worker double speaks Session as a real worker does
(services/worker/session.py): frames in column layout carrying every request that produced
at the same moment, aborts by handle ending with an ABORT final, per-request errors for the
failure knobs, deadlines, and a session's end stopping what still runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from llmesh.common.v1 import common_pb2
from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.router.fakeworker import FakeWorker, next_token, start_fake
from tests.router.helpers import wait_for


def token_request(request_id: str, prompt: list[int], max_tokens: int, temperature: float = 0.0
                  ) -> common_pb2.TokenRequest:
    out = common_pb2.TokenRequest(request_id=request_id, prompt_token_ids=prompt)
    out.sampling.max_tokens = max_tokens
    out.sampling.temperature = temperature
    return out


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class Link:
    """A Session call driven by hand: send messages, read frames."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
        self.outbox: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()
        self.call = stub.Session(self._requests())

    async def _requests(self) -> AsyncIterator[worker_pb2.SessionRequest]:
        while (message := await self.outbox.get()) is not None:
            yield message

    def send(self, *submits: worker_pb2.SessionSubmit, abort: tuple[int, ...] = ()) -> None:
        self.outbox.put_nowait(worker_pb2.SessionRequest(submit=list(submits), abort=list(abort)))

    async def until_done(self, handles: set[int]) -> tuple[dict[int, list[int]], dict[int, object],
                                                            list[worker_pb2.SessionResponse]]:
        """Read frames until every handle has a final or an error."""
        tokens: dict[int, list[int]] = {h: [] for h in handles}
        ends: dict[int, object] = {}
        frames = []
        while set(ends) != handles:
            frame = await asyncio.wait_for(self.call.read(), 10)
            assert frame is not grpc.aio.EOF
            frames.append(frame)
            offset = 0
            for handle, count in zip(frame.handles, frame.token_counts, strict=True):
                tokens[handle] += frame.token_ids[offset:offset + count]
                offset += count
            assert offset == len(frame.token_ids)
            for final in frame.finals:
                ends[final.handle] = final.final
            for error in frame.errors:
                ends[error.handle] = error.error
        return tokens, ends, frames


async def test_session_frames_abort_errors_deadline_and_end() -> None:
    fake = await start_fake(FakeWorker(token_delay_s=0.02))
    channel = grpc.aio.insecure_channel(fake.address)
    link = Link(worker_pb2_grpc.WorkerServiceStub(channel))
    worker = fake.worker
    try:
        # Requests started together produce together: their tokens share frames.
        prompts = {h: [h, h + 1] for h in range(1, 7)}
        link.send(*(worker_pb2.SessionSubmit(handle=h, request=token_request(f"r{h}", p, 5),
                                             traceparent=f"00-{h:032x}-{h:016x}-01")
                    for h, p in prompts.items()))
        tokens, ends, frames = await link.until_done(set(prompts))
        for h, p in prompts.items():
            assert tokens[h] == expected(p, 5)
            assert isinstance(ends[h], common_pb2.TokenFinal)
            assert ends[h].finish_reason == common_pb2.ENGINE_FINISH_REASON_LENGTH
            assert ends[h].completion_tokens == 5
        assert max(len(set(f.handles)) for f in frames) > 1
        assert len(frames) < 6 * 5  # far from one message per token per request
        assert worker.batch_sizes[-1] == 6 and worker.traceparents["r3"] == f"00-{3:032x}-{3:016x}-01"

        # The knobs fail single requests, as errors of their handles; the session goes on.
        worker.fail_before_first = 1
        link.send(worker_pb2.SessionSubmit(handle=10, request=token_request("u", [1], 2)))
        worker.internal_errors = 1
        link.send(worker_pb2.SessionSubmit(handle=11, request=token_request("i", [1], 2)),
                  worker_pb2.SessionSubmit(handle=12, request=token_request("t", [1], 2, temperature=5.0)),
                  worker_pb2.SessionSubmit(handle=13, request=token_request("e", [], 2)),
                  worker_pb2.SessionSubmit(handle=14, request=token_request("ok", [1], 2)))
        tokens, ends, _ = await link.until_done({10, 11, 12, 13, 14})
        codes = {h: ends[h].code for h in (10, 11, 12, 13)}  # type: ignore[attr-defined]
        assert codes == {10: grpc.StatusCode.UNAVAILABLE.value[0], 11: grpc.StatusCode.INTERNAL.value[0],
                         12: grpc.StatusCode.INVALID_ARGUMENT.value[0],
                         13: grpc.StatusCode.INVALID_ARGUMENT.value[0]}
        assert ends[12].field_violations[0].field == "request.sampling.temperature"  # type: ignore[attr-defined]
        assert tokens[14] == expected([1], 2)
        assert "ok" in [r.request_id for r in worker.requests]
        assert not {"u", "i", "t", "e"} & {r.request_id for r in worker.requests}

        # An abort by handle ends that request with an ABORT final; a deadline with an error.
        link.send(worker_pb2.SessionSubmit(handle=20, request=token_request("long", [2], 500)),
                  worker_pb2.SessionSubmit(handle=21, request=token_request("late", [3], 500), timeout_s=0.1))
        await wait_for(lambda: "long" in worker.running)
        link.send(abort=(20, 999))  # an unknown handle is ignored
        tokens, ends, _ = await link.until_done({20, 21})
        assert ends[20].finish_reason == common_pb2.ENGINE_FINISH_REASON_ABORT  # type: ignore[attr-defined]
        assert ends[21].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]  # type: ignore[attr-defined]
        assert worker.aborted == ["long"] and not worker.running

        # Ending the session stops what still runs.
        link.send(worker_pb2.SessionSubmit(handle=30, request=token_request("orphan", [4], 500)))
        await wait_for(lambda: "orphan" in worker.running)
        link.call.cancel()
        await wait_for(lambda: not worker.running)
    finally:
        await channel.close()
        await fake.stop()

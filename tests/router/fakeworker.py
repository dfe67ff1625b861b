"""A minimal WorkerService double for router tests (in-process or as a subprocess).

The next token is a pure function of the whole sequence so far, so a generation resumed
elsewhere from prompt + produced tokens equals an undisturbed one.

Generate, GenerateBatch and Session (the router's default transport) run every request
the same way, and the failure knobs (``fail_before_first``, ``internal_errors``,
``max_temperature``, ``token_delay_s``) act on each transport as a real worker's failure
would show on it: a failed call there, that request's error in a batch or session.

    python tests/router/fakeworker.py --port P --zone zone-a [--token-delay-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmesh.common.v1 import common_pb2
from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.channels import SERVER_KEEPALIVE_OPTIONS
from services.common.errors import (
    Internal,
    InvalidArgument,
    LlmeshError,
    Unavailable,
    map_exception,
    request_error_to_proto,
)
from services.common.framing import FramedSession

SERVICE = "llmesh.worker.v1.WorkerService"
MODEL = "fake-model"
CHECKSUM = "sha256:fake"


def next_token(sequence: list[int]) -> int:
    acc = 7
    for i, token in enumerate(sequence):
        acc = (acc * 31 + token * (i + 1)) % 1_000_003
    return 10 + acc % 990


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    zone: str = "zone-a"
    worker_id: str = "fake"
    model: str = MODEL
    checksum: str = CHECKSUM
    token_delay_s: float = 0.005
    max_num_seqs: int = 64
    fail_before_first: int = 0
    """Fail this many Generate calls (or Session submissions, as that request's error) with
    UNAVAILABLE before sending anything."""
    internal_errors: int = 0
    """Fail this many requests with INTERNAL (the worker answered, the request failed)."""
    max_temperature: float = 2.0
    """Like a real worker, refuse a higher temperature with INVALID_ARGUMENT + BadRequest."""
    running: dict[str, asyncio.Event] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    """Requests per Generate / GenerateBatch call or per Session message of submissions."""
    batched_ids: list[str] = field(default_factory=list)
    """Request ids that arrived in a GenerateBatch call or Session message of two or more."""
    requests: list[common_pb2.TokenRequest] = field(default_factory=list)
    traceparents: dict[str, str] = field(default_factory=dict)
    """The traceparent each Session submission carried, by request id."""
    frames: list[worker_pb2.SessionResponse] = field(default_factory=list)
    """Every Session frame sent, in order (the column layout under test)."""
    has_session: bool = True
    """False: answer Session with UNIMPLEMENTED, as a release before it does."""
    session_calls: int = 0

    async def _run(self, request: common_pb2.TokenRequest) -> AsyncIterator[common_pb2.TokenDelta
                                                                               | common_pb2.TokenFinal]:
        self.requests.append(request)
        stop = asyncio.Event()
        self.running[request.request_id] = stop
        start = time.perf_counter()
        try:
            seq = list(request.prompt_token_ids) + list(request.replay_token_ids)
            limit = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
            for _ in range(limit):
                await asyncio.sleep(self.token_delay_s)
                if stop.is_set():
                    yield common_pb2.TokenFinal(finish_reason=common_pb2.ENGINE_FINISH_REASON_ABORT)
                    return
                token = next_token(seq)
                seq.append(token)
                yield common_pb2.TokenDelta(token_ids=[token])
            yield common_pb2.TokenFinal(
                finish_reason=common_pb2.ENGINE_FINISH_REASON_LENGTH,
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=limit,
                total_ms=(time.perf_counter() - start) * 1000,
            )
        finally:
            self.running.pop(request.request_id, None)

    def _refusal(self, request: common_pb2.TokenRequest, prefix: str) -> LlmeshError | None:
        """What a real worker would refuse this request with, if anything."""
        if request.sampling.temperature > self.max_temperature:
            return InvalidArgument(f"{prefix}.sampling.temperature",
                                   f"must be a number in [0, {self.max_temperature:g}]")
        if self.internal_errors > 0:
            self.internal_errors -= 1
            return Internal("injected engine failure")
        return None

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        if self.fail_before_first > 0:
            self.fail_before_first -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected failure")
        refusal = self._refusal(request.request, "request")
        if refusal is not None:
            await context.abort_with_status(map_exception(refusal).to_grpc_status())
        if not request.request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request.prompt_token_ids: empty")
        self.batch_sizes.append(1)
        async for event in self._run(request.request):
            if isinstance(event, common_pb2.TokenDelta):
                yield worker_pb2.GenerateResponse(request_id=request.request.request_id, delta=event)
            else:
                yield worker_pb2.GenerateResponse(request_id=request.request.request_id, final=event)

    async def GenerateBatch(self, request, context):  # type: ignore[no-untyped-def]
        self.batch_sizes.append(len(request.requests))
        if len(request.requests) > 1:
            self.batched_ids += [r.request_id for r in request.requests]
        queue: asyncio.Queue[worker_pb2.GenerateBatchResponse | None] = asyncio.Queue()

        async def pump(req: common_pb2.TokenRequest) -> None:
            async for event in self._run(req):
                if isinstance(event, common_pb2.TokenDelta):
                    await queue.put(worker_pb2.GenerateBatchResponse(request_id=req.request_id, delta=event))
                else:
                    await queue.put(worker_pb2.GenerateBatchResponse(request_id=req.request_id, final=event))
            await queue.put(None)

        runnable = []
        for i, r in enumerate(request.requests):
            refusal = self._refusal(r, f"requests[{i}]")
            if refusal is None:
                runnable.append(r)
            else:
                yield worker_pb2.GenerateBatchResponse(
                    request_id=r.request_id, error=request_error_to_proto(refusal))
        tasks = [asyncio.ensure_future(pump(r)) for r in runnable]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()

    async def Session(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self.session_calls += 1
        if not self.has_session:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        session = FakeSession(self)
        # Leaving (the caller went away) stops what still runs.
        async with session.reading(request_iterator, session.receive):
            async for frame in session.frames():
                self.frames.append(frame)
                yield frame

    def _stop(self, request_id: str) -> None:
        """Abort a running request: it ends with an ABORT final at its next token."""
        self.aborted.append(request_id)
        stop = self.running.get(request_id)
        if stop is not None:
            stop.set()

    async def Abort(self, request, context):  # type: ignore[no-untyped-def]
        self._stop(request.request_id)
        return worker_pb2.AbortResponse()

    def _load(self) -> worker_pb2.Load:
        return worker_pb2.Load(running=len(self.running), in_flight=len(self.running),
                               max_num_seqs=self.max_num_seqs)

    async def GetLoad(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.GetLoadResponse(load=self._load())

    async def WatchLoad(self, request, context):  # type: ignore[no-untyped-def]
        while True:
            yield worker_pb2.WatchLoadResponse(load=self._load())
            await asyncio.sleep((request.interval_ms or 100) / 1000.0)

    async def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.GetModelInfoResponse(
            model=self.model, tokenizer_checksum=self.checksum, device="cpu", zone=self.zone,
            worker_id=self.worker_id, pid=os.getpid(), max_context_length=4096, vocab_size=1000)


class FakeSession(FramedSession[worker_pb2.SessionResponse]):
    """One Session of the double, with the semantics of services/worker/session.py (and
    its machinery, services/common/framing.py): each submission runs on its own;
    everything the requests produce before the event loop comes round (the requests that
    woke together, as one engine step wakes them) goes out in one frame; a refusal,
    failure or passed deadline is that handle's SessionError; an abort by handle ends the
    request with an ABORT final; ending the session stops every request still running (no
    final, the stream is gone)."""

    deadline_message = "the request's deadline passed on the worker"

    def __init__(self, worker: FakeWorker) -> None:
        super().__init__()
        self.worker = worker

    def receive(self, message: worker_pb2.SessionRequest) -> None:
        if message.submit:
            self.worker.batch_sizes.append(len(message.submit))
            if len(message.submit) > 1:
                self.worker.batched_ids += [sub.request.request_id for sub in message.submit]
        for sub in message.submit:
            self.submit(sub)
        for handle in message.abort:
            # Unknown handles are ignored: the request finished while the abort was on its way.
            request_id = self._request_ids.get(handle)
            if request_id is not None:
                self.worker._stop(request_id)

    def submit(self, sub: worker_pb2.SessionSubmit) -> None:
        """Start one request; a refusal becomes that handle's error in the next frame.
        The checks run in Generate's order, so each knob fails the same request."""
        handle, request = sub.handle, sub.request
        if self._taken(handle):
            return
        if self.worker.fail_before_first > 0:
            self.worker.fail_before_first -= 1
            self._fail(handle, Unavailable("injected failure"))
            return
        refusal = self.worker._refusal(request, "request")
        if refusal is None and not request.prompt_token_ids:
            refusal = InvalidArgument("request.prompt_token_ids", "must not be empty")
        if refusal is not None:
            self._fail(handle, refusal)
            return
        if sub.traceparent:
            self.worker.traceparents[request.request_id] = sub.traceparent
        timeout_s = sub.timeout_s or None
        self._start(handle, request.request_id, lambda: self._generate(handle, request, timeout_s))

    def _new_frame(self) -> worker_pb2.SessionResponse:
        return worker_pb2.SessionResponse()

    def _has_content(self, frame: worker_pb2.SessionResponse) -> bool:
        return bool(frame.handles or frame.finals or frame.errors)

    def _add_error(self, frame: worker_pb2.SessionResponse, handle: int, error: Exception) -> None:
        frame.errors.append(worker_pb2.SessionError(handle=handle, error=request_error_to_proto(error)))

    async def _generate(self, handle: int, request: common_pb2.TokenRequest, timeout_s: float | None) -> None:
        # The deadline closes the generation, as the real worker aborts it in the engine.
        async with asyncio.timeout(timeout_s):
            async with contextlib.aclosing(self.worker._run(request)) as events:
                async for event in events:
                    if isinstance(event, common_pb2.TokenDelta):
                        self._frame.handles.append(handle)
                        self._frame.token_counts.append(len(event.token_ids))
                        self._frame.token_ids.extend(event.token_ids)
                    else:
                        self._frame.finals.append(worker_pb2.SessionFinal(handle=handle, final=event))
                    self._schedule()


@dataclass
class RunningFake:
    server: grpc.aio.Server
    port: int
    worker: FakeWorker
    health: health.aio.HealthServicer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        serving_status = health_pb2.HealthCheckResponse
        status = serving_status.SERVING if serving else serving_status.NOT_SERVING
        await self.health.set(SERVICE, status)

    async def stop(self) -> None:
        await self.server.stop(0)


async def start_fake(worker: FakeWorker, port: int = 0) -> RunningFake:
    server = grpc.aio.server(options=list(SERVER_KEEPALIVE_OPTIONS))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, "could not bind"
    await server.start()
    running = RunningFake(server, bound, worker, health_servicer)
    await running.set_serving(True)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return running


async def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--zone", default="zone-a")
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--token-delay-ms", type=float, default=5.0)
    parser.add_argument("--checksum", default=CHECKSUM)
    args = parser.parse_args()
    worker = FakeWorker(zone=args.zone, worker_id=args.worker_id or f"fake-{args.port}",
                        token_delay_s=args.token_delay_ms / 1000, checksum=args.checksum)
    running = await start_fake(worker, args.port)
    await running.server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_main())

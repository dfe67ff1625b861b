"""``llmesh.worker.v1.WorkerService``: converts, calls the core, converts back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry import trace

from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.worker import convert
from services.worker.core import Failed, Final, WorkerCore
from services.worker.engine import EngineRequest
from services.worker.loadclock import LoadClock, LoadClocks
from services.worker.session import Frame, WorkerSession, annotate_final

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin: every rule lives in :class:`WorkerCore`; errors map in the shared interceptor."""

    def __init__(self, core: WorkerCore | None = None) -> None:
        self.load_clocks = LoadClocks()
        """The open load watches that named their router (see services/worker/loadclock.py)."""
        self.maybe_core: WorkerCore | None = None
        if core is not None:
            self.attach(core)

    def attach(self, core: WorkerCore) -> None:
        """Set the core once the engine is built (the server answers health before that)."""
        self.maybe_core = core
        core.on_busy = self.load_clocks.busy

    @property
    def core(self) -> WorkerCore:
        if self.maybe_core is None:
            raise Unavailable("the worker is starting (engine not ready yet)")
        return self.maybe_core

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        adapter = self.core.adapter_for(request.request.model)
        req = convert.request_from_proto(request.request, adapter)
        async with contextlib.aclosing(self.core.generate(req)) as events:
            async for event in events:
                if isinstance(event, Final):
                    annotate_final(trace.get_current_span(), event)
                yield convert.generate_response(req.request_id, event)

    async def GenerateBatch(
        self, request: worker_pb2.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateBatchResponse]:
        reqs: list[EngineRequest | Failed] = []
        for r in request.requests:
            try:
                adapter = self.core.adapter_for(r.model, "request.model")
                reqs.append(convert.request_from_proto(r, adapter))
            except NotFound as exc:  # an unknown model fails that request, not the batch
                reqs.append(Failed(exc))
        ids = [r.request_id for r in request.requests]
        async with contextlib.aclosing(self.core.generate_batch(reqs, ids)) as events:
            async for request_id, event in events:
                yield convert.batch_response(request_id, event)

    async def Session(
        self, request_iterator: AsyncIterator[worker_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SessionResponse]:
        core = self.core
        session = WorkerSession(core)

        def adapter(sub: worker_pb2.SessionSubmit) -> str | Exception:
            try:
                return core.adapter_for(sub.request.model, "request.model")
            except NotFound as exc:
                return exc

        watcher = ""
        """The caller's load watch, named in its first message: frames carry the load."""

        def receive(message: worker_pb2.SessionRequest) -> None:
            nonlocal watcher
            if message.watcher:
                watcher = message.watcher
            for sub in message.submit:
                session.submit(convert.submission_from_proto(sub, adapter(sub)))
            for handle in message.abort:
                session.abort(handle)

        loop = asyncio.get_running_loop()

        def message_for(frame: Frame) -> worker_pb2.SessionResponse:
            message = convert.frame_to_proto(frame)
            clock = self.load_clocks.get(watcher)
            if clock is not None and clock.frame_due(now := loop.time()):
                message.load.CopyFrom(convert.load_to_proto(core.load()))
                clock.sent(now, on_frame=True)
            return message

        write_now = getattr(context, "write_now", None)
        if write_now is not None:  # a framed listener: frames go out from the flush
            session.direct = lambda frame: write_now(message_for(frame))
        # Leaving (the caller went away) aborts what still runs.
        async with session.reading(request_iterator, receive):
            async for frame in session.frames():
                yield message_for(frame)

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        if not request.request_id:
            raise InvalidArgument("request_id", "must not be empty")
        await self.core.abort(request.request_id)
        return worker_pb2.AbortResponse()

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetLoadResponse:
        return worker_pb2.GetLoadResponse(load=convert.load_to_proto(self.core.load()))

    async def WatchLoad(
        self, request: worker_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WatchLoadResponse]:
        async with contextlib.aclosing(self._load_reports(request)) as reports:
            async for report in reports:
                yield report

    async def WatchLoadFramed(
        self, request_iterator: AsyncIterator[worker_pb2.WatchLoadRequest], context: object
    ) -> AsyncIterator[worker_pb2.WatchLoadResponse]:
        """WatchLoad on the framed listener (services/common/sessionwire.py), where every
        method is a stream of requests: the first message is the request, the rest ignored.
        Each report costs both sides a plain frame instead of a grpc.aio message."""
        async for request in request_iterator:
            async with contextlib.aclosing(self._load_reports(request)) as reports:
                async for report in reports:
                    yield report
            return
        raise InvalidArgument("request", "WatchLoad needs a WatchLoadRequest before its input ends")

    async def _load_reports(
        self, request: worker_pb2.WatchLoadRequest
    ) -> AsyncGenerator[worker_pb2.WatchLoadResponse, None]:
        interval = (request.interval_ms or 100) / 1000.0
        if interval < 0.01:
            raise InvalidArgument("interval_ms", "must be 0 (100 ms) or at least 10")
        # A named watch's clock is pushed back by the frames of the caller's sessions that
        # carry the load (a report only when none did for an interval, or for silence_ms
        # after a frame did); an unnamed one's by nothing: a report every interval.
        watcher = request.watcher
        if watcher:
            clock = self.load_clocks.open(watcher, interval, request.silence_ms / 1000.0)
        else:
            clock = LoadClock(interval)
        loop = asyncio.get_running_loop()
        try:
            while True:
                await clock.wait_report()
                load = self.core.load()
                clock.sent(loop.time(), idle=load.idle)
                yield worker_pb2.WatchLoadResponse(load=convert.load_to_proto(load))
        finally:
            self.load_clocks.close(watcher, clock)  # an unnamed one was never registered

    async def GetModelInfo(
        self, request: worker_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetModelInfoResponse:
        return convert.model_info_to_proto(self.core.identity, self.core.info)

"""RouterService servicer: validate, convert, call the core."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from llmesh.router.v1 import router_pb2, router_pb2_grpc
from services.common.channels import downstream_timeout
from services.common.errors import InvalidArgument
from services.router import convert
from services.router.core import Router
from services.router.session import RouterSession


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        if not request.HasField("request"):
            raise InvalidArgument("request", "is required")
        route = convert.route_request_from_proto(request)
        # Cancellation of the client call cancels this generator; the core aborts the
        # worker request in its finally blocks.
        async for event in self.router.generate(route, downstream_timeout(context)):
            yield convert.response_to_proto(event)

    async def Session(
        self, request_iterator: AsyncIterator[router_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.SessionResponse]:
        session = RouterSession(self.router)

        def receive(message: router_pb2.SessionRequest) -> None:
            for sub in message.submit:  # submissions first: a message may abort its own
                session.submit(convert.submission_from_proto(sub))
            for handle in message.abort:
                session.abort(handle)

        # Leaving (the caller went away) aborts what still runs.
        async with session.reading(request_iterator, receive):
            write_now = getattr(context, "write_now", None)
            if write_now is not None:  # a framed listener: frames go out from the flush
                session.direct = lambda frame: write_now(convert.frame_to_proto(frame))
            async for frame in session.frames():
                yield convert.frame_to_proto(frame)

    async def Abort(
        self, request: router_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.AbortResponse:
        if not request.request_id:
            raise InvalidArgument("request_id", "must not be empty")
        await self.router.abort(request.request_id)
        return router_pb2.AbortResponse()

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        ladder = self.router.ladder
        return router_pb2.ListWorkersResponse(
            workers=[convert.worker_status_to_proto(w, ladder) for w in self.router.workers()],
            zone_ladder=ladder.zones,
        )

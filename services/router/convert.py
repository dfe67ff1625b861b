"""Proto <-> domain conversion for the RouterService."""

from __future__ import annotations

from llmesh.router.v1 import router_pb2
from services.common import generation_convert
from services.common.errors import InvalidArgument, LlmeshError, request_error_to_proto
from services.common.generation import Delta, RouterFinal
from services.common.generation_convert import logprobs_to_proto
from services.router.breaker import Circuit
from services.router.core import RouteRequest
from services.router.registry import WorkerState
from services.router.routing import ZoneLadder
from services.router.session import Frame, Submission

CIRCUIT_PROTO = {
    Circuit.CLOSED: router_pb2.CIRCUIT_STATE_CLOSED,
    Circuit.OPEN: router_pb2.CIRCUIT_STATE_OPEN,
    Circuit.HALF_OPEN: router_pb2.CIRCUIT_STATE_HALF_OPEN,
}


def route_request_from_proto(message: router_pb2.GenerateRequest) -> RouteRequest:
    return RouteRequest(
        request=generation_convert.request_from_proto(message.request),
        resume_token_ids=tuple(message.resume_token_ids),
        resumed=message.resumed,
        tenant=message.tenant,
    )


def response_to_proto(event: Delta | RouterFinal) -> router_pb2.GenerateResponse:
    if isinstance(event, Delta):
        return router_pb2.GenerateResponse(delta=generation_convert.delta_to_proto(event))
    return router_pb2.GenerateResponse(final=generation_convert.router_final_to_proto(event))


def submission_from_proto(sub: router_pb2.SessionSubmit) -> Submission:
    """One submission of a Session; a missing request is that request's own error, named
    as Generate names it (field paths relative to the GenerateRequest)."""
    request: RouteRequest | LlmeshError
    if not sub.HasField("request") or not sub.request.HasField("request"):
        request = InvalidArgument("request", "is required")
    else:
        request = route_request_from_proto(sub.request)
    return Submission(
        handle=sub.handle, request=request, timeout_s=sub.timeout_s if sub.timeout_s > 0 else None,
        trace_context={"traceparent": sub.traceparent} if sub.traceparent else {},
    )


def frame_to_proto(frame: Frame) -> router_pb2.SessionResponse:
    """One frame in column layout: handles, token counts and the token ids back to back
    (each column built as a list and handed to the message whole)."""
    tokens = frame.tokens.values()
    return router_pb2.SessionResponse(
        handles=list(frame.tokens),
        token_counts=[len(t.token_ids) for t in tokens],
        token_ids=[token for t in tokens for token in t.token_ids],
        logprobs=[
            router_pb2.SessionLogprobs(handle=handle, logprobs=logprobs_to_proto(t.logprobs))
            for handle, t in frame.tokens.items() if t.logprobs
        ],
        finals=[
            router_pb2.SessionFinal(handle=handle, final=generation_convert.router_final_to_proto(final))
            for handle, final in frame.finals
        ],
        errors=[
            router_pb2.SessionError(handle=handle, error=request_error_to_proto(error))
            for handle, error in frame.errors
        ],
    )


def worker_status_to_proto(worker: WorkerState, ladder: ZoneLadder) -> router_pb2.WorkerStatus:
    return router_pb2.WorkerStatus(
        worker_id=worker.worker_id,
        address=worker.address,
        zone=worker.zone,
        device=worker.device,
        models=worker.models,
        health=worker.status,
        circuit=CIRCUIT_PROTO[worker.circuit],
        running=worker.load.running,
        waiting=worker.load.waiting,
        kv_cache_usage=worker.load.kv_cache_usage,
        pid=worker.pid,
        degraded=ladder.is_degraded(worker.zone),
        in_flight=worker.in_flight,
    )

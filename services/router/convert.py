"""Proto <-> domain conversion for the RouterService."""

from __future__ import annotations

from llmesh.router.v1 import router_pb2
from services.router.breaker import Circuit
from services.router.core import Delta, Final, RouteRequest
from services.router.registry import WorkerState
from services.router.routing import ZoneLadder

CIRCUIT_PROTO = {
    Circuit.CLOSED: router_pb2.CIRCUIT_STATE_CLOSED,
    Circuit.OPEN: router_pb2.CIRCUIT_STATE_OPEN,
    Circuit.HALF_OPEN: router_pb2.CIRCUIT_STATE_HALF_OPEN,
}


def route_request_from_proto(message: router_pb2.GenerateRequest) -> RouteRequest:
    return RouteRequest(
        request=message.request,
        resume_token_ids=tuple(message.resume_token_ids),
        resumed=message.resumed,
        tenant=message.tenant,
    )


def response_to_proto(event: Delta | Final) -> router_pb2.GenerateResponse:
    if isinstance(event, Delta):
        return router_pb2.GenerateResponse(delta=event.delta)
    served = event.served_by
    return router_pb2.GenerateResponse(
        final=router_pb2.RouterFinal(
            final=event.final,
            served_by=router_pb2.ServedBy(
                worker_id=served.worker_id, zone=served.zone, device=served.device,
                degraded=served.degraded, resumed=served.resumed,
            ),
            retries=event.retries,
        )
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

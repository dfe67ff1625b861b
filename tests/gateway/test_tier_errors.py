"""Errors cross hops unchanged: a router's status becomes the same llmesh error at the
gateway, with every google.rpc detail, and violations carry public field paths."""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from gateway.tiers import ROUTER_FIELD_PREFIXES, TierUnavailable, domain_error
from services.common import errors


def rpc_error(code: grpc.StatusCode, message: str, *details: object) -> grpc.aio.AioRpcError:
    status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        status.details.add().Pack(detail)  # type: ignore[arg-type]
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


def test_router_violations_reach_the_caller_with_public_field_paths() -> None:
    bad = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field="request.sampling.seed", description="too big"),
        error_details_pb2.BadRequest.FieldViolation(field="request.sampling.top_k", description="negative"),
    ])
    err = domain_error(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "request.sampling.seed: too big", bad),
                       tier="router", strip=ROUTER_FIELD_PREFIXES)
    assert isinstance(err, errors.InvalidArgument)
    assert [(v.field, v.description) for v in err.violations] == [
        ("sampling.seed", "too big"), ("sampling.top_k", "negative")]
    mapped = errors.map_exception(err)
    assert mapped.code is grpc.StatusCode.INVALID_ARGUMENT


def test_retry_info_and_codes_survive_the_hop() -> None:
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(3750)
    err = domain_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full",
                                 error_details_pb2.RetryInfo(retry_delay=delay)), tier="router")
    assert isinstance(err, errors.ResourceExhausted) and err.retry_after_s == 3.75
    assert isinstance(domain_error(rpc_error(grpc.StatusCode.NOT_FOUND, "no model"), tier="router"),
                      errors.NotFound)
    assert isinstance(domain_error(rpc_error(grpc.StatusCode.UNAVAILABLE, "down"), tier="router"),
                      TierUnavailable)
    denied = domain_error(rpc_error(grpc.StatusCode.PERMISSION_DENIED, "nope"), tier="router")
    assert isinstance(denied, errors.PermissionDenied) and denied.message == "router: nope"


def test_a_batch_request_error_round_trips() -> None:
    original = errors.InvalidArgument("request.sampling.temperature", "must be a number in [0, 2]")
    proto = errors.request_error_to_proto(original)
    code, back = errors.request_error_from_proto(proto)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(back, errors.InvalidArgument) and back.violations == original.violations
    code, back = errors.request_error_from_proto(errors.request_error_to_proto(RuntimeError("boom")))
    assert code is grpc.StatusCode.INTERNAL and isinstance(back, errors.Internal)
    assert "boom" not in back.message  # internals never leak

"""The error types every tier raises, and the one table that maps them to gRPC status.

Domain code (``core.py`` of each tier) raises these and never imports grpc; the
interceptor in :mod:`services.common.interceptors` turns them into a status with
``google.rpc`` details.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmesh.common.v1 import common_pb2
from services.common.violations import FieldViolation


class LlmeshError(Exception):
    """Base of every llmesh error: one human-readable message."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(LlmeshError, ValueError):
    """A request field is out of range or malformed; names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, description: str, *, more: list[FieldViolation] | None = None):
        super().__init__(f"{field}: {description}")
        self.violations = [FieldViolation(field, description), *(more or [])]

    @classmethod
    def many(cls, violations: list[FieldViolation]) -> InvalidArgument:
        first, *rest = violations
        err = cls(first.field, first.description, more=rest)
        if rest:
            err.message = "; ".join(f"{v.field}: {v.description}" for v in violations)
            err.args = (err.message,)
        return err

    @property
    def field(self) -> str:
        return self.violations[0].field


class NotFound(LlmeshError):
    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(LlmeshError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(LlmeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(LlmeshError):
    """Over a quota or a queue bound; tells the caller when to come back."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(LlmeshError):
    """No healthy replica or zone can serve right now."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(LlmeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(LlmeshError):
    code = grpc.StatusCode.CANCELLED


class FailedPrecondition(LlmeshError):
    """The system is not in a state to do this (e.g. tokenizer checksum mismatch)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Internal(LlmeshError):
    code = grpc.StatusCode.INTERNAL


# One table: exception type -> gRPC status code. Checked in order, most specific first.
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Cancelled, grpc.StatusCode.CANCELLED),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Internal, grpc.StatusCode.INTERNAL),
    # Plain ValueErrors from validation helpers without a field still mean bad input.
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


@dataclass
class MappedStatus:
    code: grpc.StatusCode
    message: str
    details: list[object] = field(default_factory=list)

    def to_grpc_status(self) -> grpc.Status:
        proto = status_pb2.Status(code=self.code.value[0], message=self.message)
        for detail in self.details:
            proto.details.add().Pack(detail)
        return rpc_status.to_status(proto)


def map_exception(exc: BaseException) -> MappedStatus:
    """Map an exception to a status code, message and google.rpc details."""
    code = grpc.StatusCode.INTERNAL
    for exc_type, mapped in STATUS_TABLE:
        if isinstance(exc, exc_type):
            code = mapped
            break
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    if code is grpc.StatusCode.INTERNAL and not isinstance(exc, LlmeshError):
        # Never leak internals (or request text) of unexpected errors to callers.
        message = f"internal error ({type(exc).__name__})"
    details: list[object] = []
    if isinstance(exc, InvalidArgument):
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=v.field, description=v.description
                    )
                    for v in exc.violations
                ]
            )
        )
    elif isinstance(exc, ResourceExhausted):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(max(1, int(exc.retry_after_s * 1000)))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    return MappedStatus(code, message, details)


# The reverse direction: a status received from another tier becomes the same domain
# error again, with every google.rpc detail, so errors cross hops unchanged.
_CODE_TO_ERROR: dict[grpc.StatusCode, type[LlmeshError]] = {
    code: exc_type for exc_type, code in STATUS_TABLE if issubclass(exc_type, LlmeshError)
}


def public_field(path: str, prefixes: tuple[str, ...]) -> str:
    """A violation's field path as the caller's request names it: the first of
    ``prefixes`` it starts with (an internal request's wrapper) removed."""
    for prefix in prefixes:
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def with_public_fields(exc: LlmeshError, prefixes: tuple[str, ...]) -> LlmeshError:
    """``exc`` with its field violations' paths as :func:`public_field` gives them (an
    error raised in this process by a tier's code that names its own request's fields)."""
    if not isinstance(exc, InvalidArgument):
        return exc
    return InvalidArgument.many([FieldViolation(public_field(v.field, prefixes), v.description)
                                 for v in exc.violations])


def error_from_status(
    code: grpc.StatusCode, message: str, status: status_pb2.Status | None = None,
    *, field_prefixes: tuple[str, ...] = (),
) -> LlmeshError:
    """The llmesh error a peer's status stands for, keeping BadRequest and RetryInfo.

    ``field_prefixes`` are stripped from violation field paths: an internal request
    wraps the public fields (``request.sampling.seed`` is the caller's ``sampling.seed``).
    """

    def public(path: str) -> str:
        return public_field(path, field_prefixes)

    details = list(status.details) if status is not None else []
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        violations: list[FieldViolation] = []
        for detail in details:
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad):
                violations += [FieldViolation(public(v.field), v.description) for v in bad.field_violations]
        if violations:
            return InvalidArgument.many(violations)
        return InvalidArgument("request", message)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        delay = 1.0
        for detail in details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                delay = info.retry_delay.ToMilliseconds() / 1000
        return ResourceExhausted(message, retry_after_s=delay)
    return _CODE_TO_ERROR.get(code, Internal)(message)


def error_from_rpc(err: grpc.aio.AioRpcError, *, field_prefixes: tuple[str, ...] = ()) -> LlmeshError:
    """:func:`error_from_status` of a failed call."""
    code = err.code()
    return error_from_status(
        code, err.details() or code.name, rpc_status.from_call(err), field_prefixes=field_prefixes
    )


_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def request_error_to_proto(exc: BaseException) -> common_pb2.RequestError:
    """One request's failure inside a multi-request call, mapped like a whole call's."""
    mapped = map_exception(exc)
    out = common_pb2.RequestError(code=mapped.code.value[0], message=mapped.message)
    if isinstance(exc, InvalidArgument):
        out.field_violations.extend(
            common_pb2.FieldViolation(field=v.field, description=v.description) for v in exc.violations
        )
    elif isinstance(exc, ResourceExhausted):
        out.retry_after_s = exc.retry_after_s
    return out


def request_error_from_proto(
    proto: common_pb2.RequestError, *, field_prefixes: tuple[str, ...] = ()
) -> tuple[grpc.StatusCode, LlmeshError]:
    """The status code and llmesh error of one failed request of a multi-request call
    (``field_prefixes`` are stripped from violation paths as in :func:`error_from_status`)."""
    code = _CODE_BY_NUMBER.get(proto.code, grpc.StatusCode.UNKNOWN)
    violations = [FieldViolation(public_field(v.field, field_prefixes), v.description)
                  for v in proto.field_violations]
    if code is grpc.StatusCode.INVALID_ARGUMENT and violations:
        return code, InvalidArgument.many(violations)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and proto.retry_after_s > 0:
        return code, ResourceExhausted(proto.message or code.name, retry_after_s=proto.retry_after_s)
    return code, error_from_status(code, proto.message or code.name)

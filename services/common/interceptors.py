"""The server interceptor that maps exceptions to status codes and counts RPCs.

It is the single place where domain errors become gRPC statuses (see errors.py).
``grpc.aio.AbortError`` (a servicer that already aborted) passes through untouched,
as does ``asyncio.CancelledError`` (the client went away). A request message that does
not parse (undecodable bytes, invalid UTF-8 in a string field) is the caller's fault and
becomes ``INVALID_ARGUMENT``; grpc itself would answer ``UNKNOWN`` with a class name.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.common.errors import InvalidArgument, LlmeshError, map_exception
from services.common.metrics import RPC_LATENCY, RPC_REQUESTS

log = logging.getLogger(__name__)


async def _abort_mapped(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    mapped = map_exception(exc)
    if mapped.code is grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method, exc_info=exc)
    await context.abort_with_status(mapped.to_grpc_status())


def _code_of(context: grpc.aio.ServicerContext, default: str = "OK") -> str:
    code = context.code()
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code.name
    return str(code)


class _Undecodable:
    """What the request deserializer returns for bytes that do not parse, so the handler
    (not grpc's own exception path) answers, with INVALID_ARGUMENT."""

    __slots__ = ("message_type",)

    def __init__(self, message_type: str) -> None:
        self.message_type = message_type

    def error(self) -> InvalidArgument:
        return InvalidArgument(
            "request",
            f"is not a valid {self.message_type} message (undecodable bytes, or invalid "
            "UTF-8 in a string field)",
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    message_type = getattr(descriptor, "full_name", "request")

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:  # protobuf's DecodeError, or a custom deserializer's ValueError
            return _Undecodable(message_type)

    return deserialize


def _checked(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise request.error()
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def refusing_handler(
    handler: grpc.RpcMethodHandler,
    error: LlmeshError,
    *,
    tier: str,
    method: str,
    on_refused: Callable[[grpc.aio.ServicerContext], None] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler for ``handler``'s method that answers ``error`` without reading the request.

    For an interceptor that refuses a call on its metadata alone (a missing API key): it
    is registered as client-streaming whatever the method is, and grpc only receives a
    request message when a client-streaming handler asks for one, so the payload of a
    refused call is never buffered whole nor parsed (a unary handler's message is read
    before the handler runs). ``on_refused`` sees the context (the peer) first.
    """
    short = method.rsplit("/", 1)[-1]

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        RPC_REQUESTS.labels(tier, short, map_exception(error).code.name, "call").inc()
        if on_refused is not None:
            on_refused(context)
        await context.abort_with_status(map_exception(error).to_grpc_status())

    if handler.response_streaming:
        async def refuse_stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await refuse(requests, context)
            return
            yield  # an async generator, as every stream handler behind the tracing interceptor

        return grpc.stream_stream_rpc_method_handler(
            refuse_stream, request_deserializer=None, response_serializer=handler.response_serializer
        )
    return grpc.stream_unary_rpc_method_handler(
        refuse, request_deserializer=None, response_serializer=handler.response_serializer
    )


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wrap every handler: map exceptions, count by code, time the call."""

    def __init__(self, tier: str) -> None:
        self.tier = tier

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        short = method.rsplit("/", 1)[-1]
        tier = self.tier

        def finish(context: grpc.aio.ServicerContext, start: float, code: str) -> None:
            RPC_REQUESTS.labels(tier, short, code, "call").inc()
            RPC_LATENCY.labels(tier, short).observe(time.perf_counter() - start)

        if handler.unary_unary or handler.stream_unary:
            inner_unary = handler.unary_unary or handler.stream_unary

            streaming_requests = handler.stream_unary is not None and handler.unary_unary is None

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                code = "OK"
                try:
                    request = _checked_stream(request) if streaming_requests else _checked(request)
                    return await inner_unary(request, context)
                except grpc.aio.AbortError:
                    code = _code_of(context, "UNKNOWN")
                    raise
                except asyncio.CancelledError:
                    code = "CANCELLED"
                    raise
                except Exception as exc:
                    code = map_exception(exc).code.name
                    await _abort_mapped(context, exc, method)
                finally:
                    finish(context, start, code)

            factory = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary
                else grpc.stream_unary_rpc_method_handler
            )
            return factory(
                unary,
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )

        inner_stream = handler.unary_stream or handler.stream_stream
        streaming_requests = handler.stream_stream is not None

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            code = "OK"
            result: Any = None
            try:
                request = _checked_stream(request) if streaming_requests else _checked(request)
                result = inner_stream(request, context)
                if inspect.isawaitable(result):
                    # A handler that writes with context.write() (grpc's health Watch does).
                    await result
                else:
                    async for item in result:
                        yield item
            except grpc.aio.AbortError:
                code = _code_of(context, "UNKNOWN")
                raise
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception as exc:
                code = map_exception(exc).code.name
                await _abort_mapped(context, exc, method)
            finally:
                if result is not None and inspect.isasyncgen(result):
                    # Closed here, in this task: left to the garbage collector, its
                    # clean-up would run later in another task (and context).
                    await result.aclose()
                finish(context, start, code)

        factory = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
        )
        return factory(
            stream,
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

"""The server interceptor that maps exceptions to status codes and counts RPCs.

It is the single place where domain errors become gRPC statuses (see errors.py).
``grpc.aio.AbortError`` (a servicer that already aborted) passes through untouched,
as does ``asyncio.CancelledError`` (the client went away).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.common.errors import map_exception
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
            RPC_REQUESTS.labels(tier, short, code).inc()
            RPC_LATENCY.labels(tier, short).observe(time.perf_counter() - start)

        if handler.unary_unary or handler.stream_unary:
            inner_unary = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start = time.perf_counter()
                code = "OK"
                try:
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
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        inner_stream = handler.unary_stream or handler.stream_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            code = "OK"
            try:
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
                finish(context, start, code)

        factory = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
        )
        return factory(
            stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

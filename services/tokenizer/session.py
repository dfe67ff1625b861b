"""Many Encode requests over one stream (the tokenizer's ``Session``).

The gateway asks the tokenizer once per request, before anything else of the request
can start. As a unary call that is a grpc.aio call of its own each time, with its HTTP/2
stream, its interceptors and a wake-up of gRPC's threads on both sides; over a Session
it is an entry in a message on a stream (a framed connection, services/common/sessionwire.py)
the gateway keeps open.

An :class:`EncodeMux` serves one Session call. Each request runs the same
:meth:`TokenizerCore.encode` as ``Encode`` (the same validation, field names, batching
of encodes that arrive together, limits), in a task of its own, and its result or error
joins the frame being filled: what is ready in one event-loop iteration goes out as one
frame. A request's failure is its own error, never the stream's; when the caller's input
ends, the requests still encoding are answered before the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from opentelemetry import propagate, trace

from llmesh.tokenizer.v1 import tokenizer_pb2
from services.common.errors import InvalidArgument, LlmeshError, map_exception, request_error_to_proto
from services.common.metrics import record_request
from services.common.tracing import tracer
from services.tokenizer import convert
from services.tokenizer.core import EncodeInput, TokenizerCore
from services.tokenizer.metrics import count_encoded

log = logging.getLogger(__name__)


class EncodeMux:
    """The requests of one Session call, answered by handle."""

    def __init__(self, core: TokenizerCore) -> None:
        self.core = core
        self._tasks: set[asyncio.Task[None]] = set()
        self._frame = tokenizer_pb2.SessionResponse()
        self._flush_scheduled = False
        self._out: asyncio.Queue[tokenizer_pb2.SessionResponse | None] = asyncio.Queue()

    async def serve(
        self, messages: AsyncIterator[tokenizer_pb2.SessionRequest]
    ) -> AsyncIterator[tokenizer_pb2.SessionResponse]:
        """The frames answering ``messages``; ends after the input ended and every request
        was answered. Leaving early (the caller went away) cancels what is still encoding."""
        reader = asyncio.ensure_future(self._read(messages))
        try:
            while (frame := await self._out.get()) is not None:
                yield frame
            await reader  # a broken input ends the call with its error
        finally:
            reader.cancel()
            for task in list(self._tasks):
                task.cancel()

    async def _read(self, messages: AsyncIterator[tokenizer_pb2.SessionRequest]) -> None:
        try:
            async for message in messages:
                for entry in message.encodes:
                    self._start(entry)
            if self._tasks:
                await asyncio.wait(set(self._tasks))
        finally:
            self._flush()
            self._out.put_nowait(None)

    def _start(self, entry: tokenizer_pb2.SessionEncode) -> None:
        started = time.perf_counter()
        parent = propagate.extract({"traceparent": entry.traceparent}) if entry.traceparent else None
        span = tracer().start_span(
            "llmesh.tokenizer/Session.encode", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"llmesh.handle": entry.handle},
        )
        if not entry.handle:
            self._fail(entry.handle, InvalidArgument("encodes.handle", "0 is not a handle"), span, started)
            return
        item = convert.encode_input_from_proto(entry.input)
        task = asyncio.ensure_future(self._encode(entry.handle, item, span, started))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _encode(self, handle: int, item: EncodeInput, span: trace.Span, started: float) -> None:
        try:
            with trace.use_span(span, end_on_exit=False):
                result = await self.core.encode(item, "input")
                count_encoded(item, result)
        except asyncio.CancelledError:
            span.end()
            raise
        except Exception as exc:
            self._fail(handle, exc, span, started)
            return
        self._frame.results.add(handle=handle, result=convert.encode_result_to_proto(result))
        span.end()
        record_request("tokenizer", "Encode", "OK", time.perf_counter() - started)
        self._schedule()

    def _fail(self, handle: int, error: Exception, span: trace.Span, started: float) -> None:
        if not isinstance(error, LlmeshError):
            log.error("request %d failed in the tokenizer", handle, exc_info=error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
        span.end()
        record_request("tokenizer", "Encode", map_exception(error).code.name, time.perf_counter() - started)
        self._frame.errors.add(handle=handle, error=request_error_to_proto(error))
        self._schedule()

    def _schedule(self) -> None:
        # Everything answered in this iteration goes out as one frame.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._frame.results or self._frame.errors:
            frame, self._frame = self._frame, tokenizer_pb2.SessionResponse()
            self._out.put_nowait(frame)

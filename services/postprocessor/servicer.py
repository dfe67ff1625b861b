"""PostprocessService servicer: one bidirectional stream per request (``Process``), or
many requests multiplexed over one long-lived stream (``Session``).

Protocol (see postprocess.proto): a ProcessConfig first, then ProcessTokens deltas, then
ProcessEnd. Text deltas go back as they become safe, then exactly one ProcessFinal. A
stop string or a blocked match sends ProcessFinal at once; the caller then stops the
engine, whatever it still sends is ignored, and the call ends when the caller closes its
side (or after ``final_drain_seconds``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from llmesh.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from services.common.errors import InvalidArgument
from services.postprocessor import convert, metrics
from services.postprocessor.core import PostprocessCore, PostprocessSession, Step
from services.postprocessor.session import PostprocessMux

log = logging.getLogger(__name__)

# Tokens processed between two yields to the event loop (a few milliseconds of work).
SLICE_TOKENS = 256

SERVICE_NAME = postprocess_pb2.DESCRIPTOR.services_by_name["PostprocessService"].full_name


class PostprocessServicer(postprocess_pb2_grpc.PostprocessServiceServicer):
    """Ending a call while the caller is still writing makes the caller's next write
    fail, and grpc.aio clients then report INTERNAL ("Failed execute_batch") instead of
    the status the server sent (grpc/grpc#36066). So before the call ends early, after a
    final or an error, the servicer keeps reading and ignoring the caller's messages until
    it half-closes or cancels, for a bounded time.
    """

    def __init__(self, core: PostprocessCore, *, final_drain_seconds: float = 30.0,
                 error_drain_seconds: float = 1.0) -> None:
        self.core = core
        self.final_drain_seconds = final_drain_seconds
        self.error_drain_seconds = error_drain_seconds

    @staticmethod
    async def _drain(requests: AsyncIterator[postprocess_pb2.ProcessRequest], seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                async for _ in requests:
                    pass
        except TimeoutError:
            log.debug("caller kept its stream open %.1fs after the end of its call", seconds)

    async def Process(
        self,
        request_iterator: AsyncIterator[postprocess_pb2.ProcessRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[postprocess_pb2.ProcessResponse]:
        try:
            async for response in self._process(request_iterator):
                yield response
        except Exception:
            # Bad input: let the caller finish writing, so it sees this status (above).
            await self._drain(request_iterator, self.error_drain_seconds)
            raise

    async def Session(
        self,
        request_iterator: AsyncIterator[postprocess_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[postprocess_pb2.SessionResponse]:
        """Many requests over one stream: each message is answered by at most one frame
        (services/postprocessor/session.py); failures are per request, never the call's."""
        mux = PostprocessMux(self.core)
        try:
            async for message in request_iterator:
                frame = await mux.step(convert.session_input_from_proto(message))
                if frame:
                    yield convert.frame_to_proto(frame)
        finally:
            mux.close()

    async def _process(
        self, request_iterator: AsyncIterator[postprocess_pb2.ProcessRequest]
    ) -> AsyncIterator[postprocess_pb2.ProcessResponse]:
        session: PostprocessSession | None = None
        async for request in request_iterator:
            kind = request.WhichOneof("kind")
            if session is None:
                if kind != "config":
                    raise InvalidArgument("config", "the first message of a stream must be a ProcessConfig")
                session = self.core.open(convert.session_config_from_proto(request.config))
                metrics.REQUESTS.labels(session.model.name).inc()
                continue
            if kind == "tokens":
                ids = list(request.tokens.token_ids)
                session.check(ids)
                metrics.TOKENS.labels(session.model.name).inc(len(ids))
                # A replay can carry thousands of tokens in one message: process it in
                # slices and let other streams on this event loop run in between.
                step: Step = Step("")
                for offset in range(0, len(ids), SLICE_TOKENS):
                    if offset:
                        await asyncio.sleep(0)
                    step = session.feed(ids[offset:offset + SLICE_TOKENS])
                    if step.final is not None or offset + SLICE_TOKENS >= len(ids):
                        break  # the last slice's text and final are sent below
                    if step.text:
                        yield convert.delta(step.text)
            elif kind == "end":
                step = session.end(convert.upstream_from_proto(request.end.finish_reason))
            elif kind == "config":
                raise InvalidArgument("config", "a stream takes one ProcessConfig, at its start")
            else:
                raise InvalidArgument("kind", "empty ProcessRequest: set config, tokens or end")
            if step.text:
                yield convert.delta(step.text)
            if step.final is not None:
                metrics.FINISHES.labels(step.final.finish_reason.value).inc()
                span = trace.get_current_span()
                span.set_attribute("llmesh.model", session.model.name)
                span.set_attribute("llmesh.finish_reason", step.final.finish_reason.value)
                span.set_attribute("llmesh.completion_tokens", step.final.completion_tokens)
                span.set_attribute("llmesh.redactions", step.final.redactions)
                if step.final.matched_stop:
                    metrics.STOP_STRING_HITS.labels(session.model.name).inc()
                log.debug("stream finished: %s after %d tokens, %d redactions",
                          step.final.finish_reason.value, step.final.completion_tokens,
                          step.final.redactions)
                yield convert.final(step.final)
                if kind != "end":
                    # The caller may have sent more tokens before it saw the final.
                    await self._drain(request_iterator, self.final_drain_seconds)
                return
        if session is None:
            raise InvalidArgument("config", "the stream closed before its ProcessConfig")
        raise InvalidArgument("end", "the stream closed before ProcessEnd")

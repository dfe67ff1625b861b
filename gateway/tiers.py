"""gRPC clients for the tiers behind the gateway (the implementations of core's protocols)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from opentelemetry import propagate

from gateway import convert
from gateway.core import TierUnavailable
from gateway.types import (
    ChatTurn,
    Encoded,
    ModelMeta,
    PostConfig,
    PostDelta,
    PostFinal,
    RouterDelta,
    RouterFinal,
    TokenGeneration,
)
from llmesh.common.v1 import common_pb2
from llmesh.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from llmesh.router.v1 import router_pb2, router_pb2_grpc
from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import errors, generation_convert
from services.common.channels import broken_link, create_channel
from services.common.settings import TlsSettings

# A peer that vanished mid-call shows up as one of these.
_TRANSPORT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}

TOKENIZER_FIELD_PREFIXES = ("input.",)
"""The tokenizer's EncodeRequest wraps the public request's input fields in ``input``."""

ROUTER_FIELD_PREFIXES = ("request.",)
"""The router's GenerateRequest wraps the public request's fields in ``request``."""


def is_transport_failure(err: grpc.aio.AioRpcError) -> bool:
    code = err.code()
    if code in _TRANSPORT_CODES:
        return True
    details = err.details() or ""
    return code is grpc.StatusCode.INTERNAL and broken_link(details)


def domain_error(err: grpc.aio.AioRpcError, *, tier: str, strip: Sequence[str] = ()) -> errors.LlmeshError:
    """Turn a downstream status into the domain error the gateway re-raises.

    Field violations keep their details with the internal prefix (``strip``) removed,
    so the caller sees public field paths; the tier's name prefixes other messages.
    """
    code = err.code()
    message = err.details() or code.name
    if is_transport_failure(err):
        return TierUnavailable(f"{tier}: {message}")
    return tier_prefixed(errors.error_from_rpc(err, field_prefixes=tuple(strip)), tier)


def request_error(
    proto: common_pb2.RequestError, *, tier: str, strip: Sequence[str] = ()
) -> errors.LlmeshError:
    """:func:`domain_error` of one request's error inside a Session frame: the same
    mapping as the status of a call of its own would get."""
    code, mapped = errors.request_error_from_proto(proto, field_prefixes=tuple(strip))
    message = proto.message or code.name
    if code in _TRANSPORT_CODES or (code is grpc.StatusCode.INTERNAL and broken_link(message)):
        return TierUnavailable(f"{tier}: {message}")
    return tier_prefixed(mapped, tier)


def tier_prefixed(mapped: errors.LlmeshError, tier: str) -> errors.LlmeshError:
    # Field violations and RetryInfo speak to the caller as they are; other messages say
    # which tier answered.
    if not isinstance(mapped, errors.InvalidArgument | errors.ResourceExhausted):
        mapped.message = f"{tier}: {mapped.message}"
        mapped.args = (mapped.message,)
    return mapped


class _Replicas:
    def __init__(self, targets: Sequence[str], tls: TlsSettings | None, server_name: str = "", *,
                 traced: bool = True) -> None:
        """``traced=False``: channels without OpenTelemetry's client interceptor (the caller
        then carries the trace context itself, see :func:`trace_metadata`)."""
        if not targets:
            raise ValueError("at least one target is required")
        self.targets = list(targets)
        self.channels = [
            create_channel(t, tls=tls, server_name_override=server_name,
                           interceptors=None if traced else [])
            for t in self.targets
        ]

    @property
    def replicas(self) -> int:
        return len(self.channels)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's W3C trace context as call metadata: what OpenTelemetry's client
    interceptor would send, for a call made without it."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


class GrpcTokenizerTier(_Replicas):
    """Tokenizer replicas; a failed replica is skipped for the next one.

    Every request waits for its Encode before anything else can start, so the call is
    made without OpenTelemetry's aio client interceptor: that interceptor runs each call
    in a task of its own and starts a client span, about 0.3 ms of gateway CPU and of
    time to first token per request on a 2-core machine (measured: Encode round trip
    1.9 -> 1.5 ms, gateway CPU 780 -> 510 us per call). The trace is not cut: the call
    carries the ``traceparent`` of the gateway's ``gateway.tokenize`` span, and the
    tokenizer's server span hangs under it.
    """

    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        super().__init__(targets, tls, server_name, traced=False)
        self.stubs = [tokenizer_pb2_grpc.TokenizerServiceStub(c) for c in self.channels]
        self._next = 0

    async def _call(self, method: str, request: object, timeout: float | None) -> object:
        last: TierUnavailable | None = None
        for _ in range(self.replicas):
            replica = self._next
            self._next = (self._next + 1) % self.replicas
            try:
                return await self._attempt(replica, method, request, timeout)
            except TierUnavailable as exc:
                last = exc
        assert last is not None
        raise last

    async def _attempt(self, replica: int, method: str, request: object, timeout: float | None) -> object:
        """One replica's answer; raises the domain error (TierUnavailable: try another)."""
        try:
            call = getattr(self.stubs[replica], method)
            return await call(request, timeout=timeout, metadata=trace_metadata())
        except grpc.aio.AioRpcError as err:
            raise domain_error(err, tier="tokenizer", strip=TOKENIZER_FIELD_PREFIXES) from None

    async def encode(
        self, model: str, prompt: str, messages: list[ChatTurn], *,
        add_generation_prompt: bool | None, timeout: float | None,
    ) -> Encoded:
        request = tokenizer_pb2.EncodeRequest(input=convert.encode_input(
            model, prompt, messages, add_generation_prompt
        ))
        reply = await self._call("Encode", request, timeout)
        assert isinstance(reply, tokenizer_pb2.EncodeResponse)
        r = reply.result
        return Encoded(model=r.model, token_ids=list(r.token_ids),
                       tokenizer_checksum=r.tokenizer_checksum, truncated=r.truncated)

    async def list_models(self, *, timeout: float | None) -> list[ModelMeta]:
        reply = await self._call("ListModels", tokenizer_pb2.ListModelsRequest(), timeout)
        assert isinstance(reply, tokenizer_pb2.ListModelsResponse)
        return [
            ModelMeta(id=m.model, max_context_length=m.max_context_length,
                      tokenizer_checksum=m.tokenizer_checksum, is_default=m.is_default,
                      vocab_size=m.vocab_size)
            for m in reply.models
        ]


class GrpcRouterTier(_Replicas):
    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        super().__init__(targets, tls, server_name)
        self.stubs = [router_pb2_grpc.RouterServiceStub(c) for c in self.channels]

    async def generate(
        self, replica: int, request: TokenGeneration, *, resume_token_ids: list[int],
        resumed: int, timeout: float | None,
        on_delta: Callable[[RouterDelta], None] | None = None,
    ) -> AsyncIterator[RouterDelta | RouterFinal]:
        """One Generate call; its deltas are yielded (``on_delta`` is the protocol's
        option, unused here: the call's reads wake this generator anyway)."""
        message = convert.router_generate_request(request, resume_token_ids, resumed)
        call = self.stubs[replica % self.replicas].Generate(message, timeout=timeout)
        try:
            async for reply in call:
                if reply.HasField("delta"):
                    yield RouterDelta(
                        token_ids=list(reply.delta.token_ids),
                        logprobs=convert.logprobs_from_common(reply.delta.logprobs),
                    )
                elif reply.HasField("final"):
                    # Keep reading until the router closes the stream, so the call (and
                    # its client span) ends normally rather than by cancellation.
                    yield generation_convert.router_final_from_proto(reply.final)
        except grpc.aio.AioRpcError as err:
            raise domain_error(err, tier="router", strip=ROUTER_FIELD_PREFIXES) from None
        finally:
            call.cancel()

    async def abort(self, replica: int, request_id: str) -> None:
        try:
            await self.stubs[replica % self.replicas].Abort(
                router_pb2.AbortRequest(request_id=request_id), timeout=2.0
            )
        except grpc.aio.AioRpcError as err:
            if err.code() is not grpc.StatusCode.NOT_FOUND:
                raise domain_error(err, tier="router", strip=ROUTER_FIELD_PREFIXES) from None


class GrpcPostSession:
    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.closed = False

    async def _write(self, request: postprocess_pb2.ProcessRequest) -> None:
        try:
            await self.call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
            raise TierUnavailable(f"postprocessor: write failed ({type(err).__name__})") from None

    async def send_tokens(self, token_ids: list[int]) -> None:
        await self._write(postprocess_pb2.ProcessRequest(
            tokens=postprocess_pb2.ProcessTokens(token_ids=token_ids)
        ))

    async def send_end(self, finish_reason: str) -> None:
        await self._write(postprocess_pb2.ProcessRequest(
            end=postprocess_pb2.ProcessEnd(
                finish_reason=convert.upstream_finish(finish_reason)  # type: ignore[arg-type]
            )
        ))

    async def read(self) -> PostDelta | PostFinal | None:
        try:
            reply = await self.call.read()
        except grpc.aio.AioRpcError as err:
            raise domain_error(err, tier="postprocessor") from None
        if reply is grpc.aio.EOF:
            return None
        if reply.HasField("delta"):
            return PostDelta(text=reply.delta.text)
        return convert.post_final(reply.final)

    async def close(self, graceful: bool = False) -> None:
        """Gracefully: half-close and drain to EOF so the call (and its span) ends
        normally, cancelling if the replica does not finish promptly. Otherwise cancel."""
        if self.closed:
            return
        self.closed = True
        if not graceful:
            self.call.cancel()
            return
        try:
            await asyncio.wait_for(self._drain(), 2.0)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self.call.cancel()

    async def _drain(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self.call.done_writing()
        while await self.call.read() is not grpc.aio.EOF:
            pass


class GrpcPostprocessorTier(_Replicas):
    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        super().__init__(targets, tls, server_name)
        self.stubs = [postprocess_pb2_grpc.PostprocessServiceStub(c) for c in self.channels]

    async def open(self, replica: int, config: PostConfig, *, timeout: float | None) -> GrpcPostSession:
        call = self.stubs[replica % self.replicas].Process(
            timeout=None if timeout is None or math.isinf(timeout) else timeout
        )
        session = GrpcPostSession(call)
        await session._write(postprocess_pb2.ProcessRequest(config=convert.process_config(config)))
        return session

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await super().close()

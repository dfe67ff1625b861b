"""What stands between a request and its first token at the gateway (issue #17), checked
without clocks: which calls are made, in which order, and what they carry.

Real grpc.aio servers on port 0 with the tiers' tracing interceptor; spans go to the SDK's
in-memory exporter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.core import Deadline, GatewayCore, TierUnavailable
from gateway.tenants import Tenant, TenantRegistry
from gateway.tiers import GrpcTokenizerTier
from gateway.types import (
    ChatTurn,
    Encoded,
    Final,
    FinishReason,
    GenerateCall,
    ModelMeta,
    PostConfig,
    PostDelta,
    PostFinal,
    RouterDelta,
    RouterFinal,
    TextDelta,
    TokenGeneration,
)
from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import tracing


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", lambda name, version=None, tracer_provider=None, schema_url=None,
                        attributes=None: provider.get_tracer(name, version, schema_url))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    yield exporter, provider
    provider.shutdown()


class _Tokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    async def Encode(self, request, context):  # type: ignore[no-untyped-def]
        return tokenizer_pb2.EncodeResponse(result=tokenizer_pb2.EncodeResult(
            model=request.input.model, token_ids=[1, 2, 3], count=3))


async def test_encode_runs_without_a_client_span_and_keeps_the_trace(
    spans: tuple[InMemorySpanExporter, TracerProvider],
) -> None:
    """The Encode call is made without OpenTelemetry's client interceptor (a task and a
    client span per call, ~0.3 ms of every request's time to first token), and the
    tokenizer's server span still hangs under the gateway's span of the request."""
    exporter, provider = spans
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(_Tokenizer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port
    await server.start()
    tier = GrpcTokenizerTier([f"127.0.0.1:{port}"])
    try:
        with provider.get_tracer("test").start_as_current_span("gateway.tokenize") as parent:
            encoded = await tier.encode("m", "hello", [], add_generation_prompt=None, timeout=10)
        assert encoded.token_ids == [1, 2, 3]
        finished = exporter.get_finished_spans()
        kinds = sorted((s.name, s.kind.name) for s in finished)
        assert kinds == [("/llmesh.tokenizer.v1.TokenizerService/Encode", "SERVER"),
                         ("gateway.tokenize", "INTERNAL")]
        (served,) = (s for s in finished if s.kind is trace.SpanKind.SERVER)
        assert served.parent is not None
        assert served.parent.span_id == parent.get_span_context().span_id
        assert served.context.trace_id == parent.get_span_context().trace_id
    finally:
        await tier.close()
        await server.stop(0)


class _Tiers:
    """Instant tokenizer, router and postprocessor doubles that log what is asked of them."""

    replicas = 1

    def __init__(self, encode_turns: int = 5, fail_opens: int = 0) -> None:
        self.log: list[str] = []
        self.replies: asyncio.Queue[PostDelta | PostFinal] = asyncio.Queue()
        self.encode_turns = encode_turns
        """Event-loop turns an encode takes (a round trip takes several)."""
        self.fail_opens = fail_opens
        """Opens that fail as an unreachable replica does, before the next one succeeds."""

    # tokenizer
    async def list_models(self, *, timeout: float | None) -> list[ModelMeta]:
        return [ModelMeta(id="m", max_context_length=4096, tokenizer_checksum="", is_default=True)]

    async def encode(self, model: str, prompt: str, messages: list[ChatTurn], *,
                     add_generation_prompt: bool | None, timeout: float | None) -> Encoded:
        self.log.append("tokenizer.encode")
        for _ in range(self.encode_turns):
            await asyncio.sleep(0)
        self.log.append("tokenizer.encoded")
        return Encoded(model=model, token_ids=[1, 2, 3], tokenizer_checksum="")

    # router
    async def generate(self, replica: int, request: TokenGeneration, *, resume_token_ids: list[int],
                       resumed: int, timeout: float | None,
                       on_delta: object = None) -> AsyncIterator[RouterDelta | RouterFinal]:
        self.log.append("router.generate")
        yield RouterDelta(token_ids=[7])
        yield RouterFinal(Final(FinishReason.LENGTH))

    async def abort(self, replica: int, request_id: str) -> None:
        return None

    # postprocessor
    async def open(self, replica: int, config: PostConfig, *, timeout: float | None) -> _Tiers:
        self.log.append("postprocessor.open")
        if self.fail_opens:
            self.fail_opens -= 1
            raise TierUnavailable("postprocessor: connection refused")
        return self

    async def send_tokens(self, token_ids: list[int]) -> None:
        self.log.append("postprocessor.tokens")
        self.replies.put_nowait(PostDelta(text="x"))

    async def send_end(self, finish_reason: str) -> None:
        self.replies.put_nowait(PostFinal(finish_reason="length", matched_stop="", completion_tokens=1))

    async def read(self) -> PostDelta | PostFinal:
        return await self.replies.get()

    async def close(self, graceful: bool = False) -> None:
        self.log.append("postprocessor.close")


async def test_the_postprocessor_request_opens_after_the_router_submission() -> None:
    """The encode first, then the router submission, then the postprocessor's open: its
    set-up is off the first token's path (the router, the worker and the engine take
    longer), and the tokens that came before it are replayed into it."""
    for turns in (0, 5):
        tiers = _Tiers(encode_turns=turns)
        core = GatewayCore(tiers, tiers, tiers, tenants=TenantRegistry([]))  # type: ignore[arg-type]
        items = [item async for item in core.generate_stream(
            Tenant(name="t"), GenerateCall(prompt="hello"), Deadline.after(10))]
        assert [i.text for i in items if isinstance(i, TextDelta)] == ["x"]
        assert tiers.log == ["tokenizer.encode", "tokenizer.encoded", "router.generate", "postprocessor.open",
                             "postprocessor.tokens", "postprocessor.close"], turns


async def test_an_open_that_fails_is_made_again_aside() -> None:
    """The first replica refused the open: the failover policy's pause and the next
    replica's open go on aside while the request runs, and the tokens that came
    meanwhile are replayed into the new open."""
    tiers = _Tiers(fail_opens=1)
    core = GatewayCore(tiers, tiers, tiers, tenants=TenantRegistry([]))  # type: ignore[arg-type]
    items = [item async for item in core.generate_stream(
        Tenant(name="t"), GenerateCall(prompt="hello"), Deadline.after(10))]
    assert [i.text for i in items if isinstance(i, TextDelta)] == ["x"]
    assert tiers.log == ["tokenizer.encode", "tokenizer.encoded", "router.generate", "postprocessor.open",
                         "postprocessor.open", "postprocessor.tokens", "postprocessor.close"]


async def test_a_postprocessor_that_keeps_refusing_fails_the_request() -> None:
    """Every open refused: the request ends with the tier's error once the failover
    policy gives up, and no text reaches the client (nothing waits for a postprocessor
    that never opens)."""
    tiers = _Tiers(fail_opens=100)
    core = GatewayCore(tiers, tiers, tiers, tenants=TenantRegistry([]))  # type: ignore[arg-type]
    texts: list[str] = []
    with pytest.raises(TierUnavailable, match="postprocessor replicas keep failing"):
        async for item in core.generate_stream(Tenant(name="t"), GenerateCall(prompt="hello"),
                                               Deadline.after(10)):
            if isinstance(item, TextDelta):
                texts.append(item.text)
    assert texts == []
    assert tiers.log.count("postprocessor.open") >= 2

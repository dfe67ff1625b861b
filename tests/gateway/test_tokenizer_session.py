"""The gateway's tokenizer tier over Session calls (tokenizer_transport: session).

Against an in-process tokenizer: the encodes of one loop iteration share one
SessionRequest on the replica's framed listener and give what Encode calls give; a
request's error is the error Encode gives, with the public field named, and never the
session's; a replica without Session (a release before it) gets Encode calls; a dead
replica's request moves to the next one; a replica that never answers gives the
request's deadline. Through a mesh, the tokenizer's span of a request hangs under the
gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.tiers import GrpcTokenizerTier
from gateway.tokenizersession import SessionTokenizerTier
from gateway.types import ChatTurn
from llmesh.procs import free_port
from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import errors
from services.common.sessionwire import FramedCall
from services.tokenizer.server import build_core, build_server, warm_up
from services.tokenizer.servicer import TokenizerServicer
from services.tokenizer.settings import TokenizerSettings
from tests.tokenizer.helpers import running_server

MODEL = "tiny"


@pytest.fixture(scope="module")
async def tokenizer(tiny_deepseek_dir: Path) -> AsyncIterator[str]:
    settings = TokenizerSettings(port=0, models=[f"{MODEL}={tiny_deepseek_dir}"], drain_seconds=0)
    async with running_server(lambda: build_server(settings), warm_up, tier="tokenizer") as server:
        yield f"127.0.0.1:{server[0].port}"


ASKS: list[tuple[str, list[ChatTurn], bool | None]] = [
    ("The capital of France is", [], None),
    ("", [ChatTurn("user", "What is the capital of France?")], None),
    ("", [ChatTurn("system", "Be brief."), ChatTurn("user", "Hello 😀 上海")], False),
    ("a " * 300, [], None),
]


async def _encode_all(tier: GrpcTokenizerTier) -> list[Any]:
    return list(await asyncio.gather(*(
        tier.encode(MODEL, prompt, messages, add_generation_prompt=gen, timeout=10)
        for prompt, messages, gen in ASKS
    )))


async def test_encodes_of_one_iteration_share_a_message_and_match_encode_calls(tokenizer):
    calls = GrpcTokenizerTier([tokenizer])
    tier = SessionTokenizerTier([tokenizer])
    try:
        expected = await _encode_all(calls)
        assert await _encode_all(tier) == expected
        link = tier.links[0]
        assert link is not None and isinstance(link._call, FramedCall)
        assert link.messages_sent == 1  # four encodes asked for in one iteration: one message
        assert not link.requests
        # Every frame went to its requests from the read callback (no reader task woke).
        dispatched_in: list[bool] = []
        dispatch = link._dispatch
        link._dispatch = lambda frame: (  # type: ignore[method-assign]
            dispatched_in.append(asyncio.current_task() is not None), dispatch(frame))
        assert await _encode_all(tier) == expected
        assert dispatched_in and not any(dispatched_in), dispatched_in
        assert await _encode_all(tier) == expected
        assert tier.links[0] is link and tier.links.opened == 1  # the session stays open
        assert tier.links.openers[0].host is not None and await tier.links.openers[0].port() > 0
    finally:
        await tier.close()
        await calls.close()


async def test_the_lookup_channel_lets_its_connection_go_while_the_session_serves(
        tokenizer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The channel that only asked where the listener is closes its connection once idle
    (LOOKUP_IDLE_TIMEOUT_MS; a connected channel wakes gRPC's threads for its keepalive
    timer), and the session on the listener goes on serving."""
    from gateway import sessionlink

    monkeypatch.setattr(sessionlink, "LOOKUP_IDLE_TIMEOUT_MS", 300)
    tier = SessionTokenizerTier([tokenizer])
    try:
        first = await _encode_all(tier)
        channel = tier.links.channels[0]
        assert channel.get_state() is grpc.ChannelConnectivity.READY  # asked for the port
        deadline = asyncio.get_running_loop().time() + 10
        while channel.get_state() is not grpc.ChannelConnectivity.IDLE:
            assert asyncio.get_running_loop().time() < deadline, channel.get_state()
            await asyncio.sleep(0.05)
        assert await _encode_all(tier) == first
        assert tier.links.opened == 1 and channel.get_state() is grpc.ChannelConnectivity.IDLE
    finally:
        await tier.close()


async def _error(tier: GrpcTokenizerTier, model: str, prompt: str,
                 messages: list[ChatTurn]) -> errors.LlmeshError:
    with pytest.raises(errors.LlmeshError) as raised:
        await tier.encode(model, prompt, messages, add_generation_prompt=None, timeout=10)
    return raised.value


async def test_a_requests_error_is_the_error_of_encode(tokenizer):
    calls = GrpcTokenizerTier([tokenizer])
    tier = SessionTokenizerTier([tokenizer])
    bad = [
        ("gpt-17", "hello", []),                                   # unknown model
        (MODEL, "", []),                                           # neither prompt nor messages
        (MODEL, "hi", [ChatTurn("user", "both")]),                 # prompt and messages
        (MODEL, "", [ChatTurn("wizard", "hello")]),                # unknown role
    ]
    try:
        for model, prompt, messages in bad:
            want = await _error(calls, model, prompt, messages)
            got, fine = await asyncio.gather(
                _error(tier, model, prompt, messages),
                tier.encode(MODEL, "still fine", [], add_generation_prompt=None, timeout=10),
            )
            assert (type(got), got.message, getattr(got, "violations", None)) == (
                type(want), want.message, getattr(want, "violations", None))
            assert fine.token_ids  # the request beside it is answered
        assert tier.links.opened == 1  # no request's error broke the session
    finally:
        await tier.close()
        await calls.close()


@contextlib.asynccontextmanager
async def serving(servicer: type[TokenizerServicer], model_dir: Path) -> AsyncIterator[str]:
    """A tokenizer of ``servicer``'s kind on a plain gRPC server (no framed listener)."""
    core = build_core(TokenizerSettings(models=[f"{MODEL}={model_dir}"]))
    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer(core), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
        core.close()


class OlderTokenizer(TokenizerServicer):
    """A release before Session: the servicer without it, on a plain gRPC server."""

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        yield  # an async generator, as the real handler is


async def test_a_replica_without_session_gets_encode_calls(tiny_deepseek_dir: Path):
    async with serving(OlderTokenizer, tiny_deepseek_dir) as target:
        tier = SessionTokenizerTier([target])
        calls = GrpcTokenizerTier([target])
        try:
            assert await _encode_all(tier) == await _encode_all(calls)
            assert tier.links.uses_calls(0)  # until asked again, Encode calls go there
            assert (await _encode_all(tier))[0].token_ids
        finally:
            await tier.close()
            await calls.close()


async def test_a_dead_replicas_request_moves_to_the_next(tokenizer):
    tier = SessionTokenizerTier([f"127.0.0.1:{free_port()}", tokenizer])
    try:
        for _ in range(3):  # whichever replica the turn starts at
            encoded = await tier.encode(MODEL, "hello", [], add_generation_prompt=None, timeout=10)
            assert encoded.token_ids
    finally:
        await tier.close()


class SilentTokenizer(TokenizerServicer):
    """Takes the session and never answers."""

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async for _ in request_iterator:
            pass
        yield tokenizer_pb2.SessionResponse()


async def test_a_replica_that_never_answers_gives_the_requests_deadline(tiny_deepseek_dir: Path):
    async with serving(SilentTokenizer, tiny_deepseek_dir) as target:
        tier = SessionTokenizerTier([target])
        try:
            with pytest.raises(errors.DeadlineExceeded):
                await tier.encode(MODEL, "hello", [], add_generation_prompt=None, timeout=0.3)
            link = tier.links[0]
            assert link is not None and not link.requests  # the late answer has nowhere to go
        finally:
            await tier.close()


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Any:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    yield exporter, provider
    provider.shutdown()


async def test_the_tokenizers_span_of_a_request_hangs_under_the_gateways(tiny_deepseek_dir: Path, spans):
    exporter, provider = spans
    settings = TokenizerSettings(port=0, models=[f"{MODEL}={tiny_deepseek_dir}"], drain_seconds=0)
    async with running_server(lambda: build_server(settings), tier="tokenizer") as server:
        tier = SessionTokenizerTier([f"127.0.0.1:{server[0].port}"])
        try:
            with provider.get_tracer("test").start_as_current_span("gateway.tokenize") as parent:
                encoded = await tier.encode(MODEL, "hello there", [], add_generation_prompt=None, timeout=10)
        finally:
            await tier.close()
    (served,) = [s for s in exporter.get_finished_spans() if s.name == "llmesh.tokenizer/Session.encode"]
    assert served.parent is not None and served.parent.span_id == parent.get_span_context().span_id
    assert served.context.trace_id == parent.get_span_context().trace_id
    assert served.attributes is not None
    assert served.attributes["llmesh.prompt_tokens"] == len(encoded.token_ids)

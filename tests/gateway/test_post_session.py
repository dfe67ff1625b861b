"""The gateway's postprocessor tier over Session calls (postprocessor_transport: session).

Tier level: against an in-process postprocessor, requests written in one loop iteration
share one SessionRequest, give what Process streams give, keep their own errors, and all
see TierUnavailable when the session breaks. A replica without Session (a rolling
upgrade) gets Process calls, the requests that were on its failed session included,
until Session is asked again; a whole Session refused fails its requests with the
refusal, any other failure of it is a broken link. Mesh level: concurrent GenerateStream
requests through a session gateway give the text a calls gateway gives, and a killed
postprocessor replica fails no stream (the calls version is in test_gateway_ha.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway import sessionlink
from gateway.core import TierUnavailable
from gateway.postsession import SessionPostprocessorTier
from gateway.settings import GatewaySettings
from gateway.tiers import GrpcPostprocessorTier
from gateway.types import PostConfig, PostDelta, PostFinal
from llmesh.meshconfig import MeshConfig, RouterConfig, TierConfig, WorkerConfig
from llmesh.postprocess.v1 import postprocess_pb2_grpc
from llmesh.procs import TierProcess, free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from services.common import errors
from services.postprocessor.core import PostprocessCore
from services.postprocessor.server import build_core, build_server, warm_up
from services.postprocessor.servicer import PostprocessServicer
from services.postprocessor.settings import PostprocessorSettings
from services.tokenizer.loader import load_models
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import concurrent_streams, gateway_in_process, metric_total, stream_request, stub
from tests.router.helpers import wait_for
from tests.tokenizer.helpers import running_server

MODEL = "tiny"

# -- tier level ------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def post_server(tiny_deepseek_dir: Path) -> AsyncIterator[str]:
    settings = PostprocessorSettings(port=0, models=[f"{MODEL}={tiny_deepseek_dir}"], drain_seconds=0,
                                     final_drain_seconds=1.0)
    async with running_server(lambda: build_server(settings), warm_up, tier="postprocessor") as server:
        yield f"127.0.0.1:{server[0].port}"


@pytest.fixture(scope="module")
def encode(tiny_deepseek_dir: Path):
    tokenizer = load_models([f"{MODEL}={tiny_deepseek_dir}"])[MODEL].tokenizer
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


async def _drain(session: Any) -> tuple[str, PostFinal]:
    text = []
    while True:
        item = await asyncio.wait_for(session.read(), 10)
        if isinstance(item, PostDelta):
            text.append(item.text)
        else:
            assert isinstance(item, PostFinal)
            await session.close(graceful=True)
            return "".join(text), item


async def _over_calls(address: str, ids: list[int]) -> list[tuple[str, PostFinal]]:
    """What Process calls give for each of CONFIGS, three tokens a message: the reference."""
    calls = GrpcPostprocessorTier([address])
    try:
        expected = []
        for config in CONFIGS:
            session = await calls.open(0, config, timeout=10)
            for i in range(0, len(ids), 3):
                await session.send_tokens(ids[i:i + 3])
            await session.send_end("length")
            expected.append(await _drain(session))
        return expected
    finally:
        await calls.close()


CONFIGS = [
    PostConfig(model=MODEL, stop=[]),
    PostConfig(model=MODEL, stop=["Shanghai"]),
    PostConfig(model=MODEL, stop=[], filter_mode="redact"),
    PostConfig(model=MODEL, stop=[], skip_chars=7),
    PostConfig(model=MODEL, stop=["上海"], include_stop_str_in_output=True),
]
TEXT = "Call 555-123-4567 or mail a.b@example.com about the Shanghai 上海 branch 😀."


async def test_requests_of_one_loop_iteration_share_a_message_and_match_process(post_server, encode):
    ids = encode(TEXT)
    expected = await _over_calls(post_server, ids)
    tier = SessionPostprocessorTier([post_server])
    try:
        sessions = [await tier.open(0, config, timeout=10) for config in CONFIGS]
        link = tier.links[0]
        assert link is not None
        # One engine step at a time: every request's tokens of a step in one message.
        for i in range(0, len(ids), 3):
            for session in sessions:
                await session.send_tokens(ids[i:i + 3])
            await asyncio.sleep(0)
        for session in sessions:
            await session.send_end("length")
        got = await asyncio.gather(*(_drain(s) for s in sessions))
        assert got == expected
        assert link.messages_sent == len(range(0, len(ids), 3)) + 1
        assert not link.requests  # every request ended and was released
        assert tier.link(0) is link  # and the session stays for the next ones
    finally:
        await tier.close()


async def test_a_requests_error_is_its_own_domain_error(post_server, encode):
    tier = SessionPostprocessorTier([post_server])
    try:
        good = await tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=10)
        bad_stop = await tier.open(0, PostConfig(model=MODEL, stop=[""]), timeout=10)
        unknown = await tier.open(0, PostConfig(model="gpt-17", stop=[]), timeout=10)
        for session in (good, bad_stop, unknown):
            await session.send_tokens(encode("still fine"))
            await session.send_end("stop")
        with pytest.raises(errors.InvalidArgument) as err:
            await bad_stop.read()
        assert err.value.field == "config.stop[0]"
        with pytest.raises(errors.NotFound, match=r"^postprocessor: config\.model"):
            await unknown.read()
        want = PostFinal("stop", completion_tokens=len(encode("still fine")))
        assert await _drain(good) == ("still fine", want)
        for session in (bad_stop, unknown):
            await session.close()
    finally:
        await tier.close()


async def test_deadline_of_one_request(post_server):
    tier = SessionPostprocessorTier([post_server])
    try:
        session = await tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=0.2)
        with pytest.raises(errors.DeadlineExceeded):
            await session.read()  # the engine never ends it
        await session.close()
    finally:
        await tier.close()


async def test_a_broken_session_fails_each_request_with_tier_unavailable(tiny_deepseek_dir: Path, encode):
    settings = PostprocessorSettings(port=0, models=[f"{MODEL}={tiny_deepseek_dir}"], drain_seconds=0,
                                     grace_seconds=0.2)
    tier: SessionPostprocessorTier | None = None
    try:
        async with running_server(lambda: build_server(settings), warm_up, tier="postprocessor") as server:
            tier = SessionPostprocessorTier([f"127.0.0.1:{server[0].port}"])
            sessions = [await tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=30) for _ in range(3)]
            for session in sessions:
                await session.send_tokens(encode("some text"))
            for session in sessions:
                assert isinstance(await asyncio.wait_for(session.read(), 10), PostDelta)
        # The server stopped under three open requests.
        for session in sessions:
            with pytest.raises(TierUnavailable):
                await asyncio.wait_for(session.read(), 10)
            with pytest.raises(TierUnavailable):
                await session.send_tokens([5])  # a replay into it would fail the same way
        # The next request opens a new session, which fails too: nothing listens.
        again = await tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=30)
        with pytest.raises(TierUnavailable):
            await asyncio.wait_for(again.read(), 10)
    finally:
        if tier is not None:
            await tier.close()


class OlderPostprocessor(PostprocessServicer):
    """The real servicer, with knobs on Session and a count of the calls of each kind."""

    def __init__(self, core: PostprocessCore) -> None:
        super().__init__(core, final_drain_seconds=1.0)
        self.has_session = True
        """False: answer Session with UNIMPLEMENTED, as a release before it does."""
        self.refuse_with: grpc.StatusCode | None = None
        """End every Session at once with this code, as an authorization interceptor does."""
        self.break_with: grpc.StatusCode | None = None
        """End a Session with this code when its first message arrives (one that writes
        nothing still ends OK: this replica has Session)."""
        self.sessions = 0
        self.processes = 0

    async def Session(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self.sessions += 1
        if not self.has_session:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        if self.refuse_with is not None:
            await context.abort(self.refuse_with, "refused")
        if self.break_with is not None:
            async for _ in request_iterator:
                await context.abort(self.break_with, "session failed")
            return
        async for frame in super().Session(request_iterator, context):
            yield frame

    async def Process(self, request_iterator, context):  # type: ignore[no-untyped-def]
        self.processes += 1
        async for reply in super().Process(request_iterator, context):
            yield reply


@pytest.fixture
async def older_post(tiny_deepseek_dir: Path) -> AsyncIterator[tuple[str, OlderPostprocessor]]:
    servicer = OlderPostprocessor(build_core(PostprocessorSettings(models=[f"{MODEL}={tiny_deepseek_dir}"])))
    server = grpc.aio.server()
    postprocess_pb2_grpc.add_PostprocessServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    yield f"127.0.0.1:{port}", servicer
    await server.stop(0)


async def test_a_replica_without_session_gets_process_calls_until_it_is_asked_again(
    older_post, encode, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
):
    """A rolling upgrade: the replica is a release without Session. Requests opened before
    that is known, their tokens still coming while the session fails and the replica is
    asked, move to Process calls with everything they sent and give what calls give; the
    replica gets calls until the retry time, then is asked for a Session again."""
    address, post = older_post
    monkeypatch.setattr(sessionlink, "SESSION_RETRY_S", 1.0)
    caplog.set_level(logging.WARNING, logger="gateway.sessionlink")
    ids = encode(TEXT)
    expected = await _over_calls(address, ids)
    post.has_session, post.processes = False, 0
    tier = SessionPostprocessorTier([address])
    try:
        sessions = [await tier.open(0, config, timeout=10) for config in CONFIGS]
        drains = [asyncio.ensure_future(_drain(s)) for s in sessions]
        for i in range(0, len(ids), 3):
            for session in sessions:
                await session.send_tokens(ids[i:i + 3])
            await asyncio.sleep(0.005)  # engine steps, while the session fails under them
        for session in sessions:
            await session.send_end("length")
        assert await asyncio.gather(*drains) == expected
        assert post.processes == len(CONFIGS)  # each ran once, over a call
        assert post.sessions == 2  # the session, and the one that asked why it failed
        warnings = [r.getMessage() for r in caplog.records if "has no Session" in r.getMessage()]
        assert len(warnings) == 1 and address in warnings[0], warnings
        # Calls until the retry time, without asking again.
        session = await tier.open(0, CONFIGS[0], timeout=10)
        await session.send_tokens(ids)
        await session.send_end("length")
        assert await _drain(session) == expected[0]
        assert post.processes == len(CONFIGS) + 1 and post.sessions == 2
        # Upgraded meanwhile: after the retry time the next request opens a Session again.
        post.has_session = True
        await wait_for(lambda: not tier.links.uses_calls(0))
        session = await tier.open(0, CONFIGS[1], timeout=10)
        await session.send_tokens(ids)
        await session.send_end("length")
        assert await _drain(session) == expected[1]
        assert post.processes == len(CONFIGS) + 1 and post.sessions == 3
        link = tier.links[0]
        assert link is not None and link.frames_received
    finally:
        await tier.close()


@pytest.mark.parametrize(("knob", "code", "raised"), [
    ("refuse_with", grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
    # Each request's own error before this rule; now a broken link, replayed elsewhere.
    ("break_with", grpc.StatusCode.RESOURCE_EXHAUSTED, TierUnavailable),
    # The replica has Session (asked): the call's own failure.
    ("break_with", grpc.StatusCode.UNIMPLEMENTED, TierUnavailable),
])
async def test_a_whole_session_failure_is_a_refusal_or_a_broken_link(
    older_post, encode, knob: str, code: grpc.StatusCode, raised: type[Exception],
):
    address, post = older_post
    setattr(post, knob, code)
    tier = SessionPostprocessorTier([address])
    try:
        sessions = [await tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=10) for _ in range(3)]
        for session in sessions:
            await session.send_tokens(encode("some text"))
        for session in sessions:
            with pytest.raises(raised) as err:
                await asyncio.wait_for(session.read(), 10)
            assert type(err.value) is raised  # not NoSession: nothing moves to calls
        assert post.processes == 0 and not tier.links.uses_calls(0)
    finally:
        await tier.close()


# -- mesh level --------------------------------------------------------------------------

MAX_TOKENS = 80


@pytest.fixture(scope="module")
def session_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1,
                 "settings": {"drain_seconds": 0, "postprocessor_transport": "session"}},
        router=RouterConfig(zones=["zone-a", "zone-b"]),
        postprocessor=TierConfig(replicas=2),
        workers=[
            WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 25}),
            WorkerConfig(zone="zone-b", engine="fake", settings={"fake_token_delay_ms": 25}),
        ],
    )
    with running_mesh(config, tmp_path_factory.mktemp("post-session-mesh")) as mesh:
        yield mesh


@pytest.fixture(scope="module")
async def calls_gateway(session_mesh: Mesh) -> AsyncIterator[str]:
    """A second gateway in this process over the same tiers, with the calls transport."""

    def targets(tier: str) -> list[str]:
        return [p.address for p in session_mesh.procs if p.tier == tier]

    settings = GatewaySettings(
        port=0, http_port=-1, drain_seconds=0, postprocessor_transport="calls",
        tokenizer_targets=targets("tokenizer"), router_targets=targets("router"),
        postprocessor_targets=targets("postprocessor"),
    )
    async with gateway_in_process(settings) as address:
        yield address


def _request(prompt: str, **sampling: Any) -> inference_pb2.GenerateStreamRequest:
    return stream_request(prompt=prompt, sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                   "ignore_eos": True, **sampling})


def _same(a: Any, b: Any) -> None:
    assert a.finish_reason == b.finish_reason
    assert a.matched_stop == b.matched_stop
    assert a.usage.completion_tokens == b.usage.completion_tokens


async def test_concurrent_streams_give_the_text_of_calls(session_mesh, calls_gateway):
    prompts = [f"prompt number {i} about {'failover ' * (i % 3)}" for i in range(12)]
    plain = [_request(p) for p in prompts]
    reference = await concurrent_streams(calls_gateway, plain)
    # Stop strings taken from the middle of each reference text: they span tokens.
    stops = [text[len(text) // 2:len(text) // 2 + 4] for text, _ in reference]
    stopped = [_request(p, stop=[s]) for p, s in zip(prompts, stops, strict=True)]
    reference += await concurrent_streams(calls_gateway, stopped)
    got = await concurrent_streams(gateway_address(session_mesh), plain + stopped)
    for (want_text, want_final), (text, final) in zip(reference, got, strict=True):
        assert text == want_text
        _same(final, want_final)
    assert all(f.usage.completion_tokens == MAX_TOKENS for _, f in got[:len(prompts)])
    assert sum(f.finish_reason == inference_pb2.FINISH_REASON_STOP for _, f in got[len(prompts):]) >= 10


def _replays(gateway: TierProcess) -> float:
    """Streams the gateway replayed into another postprocessor replica."""
    url = f"http://127.0.0.1:{gateway.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmesh_gateway_failovers_total{")
               and 'tier="postprocessor"' in line and 'kind="replay"' in line)


async def test_postprocessor_killed_mid_stream_fails_no_stream(session_mesh, calls_gateway):
    """Last in this module: it leaves one postprocessor replica dead."""
    posts = [p for p in session_mesh.procs if p.tier == "postprocessor"]
    requests = [_request(f"tell me about failover, take {i}") for i in range(6)]
    reference = await concurrent_streams(calls_gateway, requests)
    before = {p.name: metric_total(p, "llmesh_postprocessor_tokens_total") for p in posts}
    victim: TierProcess | None = None
    picking = False
    killed = asyncio.Event()

    async def one(channel: grpc.aio.Channel, request: inference_pb2.GenerateStreamRequest) -> tuple[str, Any]:
        nonlocal victim, picking
        parts: list[str] = []
        final = None
        async for item in stub(channel).GenerateStream(request, timeout=60):
            if item.HasField("delta"):
                parts.append(item.delta.text)
                if len(parts) == 5 and not picking:
                    picking = True  # one stream picks and kills the victim
                    # The session of either replica carries some of these streams.
                    moved = await asyncio.to_thread(lambda: [
                        p for p in posts
                        if metric_total(p, "llmesh_postprocessor_tokens_total") > before[p.name]])
                    victim = moved[0]
                    os.kill(victim.pid, signal.SIGKILL)
                    killed.set()
            else:
                final = item.final
        assert final is not None
        return "".join(parts), final

    async with grpc.aio.insecure_channel(gateway_address(session_mesh)) as channel:
        got = await asyncio.gather(*(one(channel, r) for r in requests))
    assert killed.is_set() and victim is not None
    victim.popen.wait(10)
    gateway = next(p for p in session_mesh.procs if p.tier == "gateway")
    assert _replays(gateway) >= 1
    for (want_text, want_final), (text, final) in zip(reference, got, strict=True):
        assert text == want_text
        _same(final, want_final)
        assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH

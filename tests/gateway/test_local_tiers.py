"""The gateway's in-process tiers (tokenizer_transport and postprocessor_transport: local).

Tier level: a request run in the gateway's process gets what a replica gives it. The
tokenizer: the same token ids, checksum and model list, and for bad input the same error
(type, public field paths, message) as a tokenizer replica's answer; its deadline holds.
The postprocessor: the text and final a Process stream releases (stop strings across
tokens, redaction, blocking, skip_chars, the stop string kept), text handed to a listener
inside the feeding call, a request's bad input its own error naming the field, and a
long replay leaving the event loop free between slices. Mesh level: ``llmesh up`` with
both transports local starts neither a tokenizer nor a postprocessor (the router checks
the workers' tokenizer checksums from the model's files), and concurrent streams give
the text a gateway over the tier replicas gives. The real-engine case is in
test_gateway_engine_mesh.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.localpost import LocalPost, LocalPostprocessorTier
from gateway.localtokenizer import LocalTokenizerTier
from gateway.server import build_local_postprocessor, build_local_tokenizer
from gateway.settings import GatewaySettings
from gateway.tiers import GrpcPostprocessorTier, GrpcTokenizerTier
from gateway.types import ChatTurn, PostConfig, PostDelta, PostFinal
from llmesh.meshconfig import MeshConfig, RouterConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from services.common import errors
from services.postprocessor.server import build_server, warm_up
from services.postprocessor.session import SLICE_TOKENS
from services.postprocessor.settings import PostprocessorSettings
from services.router.server import checksum_source, local_checksums
from services.router.settings import RouterSettings
from services.tokenizer.loader import load_models
from services.tokenizer.server import build_server as build_tokenizer_server
from services.tokenizer.server import warm_up as warm_up_tokenizer
from services.tokenizer.settings import TokenizerSettings
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import (
    collect_stream,
    gateway_in_process,
    metric_total,
    same_streams,
    stream_and_kill,
    stream_request,
    stub,
)
from tests.tokenizer.helpers import running_server

MODEL = "tiny"

CONFIGS = [
    PostConfig(model=MODEL, stop=[]),
    PostConfig(model=MODEL, stop=["Shanghai"]),
    PostConfig(model=MODEL, stop=[], filter_mode="redact"),
    PostConfig(model=MODEL, stop=[], filter_mode="block"),
    PostConfig(model=MODEL, stop=[], skip_chars=7),
    PostConfig(model=MODEL, stop=["上海"], include_stop_str_in_output=True),
]
TEXT = "Call 555-123-4567 or mail a.b@example.com about the Shanghai 上海 branch 😀."


@pytest.fixture(scope="module")
async def post_server(tiny_deepseek_dir: Path) -> AsyncIterator[str]:
    """A postprocessor replica in this process: the reference."""
    settings = PostprocessorSettings(port=0, models=[f"{MODEL}={tiny_deepseek_dir}"], drain_seconds=0)
    async with running_server(lambda: build_server(settings), warm_up, tier="postprocessor") as server:
        yield f"127.0.0.1:{server[0].port}"


@pytest.fixture(scope="module")
async def tokenizer_server(tiny_deepseek_dir: Path) -> AsyncIterator[str]:
    """A tokenizer replica in this process: the reference."""
    settings = TokenizerSettings(port=0, models=[f"{MODEL}={tiny_deepseek_dir}"], drain_seconds=0,
                                 max_input_chars=64)
    async with running_server(lambda: build_tokenizer_server(settings), warm_up_tokenizer,
                              tier="tokenizer") as server:
        yield f"127.0.0.1:{server[0].port}"


@pytest.fixture(scope="module")
def local_tokenizer(tiny_deepseek_dir: Path) -> LocalTokenizerTier:
    # The gateway's request limits are the tokenizer's: the same max_input_chars.
    settings = GatewaySettings(local_models=[f"{MODEL}={tiny_deepseek_dir}"], max_input_chars=64)
    return LocalTokenizerTier(build_local_tokenizer(settings))


async def _outcome(tier: Any, **kwargs: Any) -> Any:
    try:
        return await tier.encode(**{"model": MODEL, "prompt": "", "messages": [],
                                    "add_generation_prompt": None, "timeout": 10, **kwargs})
    except errors.LlmeshError as exc:
        violations = [(v.field, v.description) for v in getattr(exc, "violations", [])]
        return type(exc), exc.message, violations


ENCODES: list[dict[str, Any]] = [
    {"prompt": "The capital of France is"},
    {"messages": [ChatTurn("system", "Be brief."), ChatTurn("user", "Capital of France?")]},
    {"messages": [ChatTurn("user", "Capital of France?")], "add_generation_prompt": False},
    {"model": "", "prompt": "the default model"},
    # Bad input: every error as a replica's answer gives it.
    {"model": "gpt-17", "prompt": "hello"},
    {},
    {"prompt": "both", "messages": [ChatTurn("user", "at once")]},
    {"prompt": "x" * 65},
    {"messages": [ChatTurn("wizard", "hello")]},
    {"messages": [ChatTurn("user", "fine"), ChatTurn("user", "y" * 65)]},
]


async def test_a_local_encode_gives_what_a_replica_gives(tokenizer_server, local_tokenizer):
    remote = GrpcTokenizerTier([tokenizer_server])
    try:
        for kwargs in ENCODES:
            want = await _outcome(remote, **kwargs)
            got = await _outcome(local_tokenizer, **kwargs)
            assert got == want, kwargs
        assert await local_tokenizer.list_models(timeout=5) == await remote.list_models(timeout=5)
    finally:
        await remote.close()
    ok = [await _outcome(local_tokenizer, **kwargs) for kwargs in ENCODES[:4]]
    assert all(r.token_ids and r.tokenizer_checksum for r in ok)
    errs = [await _outcome(local_tokenizer, **kwargs) for kwargs in ENCODES[4:]]
    assert errs[0][0] is errors.NotFound and errs[0][1].startswith("tokenizer: ")
    assert [e[2][0][0] for e in errs[2:]] == ["input", "prompt", "messages[0].role", "messages[1].content"]


async def test_a_local_encode_keeps_the_deadline(local_tokenizer):
    with pytest.raises(errors.DeadlineExceeded):
        await local_tokenizer.encode(MODEL, "hello", [], add_generation_prompt=None, timeout=0)


async def test_the_router_checks_workers_against_the_models_own_checksums(
        tokenizer_server, tiny_deepseek_dir):
    remote = GrpcTokenizerTier([tokenizer_server])
    try:
        listed = {m.id: m.tokenizer_checksum for m in await remote.list_models(timeout=5)}
    finally:
        await remote.close()
    assert await local_checksums([f"{MODEL}={tiny_deepseek_dir}"])() == listed
    source = checksum_source(RouterSettings(tokenizer_models=[f"{MODEL}={tiny_deepseek_dir}"]))
    assert source is not None and await source() == listed
    assert checksum_source(RouterSettings()) is None


@pytest.fixture(scope="module")
def local_tier(tiny_deepseek_dir: Path) -> LocalPostprocessorTier:
    return LocalPostprocessorTier(build_local_postprocessor([f"{MODEL}={tiny_deepseek_dir}"]))


@pytest.fixture(scope="module")
def encode(tiny_deepseek_dir: Path):
    tokenizer = load_models([f"{MODEL}={tiny_deepseek_dir}"])[MODEL].tokenizer
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


async def _drain(session: Any, text: list[str] | None = None) -> tuple[str, PostFinal]:
    parts = text if text is not None else []
    while True:
        item = await asyncio.wait_for(session.read(), 10)
        if isinstance(item, PostDelta):
            parts.append(item.text)
        else:
            assert isinstance(item, PostFinal)
            await session.close(graceful=True)
            return "".join(parts), item


async def test_a_local_request_releases_what_a_replica_releases(post_server, local_tier, encode):
    ids = encode(TEXT)
    calls = GrpcPostprocessorTier([post_server])
    expected = []
    try:
        for config in CONFIGS:
            session = await calls.open(0, config, timeout=10)
            for i in range(0, len(ids), 3):
                await session.send_tokens(ids[i:i + 3])
            await session.send_end("length")
            expected.append(await _drain(session))
    finally:
        await calls.close()
    assert expected[1][1].matched_stop == "Shanghai" and expected[3][1].finish_reason == "content_filter"

    # Read back (text queued until read), and listened (text handed over in the call).
    for listen in (False, True):
        got = []
        for config in CONFIGS:
            session = await local_tier.open(0, config, timeout=10)
            heard: list[str] = []
            if listen:
                session.listen(heard.append)
            for i in range(0, len(ids), 3):
                before = len(heard)
                assert session.send_tokens_nowait(ids[i:i + 3])
                assert all(heard[before:])  # only released text, never an empty piece
            await session.send_end("length")
            got.append(await _drain(session, heard))
        assert got == expected, f"listen={listen}"


async def test_a_requests_bad_input_is_its_own_error(local_tier, encode):
    with pytest.raises(errors.NotFound, match=r"config\.model"):
        await local_tier.open(0, PostConfig(model="gpt-17", stop=[]), timeout=10)
    with pytest.raises(errors.InvalidArgument) as err:
        await local_tier.open(0, PostConfig(model=MODEL, stop=["ok", ""]), timeout=10)
    assert err.value.field == "config.stop[1]"

    good = await local_tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=10)
    bad = await local_tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=10)
    vocab = local_tier.core.models[MODEL].vocab_size
    ids = encode("still fine")
    good.send_tokens_nowait(ids[:1])
    bad.send_tokens_nowait([*ids, vocab + 5])
    with pytest.raises(errors.InvalidArgument) as err:
        await asyncio.wait_for(bad.read(), 5)
    assert err.value.field == f"tokens.token_ids[{len(ids)}]"
    assert "outside the vocabulary" in err.value.message
    bad.send_tokens_nowait(ids)  # after its error: ignored, raises nothing
    good.send_tokens_nowait(ids[1:])
    await good.send_end("stop")
    text, final = await _drain(good)
    assert text == "still fine" and final.finish_reason == "stop"
    await bad.close()


def _tokens_counted() -> float:
    from services.postprocessor import metrics

    return metrics.TOKENS.labels(MODEL)._value.get()


async def test_an_unfinished_request_closed_by_the_pump_takes_no_more_tokens(local_tier, encode):
    counted = _tokens_counted()
    session = await local_tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=10)
    heard: list[str] = []
    session.listen(heard.append)
    session.send_tokens_nowait(encode("one two"))
    await session.close()
    session.send_tokens_nowait(encode(" three"))
    await session.send_end("stop")
    assert "".join(heard) == "one two" and session.items.empty()
    # The tier's token counter has the tokens it fed, counted once at the end.
    assert _tokens_counted() - counted == len(encode("one two"))


async def test_a_finished_request_counts_its_tokens_once(local_tier, encode):
    counted = _tokens_counted()
    session = await local_tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=10)
    ids = encode(TEXT)
    for i in range(0, len(ids), 2):
        session.send_tokens_nowait(ids[i:i + 2])
    assert _tokens_counted() == counted  # nothing per step
    await session.send_end("length")
    _, final = await _drain(session)
    assert final.completion_tokens == len(ids) and _tokens_counted() - counted == len(ids)


async def test_a_long_replay_leaves_the_event_loop_free_between_slices(local_tier, encode):
    ids = (encode(TEXT) * (3 * SLICE_TOKENS // len(encode(TEXT)) + 1))[:3 * SLICE_TOKENS + 5]
    session = await local_tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=10)
    assert isinstance(session, LocalPost)
    seen: list[int] = []
    heard: list[str] = []
    session.listen(lambda text: heard.append(text))
    loop = asyncio.get_running_loop()

    def tick() -> None:
        seen.append(len(heard))
        if len(seen) < 10:
            loop.call_soon(tick)

    loop.call_soon(tick)
    await session.send_tokens(ids)
    await session.send_end("length")
    _, final = await _drain(session)
    assert final.completion_tokens == len(ids)
    # The loop ran between the slices: ticks saw the text of one slice, then of more.
    assert len(set(seen)) >= 3, seen


# -- mesh level ----------------------------------------------------------------------

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def local_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        served_model_name=MODEL,  # the reference replica's name
        gateway={"port": free_port(), "http_port": -1,
                 "settings": {"drain_seconds": 0, "postprocessor_transport": "local",
                              "tokenizer_transport": "local"}},
        router=RouterConfig(replicas=2, zones=["zone-a", "zone-b"]),
        workers=[
            WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 10}),
            WorkerConfig(zone="zone-b", engine="fake", settings={"fake_token_delay_ms": 10}),
        ],
    )
    with running_mesh(config, tmp_path_factory.mktemp("local-post-mesh")) as mesh:
        yield mesh


@pytest.fixture(scope="module")
async def replica_gateway(local_mesh: Mesh, post_server: str, tokenizer_server: str) -> AsyncIterator[str]:
    """A gateway in this process over the same router, with a tokenizer and a
    postprocessor replica (Session transports): the reference."""

    def targets(tier: str) -> list[str]:
        return [p.address for p in local_mesh.procs if p.tier == tier]

    settings = GatewaySettings(
        port=0, http_port=-1, drain_seconds=0, tokenizer_targets=[tokenizer_server],
        router_targets=targets("router"), postprocessor_targets=[post_server],
    )
    async with gateway_in_process(settings) as address:
        yield address


def _request(prompt: str, **sampling: Any) -> inference_pb2.GenerateStreamRequest:
    return stream_request(prompt=prompt,
                          sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                                    **sampling})


async def test_the_local_mesh_runs_no_tokenizer_or_postprocessor_and_gives_the_replicas_text(
        local_mesh, replica_gateway):
    assert sorted({p.tier for p in local_mesh.procs}) == ["gateway", "router", "worker"]
    prompts = [f"prompt number {i} about {'failover ' * (i % 3)}" for i in range(10)]
    got = await same_streams(replica_gateway, gateway_address(local_mesh), prompts, _request)
    assert all(f.usage.completion_tokens == MAX_TOKENS for _, f in got[:len(prompts)])
    assert sum(f.finish_reason == inference_pb2.FINISH_REASON_STOP for _, f in got[len(prompts):]) >= 8


async def test_the_local_mesh_names_a_bad_stop_string(local_mesh):
    async with grpc.aio.insecure_channel(gateway_address(local_mesh)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect_stream(stub(channel), _request("hello", stop=["x" * 300]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop" in (err.value.details() or "")


async def test_a_router_killed_mid_stream_resumes_with_the_same_text_last(local_mesh):
    """Last in this module (it leaves one router dead): the stream moves to the other
    router, and the gateway's own postprocessing, which saw every token, goes on as if
    nothing happened: the same greedy text, a stop string past the kill still matched."""
    routers = [p for p in local_mesh.procs if p.tier == "router"]
    plain = _request("tell me about failover", max_tokens=120)
    async with grpc.aio.insecure_channel(gateway_address(local_mesh)) as channel:
        reference, _, _ = await collect_stream(stub(channel), plain)
        stop = reference[len(reference) * 3 // 4:len(reference) * 3 // 4 + 4]
        stopped = _request("tell me about failover", max_tokens=120, stop=[stop])
        want, want_final, _ = await collect_stream(stub(channel), stopped)
        assert want_final.matched_stop == stop

        def carrier() -> Any:
            busy = [p for p in routers if p.alive() and metric_total(p, "llmesh_router_worker_in_flight") > 0]
            assert len(busy) == 1, "exactly one router should carry the stream"
            return busy[0]

        text, final, victim = await stream_and_kill(channel, stopped, carrier)
    victim.popen.wait(10)
    assert text == want and final.matched_stop == stop
    assert final.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert final.usage.completion_tokens == want_final.usage.completion_tokens
    assert final.served_by.resumed >= 1

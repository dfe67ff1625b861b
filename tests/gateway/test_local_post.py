"""The gateway's in-process postprocessor (postprocessor_transport: local).

Tier level: a request run in the gateway's process releases what a postprocessor
replica's Process stream releases (stop strings across tokens, redaction, skip_chars,
the stop string kept), text reaches a listener inside the feeding call, a request's bad
input is its own error naming the field, and a long replay leaves the event loop free
between slices. Mesh level: ``llmesh up`` with the local transport starts no
postprocessor process, and concurrent streams give the text a gateway over a
postprocessor replica gives. The real-engine case is in test_gateway_engine_mesh.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.localpost import LocalPost, LocalPostprocessorTier
from gateway.server import build_local_postprocessor, create_gateway
from gateway.settings import GatewaySettings
from gateway.tiers import GrpcPostprocessorTier
from gateway.types import PostConfig, PostDelta, PostFinal
from llmesh.meshconfig import MeshConfig, RouterConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from services.common import errors
from services.postprocessor.server import build_server, warm_up
from services.postprocessor.session import SLICE_TOKENS
from services.postprocessor.settings import PostprocessorSettings
from services.tokenizer.loader import load_models
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import collect_stream, stream_request, stub
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
    read_back = []
    for config in CONFIGS:
        session = await local_tier.open(0, config, timeout=10)
        for i in range(0, len(ids), 3):
            assert session.send_tokens_nowait(ids[i:i + 3])
        await session.send_end("length")
        read_back.append(await _drain(session))
    assert read_back == expected

    listened = []
    for config in CONFIGS:
        session = await local_tier.open(0, config, timeout=10)
        heard: list[str] = []
        session.listen(heard.append)
        for i in range(0, len(ids), 3):
            before = len(heard)
            session.send_tokens_nowait(ids[i:i + 3])
            assert all(heard[before:])  # only released text, never an empty piece
        await session.send_end("length")
        listened.append(await _drain(session, heard))
    assert listened == expected


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


async def test_an_unfinished_request_closed_by_the_pump_takes_no_more_tokens(local_tier, encode):
    session = await local_tier.open(0, PostConfig(model=MODEL, stop=[]), timeout=10)
    heard: list[str] = []
    session.listen(heard.append)
    session.send_tokens_nowait(encode("one two"))
    await session.close()
    session.send_tokens_nowait(encode(" three"))
    await session.send_end("stop")
    assert "".join(heard) == "one two" and session.items.empty()


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
                 "settings": {"drain_seconds": 0, "postprocessor_transport": "local"}},
        router=RouterConfig(zones=["zone-a", "zone-b"]),
        workers=[
            WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 10}),
            WorkerConfig(zone="zone-b", engine="fake", settings={"fake_token_delay_ms": 10}),
        ],
    )
    with running_mesh(config, tmp_path_factory.mktemp("local-post-mesh")) as mesh:
        yield mesh


@pytest.fixture(scope="module")
async def replica_gateway(local_mesh: Mesh, post_server: str) -> AsyncIterator[str]:
    """A gateway in this process over the same tokenizer and router, with a postprocessor
    replica (Session transport): the reference."""

    def targets(tier: str) -> list[str]:
        return [p.address for p in local_mesh.procs if p.tier == tier]

    settings = GatewaySettings(
        port=0, http_port=-1, drain_seconds=0, tokenizer_targets=targets("tokenizer"),
        router_targets=targets("router"), postprocessor_targets=[post_server],
    )
    gateway = None

    async def build() -> tuple[Any, Any]:
        nonlocal gateway
        gateway = await create_gateway(settings)
        return gateway.handle, gateway

    async with running_server(build, tier="gateway") as (handle, _, _):
        yield f"127.0.0.1:{handle.port}"
    assert gateway is not None
    await gateway.close()


def _request(prompt: str, **sampling: Any) -> inference_pb2.GenerateStreamRequest:
    return stream_request(prompt=prompt,
                          sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                                    **sampling})


async def _streams(address: str,
                   requests: list[inference_pb2.GenerateStreamRequest]) -> list[tuple[str, Any]]:
    async with grpc.aio.insecure_channel(address) as channel:
        results = await asyncio.gather(*(collect_stream(stub(channel), r, timeout=60) for r in requests))
    return [(text, final) for text, final, _ in results]


async def test_the_local_mesh_runs_no_postprocessor_and_gives_a_replicas_text(local_mesh, replica_gateway):
    assert not [p for p in local_mesh.procs if p.tier == "postprocessor"]
    prompts = [f"prompt number {i} about {'failover ' * (i % 3)}" for i in range(10)]
    plain = [_request(p) for p in prompts]
    reference = await _streams(replica_gateway, plain)
    stops = [text[len(text) // 2:len(text) // 2 + 4] for text, _ in reference]
    stopped = [_request(p, stop=[s]) for p, s in zip(prompts, stops, strict=True)]
    reference += await _streams(replica_gateway, stopped)
    got = await _streams(gateway_address(local_mesh), plain + stopped)
    for (want_text, want), (text, final) in zip(reference, got, strict=True):
        assert text == want_text
        assert (final.finish_reason, final.matched_stop, final.usage.completion_tokens) == (
            want.finish_reason, want.matched_stop, want.usage.completion_tokens)
    assert all(f.usage.completion_tokens == MAX_TOKENS for _, f in got[:len(prompts)])
    assert sum(f.finish_reason == inference_pb2.FINISH_REASON_STOP for _, f in got[len(prompts):]) >= 8


async def test_the_local_mesh_names_a_bad_stop_string(local_mesh):
    async with grpc.aio.insecure_channel(gateway_address(local_mesh)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect_stream(stub(channel), _request("hello", stop=["x" * 300]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop" in (err.value.details() or "")

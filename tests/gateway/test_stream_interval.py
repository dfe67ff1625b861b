"""Stream interval: coalesced GenerateStream deltas carry exactly the interval-1 text.

Two meshes over the fake engine. ``echo_mesh`` repeats the prompt (so the output holds
known CJK, emoji, an e-mail address and a stop string) with a 1 ms step and the
deployment default interval 1; ``slow_mesh`` makes a token every 40 ms with a deployment
default of 16 tokens per delta and no practical time bound, for the first-delta and the
hold-timer checks.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from llmesh.meshconfig import MeshConfig, RouterConfig, TenantConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import bearer, request, stream_request, stub, violations

EMAIL = "alice.smith@example.com"
TEXTS = {
    "cjk_emoji": "東京タワーの夜景 🙂👍🏽 café 北京烤鸭 🇫🇷 😀😃 end",
    "pii": f"please write to {EMAIL} or bob@example.org today, 東京 🙂",
}
KEYS = {"plain": "plain-key", "redact": "redact-key"}
SLOW_STEP_S = 0.04


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def echo_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1, "settings": {"drain_seconds": 0}},
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake",
                              settings={"fake_token_delay_ms": 1, "fake_echo": True})],
        tenants=[TenantConfig(name="plain", key_sha256=_hash(KEYS["plain"])),
                 TenantConfig(name="redact", key_sha256=_hash(KEYS["redact"]), filter_mode="redact")],
    )
    with running_mesh(config, tmp_path_factory.mktemp("interval-echo-mesh")) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def slow_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1,
                 "settings": {"drain_seconds": 0, "stream_interval": 16, "stream_max_delay_ms": 60000}},
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake",
                              settings={"fake_token_delay_ms": SLOW_STEP_S * 1000})],
    )
    with running_mesh(config, tmp_path_factory.mktemp("interval-slow-mesh")) as mesh:
        yield mesh


@pytest.fixture
async def echo(echo_mesh: Mesh):
    async with grpc.aio.insecure_channel(gateway_address(echo_mesh)) as channel:
        yield stub(channel)


@pytest.fixture
async def slow(slow_mesh: Mesh):
    async with grpc.aio.insecure_channel(gateway_address(slow_mesh)) as channel:
        yield stub(channel)


def _paced(options: dict[str, int] | None, **kwargs: Any) -> inference_pb2.GenerateStreamRequest:
    req = stream_request(**kwargs)
    if options is not None:
        req.stream_options.CopyFrom(inference_pb2.StreamOptions(**options))
    return req


async def _deltas(s: Any, req: inference_pb2.GenerateStreamRequest, key: str = "plain",
                  ) -> tuple[list[tuple[float, inference_pb2.StreamDelta]], inference_pb2.GenerateResponse]:
    """Every delta with its arrival time, and the final message."""
    deltas: list[tuple[float, inference_pb2.StreamDelta]] = []
    final = None
    async for item in s.GenerateStream(req, metadata=bearer(KEYS[key]), timeout=60):
        if item.HasField("delta"):
            deltas.append((time.monotonic(), item.delta))
        else:
            assert final is None
            final = item.final
    assert final is not None, "stream ended without a final message"
    return deltas, final


def _final_fields(final: inference_pb2.GenerateResponse) -> tuple[Any, ...]:
    """What must not depend on the pacing (timing and placement do)."""
    return (final.text, final.finish_reason, final.matched_stop, final.usage.completion_tokens,
            final.usage.prompt_tokens, final.served_by.zone, list(final.token_ids),
            [(lp.token_id, lp.logprob) for lp in final.logprobs])


async def _prompt_tokens(s: Any, text: str) -> int:
    reply = await s.Tokenize(inference_pb2.TokenizeRequest(prompt=text), metadata=bearer(KEYS["plain"]))
    return int(reply.count)


@pytest.mark.parametrize("text_name", sorted(TEXTS))
@pytest.mark.parametrize("key", sorted(KEYS))
async def test_coalesced_streams_are_byte_identical_to_interval_one(echo, text_name: str, key: str) -> None:
    """Greedy, echoed CJK/emoji (tokens that split characters) and e-mail addresses (which
    the redact tenant's filter holds back across tokens): every interval gives the same
    bytes and the same final message as one delta per token, in fewer deltas."""
    prompt = TEXTS[text_name]
    n = 2 * await _prompt_tokens(echo, prompt)
    sampling = {"max_tokens": n, "ignore_eos": True, "temperature": 0.0, "logprobs": 0}
    base, base_final = await _deltas(echo, _paced(None, prompt=prompt, sampling=sampling), key)
    base_text = "".join(d.text for _, d in base)
    # The echo really carries the prompt's text, and the filter really acts on it.
    assert prompt[-8:] in base_text or "[REDACTED" in base_text
    if text_name == "pii":
        assert (EMAIL in base_text) is (key == "plain")
        assert ("[REDACTED:email]" in base_text) is (key == "redact")
    base_ids = [i for _, d in base for i in d.token_ids] + list(base_final.token_ids)
    assert len(base_ids) == n
    for interval in (2, 4, 16, 256):
        options = {"interval": interval, "max_delay_ms": 60000}
        deltas, final = await _deltas(echo, _paced(options, prompt=prompt, sampling=sampling), key)
        text = "".join(d.text for _, d in deltas)
        assert text.encode() == base_text.encode(), f"interval {interval}"
        assert _final_fields(final) == _final_fields(base_final)
        assert [i for _, d in deltas for i in d.token_ids] + list(final.token_ids) == base_ids
        assert all(d.text for _, d in deltas)
        # First delta at once, then one per `interval` tokens, and one before the final.
        assert len(deltas) <= 2 + n // interval, f"interval {interval}: {len(deltas)} deltas for {n} tokens"
        assert len(deltas) < len(base)


@pytest.mark.parametrize("stop", ["タワー", "end", "🙂👍"])
async def test_stop_strings_across_coalesced_chunks(echo, stop: str) -> None:
    prompt = TEXTS["cjk_emoji"]
    n = 2 * await _prompt_tokens(echo, prompt)
    sampling = {"max_tokens": n, "ignore_eos": True, "stop": [stop]}
    base, base_final = await _deltas(echo, _paced(None, prompt=prompt, sampling=sampling))
    assert base_final.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert base_final.matched_stop == stop
    base_text = "".join(d.text for _, d in base)
    assert stop not in base_text
    for interval in (3, 8, 64):
        deltas, final = await _deltas(
            echo, _paced({"interval": interval, "max_delay_ms": 60000}, prompt=prompt, sampling=sampling),
        )
        assert "".join(d.text for _, d in deltas).encode() == base_text.encode()
        assert _final_fields(final) == _final_fields(base_final)


async def test_unary_generate_equals_every_stream(echo) -> None:
    prompt = TEXTS["pii"]
    sampling = {"max_tokens": 40, "ignore_eos": True, "logprobs": 1}
    unary = await echo.Generate(request(prompt=prompt, sampling=sampling), metadata=bearer(KEYS["redact"]))
    deltas, final = await _deltas(echo, _paced({"interval": 8}, prompt=prompt, sampling=sampling), "redact")
    assert unary.text == "".join(d.text for _, d in deltas)
    assert list(unary.token_ids) == [i for _, d in deltas for i in d.token_ids] + list(final.token_ids)
    assert [lp.token_id for lp in unary.logprobs] == list(unary.token_ids)


async def test_the_first_delta_goes_out_before_the_interval_fills(slow) -> None:
    """Interval 16, a token every 40 ms, no time bound: the first delta carries the first
    token's text alone, and the delta that completes the 16 tokens comes many engine steps
    later (the gap is the engine's step time, a lower bound, not the gateway's speed)."""
    sampling = {"max_tokens": 24, "ignore_eos": True, "logprobs": 0}
    req = _paced({"interval": 16}, prompt="slow first delta", sampling=sampling)
    deltas, final = await _deltas(slow, req)
    assert final.usage.completion_tokens == 24
    (first_at, first), (second_at, second) = deltas[0], deltas[1]
    assert 1 <= len(first.token_ids) < 16
    assert len(first.token_ids) + len(second.token_ids) >= 16
    assert second_at - first_at >= 8 * SLOW_STEP_S
    assert len(deltas) <= 3


async def test_the_deployment_default_applies_and_a_request_may_override_it(slow) -> None:
    sampling = {"max_tokens": 20, "ignore_eos": True}
    default, _ = await _deltas(slow, _paced(None, prompt="deployment default", sampling=sampling))
    assert len(default) <= 3  # 16 tokens per delta (the slow mesh's stream_interval)
    every, _ = await _deltas(slow, _paced({"interval": 1}, prompt="deployment default", sampling=sampling))
    assert len(every) >= 15  # one per token (a token may decode to nothing yet)
    assert "".join(d.text for _, d in every) == "".join(d.text for _, d in default)


async def test_the_hold_timer_bounds_how_long_text_waits(slow) -> None:
    """Interval 64 with max_delay_ms 5 on an engine 40 ms per token: text cannot wait for
    the interval, so it streams in many deltas (a count bound alone would give 2)."""
    sampling = {"max_tokens": 20, "ignore_eos": True}
    deltas, _ = await _deltas(
        slow, _paced({"interval": 64, "max_delay_ms": 5}, prompt="hold timer", sampling=sampling),
    )
    assert len(deltas) >= 6


@pytest.mark.parametrize(("options", "field"), [
    ({"interval": 257}, "stream_options.interval"),
    ({"interval": 1_000_000}, "stream_options.interval"),
    ({"max_delay_ms": 60001}, "stream_options.max_delay_ms"),
])
async def test_an_invalid_stream_option_is_invalid_argument_naming_the_field(
    echo, options: dict[str, int], field: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _deltas(echo, _paced(options, prompt="x", sampling={"max_tokens": 2}))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err.value) == [field]
    assert field in (err.value.details() or "")


def test_settings_bound_the_deployment_default() -> None:
    assert GatewaySettings().stream_interval == 1  # today's behaviour unless a deployment chooses
    for bad in ({"stream_interval": 0}, {"stream_interval": 257}, {"stream_max_delay_ms": 0}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            GatewaySettings(**bad)


async def test_the_python_client_asks_for_an_interval(slow_mesh: Mesh) -> None:
    from llmesh.client import AsyncClient

    client = AsyncClient(gateway_address(slow_mesh), timeout=60, max_attempts=1)
    try:
        counts = {}
        for interval in (1, 16):
            stream = client.stream("client interval", max_tokens=20, ignore_eos=True,
                                   stream_interval=interval)
            counts[interval] = len([delta async for delta in stream])
            assert stream.final.usage.completion_tokens == 20
    finally:
        await client.close()
    assert counts[16] <= 3 < counts[1]

"""The public API through a real mesh whose workers run the deterministic fake engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import grpc
import pytest

from llmesh.v1 import inference_pb2
from tests.gateway.conftest import DEMO_KEY, LIMITED_KEY
from tests.gateway.helpers import (
    bearer,
    collect_stream,
    request,
    retry_delay_ms,
    stream_request,
    stub,
    violations,
)

AUTH = bearer(DEMO_KEY)


async def test_stream_equals_unary_and_final_is_complete(fake_channel):
    s = stub(fake_channel)
    kwargs = {"prompt": "Hello there", "sampling": {"max_tokens": 24, "temperature": 0.0}}
    text, final, deltas = await collect_stream(s, stream_request(**kwargs), metadata=AUTH)
    unary = await s.Generate(request(**kwargs), metadata=AUTH)
    assert text == unary.text
    assert deltas >= 1
    assert final.text == ""
    for reply in (final, unary):
        assert reply.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert reply.usage.completion_tokens == 24
        assert reply.usage.prompt_tokens > 0
        assert reply.served_by.worker_id
        assert reply.served_by.zone == "zone-a"
        assert not reply.served_by.degraded
        assert reply.timing.total_ms >= reply.timing.ttft_ms > 0
        assert reply.request_id


async def test_chat_messages_and_client_request_id(fake_channel):
    reply = await stub(fake_channel).Generate(
        request(messages=[("system", "be brief"), ("user", "hi")], request_id="client-42",
                sampling={"max_tokens": 4}),
        metadata=AUTH,
    )
    assert reply.request_id == "client-42"
    assert reply.usage.completion_tokens == 4


async def test_tokenize_and_list_models(fake_channel, fake_mesh):
    s = stub(fake_channel)
    models = await s.ListModels(inference_pb2.ListModelsRequest(), metadata=AUTH)
    assert [m.id for m in models.models] == [fake_mesh.model_name]
    model = models.models[0]
    assert model.is_default and model.max_context_length == 2048
    assert model.tokenizer_checksum.startswith("sha256:")
    tok = await s.Tokenize(inference_pb2.TokenizeRequest(prompt="Hello world"), metadata=AUTH)
    assert tok.count == len(tok.token_ids) > 0
    assert tok.tokenizer_checksum == model.tokenizer_checksum


NAN = math.nan

VALIDATION_CASES = [
    ({}, "prompt"),
    ({"prompt": "x", "messages": [("user", "y")]}, "messages"),
    ({"messages": [("user", "ok"), ("wizard", "y")]}, "messages[1].role"),
    ({"prompt": "x", "sampling": {"temperature": -0.5}}, "sampling.temperature"),
    ({"prompt": "x", "sampling": {"temperature": NAN}}, "sampling.temperature"),
    ({"prompt": "x", "sampling": {"top_p": 0.0}}, "sampling.top_p"),
    ({"prompt": "x", "sampling": {"max_tokens": 0}}, "sampling.max_tokens"),
    ({"prompt": "x", "sampling": {"max_tokens": 5000}}, "sampling.max_tokens"),
    ({"prompt": "hello world " * 20, "sampling": {"max_tokens": 2040}}, "sampling.max_tokens"),
    ({"prompt": "x", "sampling": {"stop": [f"s{i}" for i in range(17)]}}, "sampling.stop"),
    ({"prompt": "x", "sampling": {"stop": ["y" * 300]}}, "sampling.stop[0]"),
    ({"prompt": "x", "sampling": {"stop": [""]}}, "sampling.stop[0]"),
    ({"prompt": "x", "sampling": {"min_tokens": 9, "max_tokens": 3}}, "sampling.min_tokens"),
    ({"prompt": "x", "sampling": {"presence_penalty": 3.0}}, "sampling.presence_penalty"),
    ({"prompt": "x", "sampling": {"logprobs": 100}}, "sampling.logprobs"),
    ({"prompt": "x", "sampling": {"stop_token_ids": [999999]}}, "sampling.stop_token_ids[0]"),
    ({"messages": [("user", "z" * 150_000), ("user", "z" * 50_001)]}, "messages"),  # 200k in all
    ({"messages": [("user", "hi")] * 257}, "messages"),
    ({"prompt": "hello " * 3000}, "prompt"),
    ({"prompt": "x", "request_id": "bad id with spaces"}, "request_id"),
]


@pytest.mark.parametrize(("fields", "field"), VALIDATION_CASES)
async def test_validation_names_the_field(fake_channel, fields, field):
    for call, req in (("Generate", request(**fields)), ("GenerateStream", stream_request(**fields))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            method = getattr(stub(fake_channel), call)
            if call == "Generate":
                await method(req, metadata=AUTH, timeout=10)
            else:
                async for _ in method(req, metadata=AUTH, timeout=10):
                    pass
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (call, err.value.details())
        assert field in violations(err.value), (call, violations(err.value))


async def test_skip_reading_prefix_cache_is_served(fake_channel):
    """The fake engine keeps no per-request KV cache (tests/common/test_sampling_layers.py
    follows the flag into its request; the real engine's effect is tested in the engine
    suites): the flag is accepted by every tier and changes nothing about a greedy answer."""
    s = stub(fake_channel)
    plain = await s.Generate(request(prompt="Hello there", sampling={"max_tokens": 6}), metadata=AUTH)
    skipped = await s.Generate(request(prompt="Hello there", sampling={
        "max_tokens": 6, "skip_reading_prefix_cache": True}), metadata=AUTH)
    assert skipped.text == plain.text and skipped.usage.completion_tokens == 6


async def test_unknown_model_is_not_found(fake_channel):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(fake_channel).Generate(request(model="gpt-9", prompt="x"), metadata=AUTH)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "gpt-9" in err.value.details()


async def test_missing_and_wrong_key_are_unauthenticated(fake_channel):
    s = stub(fake_channel)
    for metadata in ((), bearer("wrong-key"), (("authorization", "Basic abc"),)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.Generate(request(prompt="x"), metadata=metadata)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.ListModels(inference_pb2.ListModelsRequest())
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_over_the_limit_is_resource_exhausted_with_retry_info(fake_channel):
    s = stub(fake_channel)
    for _ in range(3):
        await s.Generate(request(prompt="x", sampling={"max_tokens": 1}), metadata=bearer(LIMITED_KEY))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.Generate(request(prompt="x", sampling={"max_tokens": 1}), metadata=bearer(LIMITED_KEY))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    delay = retry_delay_ms(err.value)
    assert delay is not None and 0 < delay <= 60_000
    # Other tenants are unaffected.
    await s.Generate(request(prompt="x", sampling={"max_tokens": 1}), metadata=AUTH)


async def test_deadline_exceeded(fake_channel):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(fake_channel).Generate(
            request(prompt="x", sampling={"max_tokens": 1500, "ignore_eos": True}),
            metadata=AUTH, timeout=0.5,
        )
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_stop_string_ends_the_stream(fake_channel):
    s = stub(fake_channel)
    base = await s.Generate(request(prompt="stop test", sampling={"max_tokens": 40}), metadata=AUTH)
    text = base.text
    assert len(text) > 6
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text.index(stop)
    reply = await s.Generate(request(prompt="stop test", sampling={"max_tokens": 40, "stop": [stop]}),
                             metadata=AUTH)
    assert reply.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert reply.matched_stop == stop
    assert reply.text == text[:cut]


async def test_audit_log_has_hashes_not_text(fake_channel, fake_mesh):
    secret = "audit-me-please-secret-prompt"
    await stub(fake_channel).Generate(request(prompt=secret, sampling={"max_tokens": 3}), metadata=AUTH)
    path = Path(fake_mesh.config.gateway.audit_log)
    raw = path.read_text()
    assert secret not in raw
    entries = [json.loads(line) for line in raw.splitlines()]
    import hashlib

    mine = [e for e in entries if e.get("prompt_sha256") == hashlib.sha256(secret.encode()).hexdigest()]
    assert len(mine) == 1
    entry = mine[0]
    assert entry["tenant"] == "demo"
    assert entry["completion_tokens"] == 3
    assert entry["finish_reason"] == "length"
    assert entry["served_by"]["zone"] == "zone-a"
    assert len(entry["output_sha256"]) == 64


async def test_deltas_reach_the_client_as_they_are_produced(fake_channel):
    """Text is streamed token by token, not held until the end: with the fake engine's
    5 ms per token, the first delta arrives long before the last one."""
    import time

    n = 60
    arrivals: list[float] = []
    start = time.monotonic()
    async for item in stub(fake_channel).GenerateStream(
        stream_request(prompt="stream me", sampling={"max_tokens": n, "ignore_eos": True}),
        metadata=AUTH, timeout=30,
    ):
        if item.HasField("delta"):
            arrivals.append(time.monotonic() - start)
    assert len(arrivals) >= n // 2, f"{len(arrivals)} deltas for {n} tokens: output was batched up"
    # n tokens take at least n * 5 ms to make; the first must not wait for the rest.
    assert arrivals[-1] - arrivals[0] >= (n - 1) * 0.005 * 0.8
    assert arrivals[0] < arrivals[-1] / 2

"""TokenizerService over a real aio channel: RPCs, health, reflection, error details."""

from __future__ import annotations

import grpc
import pytest

from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.modelinfo import tokenizer_checksum
from services.tokenizer.servicer import SERVICE_NAME
from tests.tokenizer.conftest import SMOL, TINY
from tests.tokenizer.helpers import (
    field_violations,
    health_status,
    reflection_file_for,
    reflection_services,
)


@pytest.fixture
def stub(tokenizer_server):
    _, _, channel = tokenizer_server
    return tokenizer_pb2_grpc.TokenizerServiceStub(channel)


def _messages(*turns):
    return [tokenizer_pb2.ChatMessage(role=r, content=c) for r, c in turns]


async def test_health_readiness_and_liveness(tokenizer_server):
    _, _, channel = tokenizer_server
    assert SERVICE_NAME == "llmesh.tokenizer.v1.TokenizerService"
    assert await health_status(channel, SERVICE_NAME) == "SERVING"
    assert await health_status(channel, "") == "SERVING"


async def test_reflection_lists_and_describes_the_service(tokenizer_server):
    _, _, channel = tokenizer_server
    names = await reflection_services(channel)
    assert SERVICE_NAME in names
    assert "grpc.health.v1.Health" in names
    assert await reflection_file_for(channel, SERVICE_NAME)


async def test_encode_messages_and_prompt(stub, loaded):
    reply = await stub.Encode(tokenizer_pb2.EncodeRequest(input=tokenizer_pb2.EncodeInput(
        model=TINY, messages=_messages(("user", "你好 😀"))
    )), timeout=5)
    r = reply.result
    rendered = "<｜begin▁of▁sentence｜>User: 你好 😀\n\nAssistant:"
    assert list(r.token_ids) == loaded[TINY].tokenizer.encode(rendered, add_special_tokens=False).ids
    assert r.count == len(r.token_ids) and r.model == TINY and not r.truncated
    assert r.tokenizer_checksum == tokenizer_checksum(loaded[TINY].path)

    reply = await stub.Encode(tokenizer_pb2.EncodeRequest(input=tokenizer_pb2.EncodeInput(
        prompt="Hello world", truncate_to=1
    )), timeout=5)
    assert reply.result.model == SMOL
    assert list(reply.result.token_ids) == [905] and reply.result.truncated


async def test_add_generation_prompt_presence_is_honoured(stub):
    async def count(**kwargs):
        reply = await stub.Encode(tokenizer_pb2.EncodeRequest(input=tokenizer_pb2.EncodeInput(
            model=SMOL, messages=_messages(("user", "Hi")), **kwargs
        )), timeout=5)
        return reply.result.count

    assert await count() == await count(add_generation_prompt=True)
    assert await count(add_generation_prompt=False) < await count()


async def test_encode_batch_keeps_order(stub, loaded):
    inputs = [
        tokenizer_pb2.EncodeInput(model=TINY, prompt="first"),
        tokenizer_pb2.EncodeInput(model=SMOL, messages=_messages(("user", "second"))),
        tokenizer_pb2.EncodeInput(prompt="third", add_special_tokens=False),
    ]
    reply = await stub.EncodeBatch(tokenizer_pb2.EncodeBatchRequest(inputs=inputs), timeout=5)
    assert [r.model for r in reply.results] == [TINY, SMOL, SMOL]
    assert list(reply.results[0].token_ids) == loaded[TINY].tokenizer.encode("first").ids
    assert list(reply.results[2].token_ids) == loaded[SMOL].tokenizer.encode("third").ids


async def test_list_models(stub, loaded):
    reply = await stub.ListModels(tokenizer_pb2.ListModelsRequest(), timeout=5)
    by_name = {m.model: m for m in reply.models}
    assert list(by_name) == [SMOL, TINY]
    assert by_name[SMOL].is_default and not by_name[TINY].is_default
    assert by_name[SMOL].max_context_length == 8192
    assert by_name[TINY].max_context_length == 2048
    assert by_name[SMOL].vocab_size == 49152 and by_name[TINY].vocab_size == 4096
    assert list(by_name[SMOL].eos_token_ids) == [2] and list(by_name[TINY].eos_token_ids) == [1]
    for name, model in by_name.items():
        assert model.tokenizer_checksum == tokenizer_checksum(loaded[name].path)


@pytest.mark.parametrize(
    ("request_input", "code", "field"),
    [
        (tokenizer_pb2.EncodeInput(
            messages=_messages(("user", "a"), ("assistant", "b"), ("user", "c"), ("wizard", "d"))),
         grpc.StatusCode.INVALID_ARGUMENT, "input.messages[3].role"),
        (tokenizer_pb2.EncodeInput(prompt="x" * 10_001), grpc.StatusCode.INVALID_ARGUMENT, "input.prompt"),
        (tokenizer_pb2.EncodeInput(messages=_messages(*[("user", "m")] * 9)),
         grpc.StatusCode.INVALID_ARGUMENT, "input.messages"),
        (tokenizer_pb2.EncodeInput(), grpc.StatusCode.INVALID_ARGUMENT, "input"),
        (tokenizer_pb2.EncodeInput(prompt="p", messages=_messages(("user", "m"))),
         grpc.StatusCode.INVALID_ARGUMENT, "input"),
        (tokenizer_pb2.EncodeInput(messages=_messages(("user", ""))),
         grpc.StatusCode.INVALID_ARGUMENT, "input.messages[0].content"),
    ],
)
async def test_bad_input_names_the_field(stub, request_input, code, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Encode(tokenizer_pb2.EncodeRequest(input=request_input), timeout=5)
    assert err.value.code() is code
    assert field_violations(err.value) == [field]


async def test_unknown_model_is_not_found(stub):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Encode(tokenizer_pb2.EncodeRequest(
            input=tokenizer_pb2.EncodeInput(model="gpt-17", prompt="x")), timeout=5)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "input.model" in err.value.details() and "gpt-17" in err.value.details()


async def test_oversized_batch_is_rejected_and_server_keeps_serving(stub):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.EncodeBatch(tokenizer_pb2.EncodeBatchRequest(
            inputs=[tokenizer_pb2.EncodeInput(prompt="x")] * 5), timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(err.value) == ["inputs"]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.EncodeBatch(tokenizer_pb2.EncodeBatchRequest(inputs=[
            tokenizer_pb2.EncodeInput(prompt="ok"),
            tokenizer_pb2.EncodeInput(model="nope", prompt="x"),
        ]), timeout=5)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "inputs[1].model" in err.value.details()
    reply = await stub.Encode(tokenizer_pb2.EncodeRequest(input=tokenizer_pb2.EncodeInput(prompt="ok")),
                              timeout=5)
    assert reply.result.count > 0

"""PostprocessService over a real aio channel: the stream protocol, errors, health, metrics."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from prometheus_client import REGISTRY

from llmesh.postprocess.v1 import postprocess_pb2 as pb
from llmesh.postprocess.v1 import postprocess_pb2_grpc
from services.postprocessor.servicer import SERVICE_NAME
from tests.postprocessor.conftest import SMOL, TINY
from tests.tokenizer.helpers import (
    field_violations,
    health_status,
    reflection_file_for,
    reflection_services,
)


@pytest.fixture
def stub(postprocessor_server):
    _, _, channel = postprocessor_server
    return postprocess_pb2_grpc.PostprocessServiceStub(channel)


def _encode(tokenizers, model, text):
    return tokenizers[model].tokenizer.encode(text, add_special_tokens=False).ids


def config(**kwargs):
    return pb.ProcessRequest(config=pb.ProcessConfig(**kwargs))


def tokens(ids):
    return pb.ProcessRequest(tokens=pb.ProcessTokens(token_ids=ids))


def end(reason=pb.UPSTREAM_FINISH_REASON_STOP):
    return pb.ProcessRequest(end=pb.ProcessEnd(finish_reason=reason))


async def _collect(call):
    deltas, finals = [], []
    async for reply in call:
        if reply.HasField("delta"):
            deltas.append(reply.delta.text)
        else:
            finals.append(reply.final)
    return deltas, finals


async def _process(stub, requests):
    async def gen():
        for r in requests:
            yield r

    return await _collect(stub.Process(gen(), timeout=10))


async def test_health_and_reflection(postprocessor_server):
    _, _, channel = postprocessor_server
    assert SERVICE_NAME == "llmesh.postprocess.v1.PostprocessService"
    assert await health_status(channel, SERVICE_NAME) == "SERVING"
    assert await health_status(channel, "") == "SERVING"
    assert SERVICE_NAME in await reflection_services(channel)
    assert await reflection_file_for(channel, SERVICE_NAME)


async def test_stream_in_chunks(stub, tokenizers):
    text = "你好！The answer is 42 😀."
    ids = _encode(tokenizers, TINY, text)
    requests = [config(model=TINY, filter_mode=pb.FILTER_MODE_OFF)]
    requests += [tokens(ids[i:i + 2]) for i in range(0, len(ids), 2)]
    requests.append(end(pb.UPSTREAM_FINISH_REASON_LENGTH))
    deltas, finals = await _process(stub, requests)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert len(finals) == 1
    assert finals[0].finish_reason == pb.OUTPUT_FINISH_REASON_LENGTH
    assert finals[0].completion_tokens == len(ids)


async def test_stop_string_sends_final_at_once(stub, tokenizers):
    ids = _encode(tokenizers, SMOL, "Sure. Answer: Paris\n\nUser: next question")
    call = stub.Process(timeout=10)
    await call.write(config(model=SMOL, stop=["\n\nUser:"]))
    await call.write(tokens(ids))
    # No ProcessEnd: the final must come because of the stop string alone.
    deltas, final = [], None
    while final is None:
        reply = await asyncio.wait_for(call.read(), 5)
        assert reply is not grpc.aio.EOF
        if reply.HasField("delta"):
            deltas.append(reply.delta.text)
        else:
            final = reply.final
    assert "".join(deltas) == "Sure. Answer: Paris"
    assert final.finish_reason == pb.OUTPUT_FINISH_REASON_STOP
    assert final.matched_stop == "\n\nUser:"
    assert 0 < final.completion_tokens < len(ids)
    # The caller stops the engine; tokens it had already sent are ignored; it closes.
    await call.write(tokens(ids))
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() is grpc.StatusCode.OK


async def test_messages_after_the_final_are_ignored(stub, tokenizers):
    ids = _encode(tokenizers, SMOL, "one two STOP three")
    more = _encode(tokenizers, SMOL, " four five")
    requests = [config(model=SMOL, stop=["STOP"]), tokens(ids), tokens(more), tokens(more), end()]
    deltas, finals = await _process(stub, requests)
    assert "".join(deltas) == "one two "
    assert len(finals) == 1 and finals[0].matched_stop == "STOP"


async def test_block_mode_and_redaction_metric(stub, tokenizers, caplog):
    card = "5500 0055 5555 5559"
    ids = _encode(tokenizers, SMOL, f"Use card {card} to pay, then continue.")

    def redactions():
        return REGISTRY.get_sample_value("llmesh_postprocessor_redactions_total", {"kind": "card"}) or 0.0

    before = redactions()
    caplog.set_level(logging.DEBUG)
    requests = [config(model=SMOL, filter_mode=pb.FILTER_MODE_BLOCK)]
    requests += [tokens([i]) for i in ids]
    deltas, finals = await _process(stub, requests)  # no end: block ends the stream
    assert "".join(deltas) == "Use card "
    assert finals[0].finish_reason == pb.OUTPUT_FINISH_REASON_CONTENT_FILTER
    assert finals[0].redactions == 1
    assert redactions() == before + 1
    # Only llmesh's own records: grpc's debug lines print object ids, whose digits may
    # contain any fragment of the card number by chance.
    own = {"services", "gateway", "llmesh"}
    ours = [r.getMessage() for r in caplog.records if r.name.split(".")[0] in own]
    assert ours, "the servicer logged nothing at DEBUG; the check below would be empty"
    fragments = (card, card.replace(" ", ""), "0055 5555", "5555 5559")
    assert not any(f in message for message in ours for f in fragments)

    requests = [config(model=SMOL, filter_mode=pb.FILTER_MODE_REDACT), tokens(ids), end()]
    deltas, finals = await _process(stub, requests)
    assert "".join(deltas) == "Use card [REDACTED:card] to pay, then continue."
    assert redactions() == before + 2


async def test_skip_chars_replay(stub, tokenizers):
    ids = _encode(tokenizers, TINY, "Hello 世界, replayed stream.")
    full, _ = await _process(stub, [config(model=TINY), tokens(ids), end()])
    replay, finals = await _process(stub, [config(model=TINY, skip_chars=9), tokens(ids), end()])
    assert "".join(replay) == "".join(full)[9:]
    assert finals[0].completion_tokens == len(ids)


async def test_empty_stream(stub):
    deltas, finals = await _process(stub, [config(), end()])
    assert deltas == [] and len(finals) == 1
    assert finals[0].finish_reason == pb.OUTPUT_FINISH_REASON_STOP and finals[0].completion_tokens == 0


@pytest.mark.parametrize(("requests", "field"), [
    ([tokens([1, 2])], "config"),
    ([config(model=TINY), tokens([5, 4096])], "tokens.token_ids[1]"),
    ([config(stop=["a", "b", "c", "d", "e"])], "config.stop"),
    ([config(stop=["x" * 33])], "config.stop[0]"),
    ([config(), config()], "config"),
    ([config(model=TINY), tokens([5])], "end"),  # closed without ProcessEnd
    ([config(model=TINY), tokens([5] * 5001)], "tokens.token_ids"),  # oversized stream
])
async def test_bad_input_names_the_field(stub, requests, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _process(stub, requests)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(err.value) == [field]


async def test_unknown_model_is_not_found_and_server_survives(stub):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _process(stub, [config(model="gpt-17"), end()])
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "config.model" in err.value.details()
    _deltas, finals = await _process(stub, [config(), end()])
    assert len(finals) == 1


async def test_client_cancel_mid_stream(stub, tokenizers, postprocessor_server):
    _, _, channel = postprocessor_server
    call = stub.Process(timeout=10)
    await call.write(config(model=TINY))
    await call.write(tokens(_encode(tokenizers, TINY, "partial output")))
    call.cancel()
    assert await health_status(channel, SERVICE_NAME) == "SERVING"


async def test_long_replay_in_one_message(stub, tokenizers):
    sentence = "The bank opened a new branch in Shanghai 上海 today. "
    text = sentence * 60 + "FIN and then nothing more." + sentence * 10
    ids = _encode(tokenizers, TINY, text)
    assert len(ids) > 3 * 256  # several slices of the servicer
    deltas, finals = await _process(stub, [config(model=TINY, stop=["FIN"]), tokens(ids), end()])
    assert "".join(deltas) == sentence * 60
    assert len(deltas) >= 3  # slices before the stop were streamed as they were done
    assert len(finals) == 1 and finals[0].matched_stop == "FIN"
    deltas, finals = await _process(stub, [config(model=TINY), tokens(ids), end()])
    assert "".join(deltas) == text == tokenizers[TINY].tokenizer.decode(ids)
    assert finals[0].completion_tokens == len(ids)


async def test_caller_that_never_closes_is_closed_after_the_drain_period(stub, tokenizers):
    ids = _encode(tokenizers, SMOL, "text STOP more")
    call = stub.Process(timeout=20)
    await call.write(config(model=SMOL, stop=["STOP"]))
    await call.write(tokens(ids))
    replies = []
    while True:
        reply = await asyncio.wait_for(call.read(), 10)  # the server ends the call itself
        if reply is grpc.aio.EOF:
            break
        replies.append(reply)
    assert replies[-1].final.matched_stop == "STOP"
    assert await call.code() is grpc.StatusCode.OK

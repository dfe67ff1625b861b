"""WorkerService over real aio channels, backed by the fake engine (fast, no lock)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llmesh.common.v1 import common_pb2
from llmesh.worker.v1 import worker_pb2
from services.common.modelinfo import tokenizer_checksum
from services.worker.fake_engine import FakeModel, fake_greedy

from .conftest import RunningWorker, generate, token_request

STOP = common_pb2.ENGINE_FINISH_REASON_STOP
LENGTH = common_pb2.ENGINE_FINISH_REASON_LENGTH
ABORT = common_pb2.ENGINE_FINISH_REASON_ABORT


@pytest.fixture(scope="module")
def model(tiny_deepseek_dir: Path) -> FakeModel:
    return FakeModel.from_dir(tiny_deepseek_dir)


def bad_fields(err: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            info = error_details_pb2.BadRequest()
            detail.Unpack(info)
            fields += [v.field for v in info.field_violations]
    return fields


async def test_generate_streams_deterministic_tokens(fake_worker: RunningWorker, model: FakeModel) -> None:
    tokens, final = await generate(fake_worker.stub, token_request("g1", [10, 11, 12], max_tokens=12))
    assert tokens == fake_greedy([10, 11, 12], 12, model)
    assert final.finish_reason == LENGTH
    assert (final.prompt_tokens, final.completion_tokens) == (3, 12)
    assert not final.HasField("stop_token_id")
    assert final.total_ms >= final.ttft_ms > 0


async def test_resume_over_grpc_equals_undisturbed_run(fake_worker: RunningWorker) -> None:
    prompt = [40, 41, 42, 43]
    full, _ = await generate(fake_worker.stub, token_request("full", prompt, max_tokens=20))
    head, _ = await generate(fake_worker.stub, token_request("head", prompt, max_tokens=7))
    tail, _ = await generate(fake_worker.stub, token_request("tail", prompt + head, max_tokens=13))
    assert head + tail == full


async def test_empty_request_id_gets_one(fake_worker: RunningWorker) -> None:
    ids = set()
    async for msg in fake_worker.stub.Generate(worker_pb2.GenerateRequest(
            request=token_request("", [5, 6], max_tokens=3))):
        ids.add(msg.request_id)
    assert len(ids) == 1 and next(iter(ids))


async def test_stop_token_reports_stop_token_id(fake_worker: RunningWorker, model: FakeModel) -> None:
    expected = fake_greedy([50, 51], 10, model)
    stop = expected[3]
    assert stop not in expected[:3]
    tokens, final = await generate(fake_worker.stub, token_request("st", [50, 51], max_tokens=10,
                                                                   stop_token_ids=[stop]))
    assert tokens == expected[:4]
    assert final.finish_reason == STOP and final.HasField("stop_token_id") and final.stop_token_id == stop


async def test_logprobs_when_asked(fake_worker: RunningWorker) -> None:
    got = []
    async for msg in fake_worker.stub.Generate(worker_pb2.GenerateRequest(
            request=token_request("lp", [5, 6], max_tokens=3, logprobs=2))):
        if msg.HasField("delta"):
            assert len(msg.delta.logprobs) == len(msg.delta.token_ids)
            got += [(lp.token_id, len(lp.top)) for lp in msg.delta.logprobs]
    assert len(got) == 3 and all(n == 2 for _, n in got)
    async for msg in fake_worker.stub.Generate(worker_pb2.GenerateRequest(
            request=token_request("nolp", [5, 6], max_tokens=3))):
        assert not msg.delta.logprobs


async def test_generate_batch_returns_tagged_streams(fake_worker: RunningWorker, model: FakeModel) -> None:
    prompts = {f"b{i}": [100 + i, 200 + i] for i in range(8)}
    request = worker_pb2.GenerateBatchRequest(
        requests=[token_request(rid, p, max_tokens=5 + i) for i, (rid, p) in enumerate(prompts.items())]
    )
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finals: dict[str, common_pb2.TokenFinal] = {}
    order = []
    async for msg in fake_worker.stub.GenerateBatch(request, timeout=30):
        assert msg.request_id not in finals
        order.append(msg.request_id)
        if msg.HasField("delta"):
            tokens[msg.request_id] += msg.delta.token_ids
        else:
            finals[msg.request_id] = msg.final
    assert set(finals) == set(prompts)
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert tokens[rid] == fake_greedy(prompt, 5 + i, model)
        assert finals[rid].completion_tokens == 5 + i
    # Multiplexed, not one after the other: the first request's stream is interleaved.
    assert order.index("b1") < len(order) - order[::-1].index("b0") - 1


async def test_cancelling_a_batch_aborts_unfinished(fake_worker: RunningWorker) -> None:
    request = worker_pb2.GenerateBatchRequest(
        requests=[token_request(f"cb{i}", [300 + i], max_tokens=2000) for i in range(4)]
    )
    call = fake_worker.stub.GenerateBatch(request)
    seen = 0
    async for _ in call:
        seen += 1
        if seen >= 8:
            break
    call.cancel()
    await wait_idle(fake_worker)


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[worker_pb2.GenerateResponse]:
    """Read a stream to its end with read() (iteration cannot follow read() on one call)."""
    messages = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        messages.append(msg)
    return messages


async def wait_idle(worker: RunningWorker, timeout: float = 5.0) -> worker_pb2.Load:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        load = (await worker.stub.GetLoad(worker_pb2.GetLoadRequest())).load
        if load.running == 0 and load.in_flight == 0 and load.waiting == 0:
            return load
        assert loop.time() < deadline, f"still busy: {load}"
        await asyncio.sleep(0.02)


async def test_cancel_mid_stream_frees_the_engine(fake_worker: RunningWorker) -> None:
    calls = [fake_worker.stub.Generate(worker_pb2.GenerateRequest(
        request=token_request(f"c{i}", [400 + i, 1000], max_tokens=2000 if i % 2 else 30)))
        for i in range(16)]
    first = [await call.read() for call in calls]
    assert all(m.HasField("delta") for m in first)
    load = (await fake_worker.stub.GetLoad(worker_pb2.GetLoadRequest())).load
    assert load.in_flight == 16 and load.running == 16
    for call in calls[1::2]:
        call.cancel()
    for i, call in enumerate(calls[::2]):
        tokens = list(first[2 * i].delta.token_ids)
        final = None
        for msg in await read_rest(call):
            if msg.HasField("delta"):
                tokens += msg.delta.token_ids
            else:
                final = msg.final
        assert final is not None and final.finish_reason == LENGTH and len(tokens) == 30
    await wait_idle(fake_worker)


async def test_deadline_aborts_in_engine(fake_worker: RunningWorker) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(fake_worker.stub, token_request("dl", [7, 8], max_tokens=2000), timeout=0.2)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_idle(fake_worker)


async def test_abort_by_id(fake_worker: RunningWorker) -> None:
    call = fake_worker.stub.Generate(worker_pb2.GenerateRequest(
        request=token_request("ab", [9, 9], max_tokens=2000)))
    await call.read()
    await fake_worker.stub.Abort(worker_pb2.AbortRequest(request_id="ab"))
    final = None
    for msg in await read_rest(call):
        if msg.HasField("final"):
            final = msg.final
    assert final is not None and final.finish_reason == ABORT
    await wait_idle(fake_worker)


async def test_abort_unknown_id_is_not_found(fake_worker: RunningWorker) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fake_worker.stub.Abort(worker_pb2.AbortRequest(request_id="nope"))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert "request_id" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fake_worker.stub.Abort(worker_pb2.AbortRequest())
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ([], {}, "request.prompt_token_ids"),
        ([5, 4096], {}, "request.prompt_token_ids"),
        ([5] * 2048, {}, "request.prompt_token_ids"),
        ([5] * 2000, {"max_tokens": 49}, "request.sampling.max_tokens"),
        ([5], {"max_tokens": 0}, "request.sampling.max_tokens"),
        ([5], {"temperature": -0.5}, "request.sampling.temperature"),
        ([5], {"temperature": math.nan}, "request.sampling.temperature"),
        ([5], {"temperature": math.inf}, "request.sampling.temperature"),
        ([5], {"top_p": 0.0}, "request.sampling.top_p"),
        ([5], {"top_p": 1.5}, "request.sampling.top_p"),
        ([5], {"top_k": -2}, "request.sampling.top_k"),
        ([5], {"min_p": 2.0}, "request.sampling.min_p"),
        ([5], {"repetition_penalty": 0.0}, "request.sampling.repetition_penalty"),
        ([5], {"presence_penalty": 3.0}, "request.sampling.presence_penalty"),
        ([5], {"frequency_penalty": -2.5}, "request.sampling.frequency_penalty"),
        ([5], {"logprobs": 21}, "request.sampling.logprobs"),
        ([5], {"max_tokens": 3, "min_tokens": 4}, "request.sampling.min_tokens"),
        ([5], {"stop_token_ids": [5000]}, "request.sampling.stop_token_ids[0]"),
        ([5], {"seed": 2**63}, "request.sampling.seed"),
    ],
)
async def test_validation_names_the_field(fake_worker: RunningWorker, prompt: list[int],
                                          sampling: dict[str, object], field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(fake_worker.stub, token_request("bad", prompt, **sampling))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in bad_fields(err.value)
    assert field in (err.value.details() or "")


async def test_duplicate_request_ids_are_rejected(fake_worker: RunningWorker) -> None:
    call = fake_worker.stub.Generate(worker_pb2.GenerateRequest(
        request=token_request("dup", [9, 10], max_tokens=2000)))
    await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(fake_worker.stub, token_request("dup", [9, 10], max_tokens=2))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad_fields(err.value) == ["request.request_id"]
    call.cancel()
    batch = worker_pb2.GenerateBatchRequest(requests=[token_request("x", [5], max_tokens=2),
                                                      token_request("x", [6], max_tokens=2)])
    responses = [r async for r in fake_worker.stub.GenerateBatch(batch)]
    errors = [r.error for r in responses if r.HasField("error")]
    assert [v.field for e in errors for v in e.field_violations] == ["request.request_id"]
    assert sum(r.HasField("final") for r in responses) == 1  # the first "x" ran
    await wait_idle(fake_worker)


async def test_one_bad_request_fails_alone_in_its_batch(fake_worker: RunningWorker) -> None:
    """A refused request ends with its own error; its batch-mates are served (a poison
    request used to fail the whole batch, and so every request sharing its window)."""
    batch = worker_pb2.GenerateBatchRequest(requests=[
        token_request("ok", [5], max_tokens=2), token_request("bad", [5], top_p=7.0),
        token_request("hot", [5], max_tokens=2, temperature=5.0),
        common_pb2.TokenRequest(request_id="lost", model="other-model", prompt_token_ids=[5])])
    responses = [r async for r in fake_worker.stub.GenerateBatch(batch)]
    errors = {r.request_id: r.error for r in responses if r.HasField("error")}
    assert set(errors) == {"bad", "hot", "lost"}
    assert errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # Named as in a single Generate: the error is that request's alone.
    assert [v.field for v in errors["bad"].field_violations] == ["request.sampling.top_p"]
    assert [v.field for v in errors["hot"].field_violations] == ["request.sampling.temperature"]
    assert errors["lost"].code == grpc.StatusCode.NOT_FOUND.value[0]
    ok = [r for r in responses if r.request_id == "ok"]
    assert sum(len(r.delta.token_ids) for r in ok) == 2 and ok[-1].HasField("final")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in fake_worker.stub.GenerateBatch(worker_pb2.GenerateBatchRequest()):
            pass
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_unknown_model_is_not_found(fake_worker: RunningWorker) -> None:
    req = token_request("m", [5], max_tokens=2)
    req.model = "other-model"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(fake_worker.stub, req)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    req.model = "tiny-deepseek"
    tokens, _ = await generate(fake_worker.stub, req)
    assert len(tokens) == 2


async def test_model_info(fake_worker: RunningWorker, tiny_deepseek_dir: Path) -> None:
    info = await fake_worker.stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
    assert info.model == "tiny-deepseek"
    assert info.tokenizer_checksum == tokenizer_checksum(tiny_deepseek_dir)
    assert (info.max_context_length, info.vocab_size) == (2048, 4096)
    assert (info.device, info.zone, info.worker_id) == ("cpu", "zone-t", "w-test")
    assert info.pid > 0


async def test_watch_load_streams_reports(fake_worker: RunningWorker) -> None:
    call = fake_worker.stub.WatchLoad(worker_pb2.WatchLoadRequest(interval_ms=20))
    gen = fake_worker.stub.Generate(worker_pb2.GenerateRequest(
        request=token_request("wl", [11, 12], max_tokens=2000)))
    await gen.read()
    reports = []
    async for msg in call:
        reports.append(msg.load)
        if len(reports) == 3:
            break
    call.cancel()
    gen.cancel()
    assert all(r.max_num_seqs == 64 for r in reports)
    assert any(r.in_flight >= 1 and r.running >= 1 for r in reports)
    await wait_idle(fake_worker)


async def test_metrics_count_finished_requests_and_tokens(fake_worker: RunningWorker) -> None:
    from prometheus_client import REGISTRY

    def sample(name: str, labels: dict[str, str] | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    requests = sample("llmesh_worker_requests_total", {"finish_reason": "length"})
    tokens = sample("llmesh_worker_generated_tokens_total")
    await generate(fake_worker.stub, token_request("metrics", [5, 6], max_tokens=4))
    assert sample("llmesh_worker_requests_total", {"finish_reason": "length"}) == requests + 1
    assert sample("llmesh_worker_generated_tokens_total") == tokens + 4

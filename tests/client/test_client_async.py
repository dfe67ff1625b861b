"""The asyncio client against the fake gateway over real grpc.aio channels."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmesh.client import (
    AsyncClient,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    RetryPolicy,
    UnauthenticatedError,
    UnavailableError,
)

from .fake_gateway import FakeGateway


async def test_generate_stream_tokenize_list(fake: FakeGateway) -> None:
    async with AsyncClient(fake.address, timeout=10) as client:
        await client.wait_ready(5)
        done = await client.generate("hello there", max_tokens=2)
        assert (done.text, done.finish_reason) == ("echo: hello ", "length")

        stream = client.stream(messages=[{"role": "user", "content": "a b"}])
        deltas = [d async for d in stream]
        assert deltas == ["echo: ", "a ", "b ", "(turn ", "1)"]
        assert stream.final.text == "".join(deltas)
        assert stream.final.served_by.worker_id == "fake-worker-1"

        again = client.stream("x y", stop=["y"])
        done = await again.completion()
        assert (done.text, done.matched_stop) == ("echo: x ", "y")

        toks = await client.tokenize("ab c")
        assert toks.token_ids == (3, 1)  # "ab " and "c"
        models = await client.list_models()
        assert [m.id for m in models if m.is_default] == ["tiny"]


async def test_errors_are_decoded(fake: FakeGateway) -> None:
    async with AsyncClient(fake.address, timeout=10) as client:
        with pytest.raises(InvalidArgumentError) as info:
            await client.generate("x", top_p=2.0)
        assert [v.field for v in info.value.field_violations] == ["sampling.top_p"]

        stream = client.stream("x", temperature=-0.5)
        with pytest.raises(InvalidArgumentError) as info:
            await stream.completion()
        assert info.value.field_violations[0].field == "sampling.temperature"

        with pytest.raises(ResourceExhaustedError) as exhausted:
            await client.generate("exhausted")
        assert exhausted.value.retry_delay == pytest.approx(2.5)
        assert exhausted.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED

    fake.state.api_key = "k"
    async with AsyncClient(fake.address, timeout=10) as client:
        with pytest.raises(UnauthenticatedError):
            await client.list_models()
    async with AsyncClient(fake.address, api_key="k", timeout=10) as client:
        assert (await client.generate("ok")).text == "echo: ok"
    assert fake.state.calls[-1].metadata["authorization"] == "Bearer k"


async def test_retry_on_unavailable(fake: FakeGateway) -> None:
    fake.state.fail_unavailable = 2
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.01)
    async with AsyncClient(fake.address, timeout=10, retry=policy) as client:
        stream = client.stream("again")
        assert (await stream.completion()).text == "echo: again"
    assert [a.outcome for a in fake.state.attempts("GenerateStream")] == ["error", "error", "ok"]

    fake.state.fail_unavailable = 1
    async with AsyncClient(fake.address, timeout=10, max_attempts=1) as client:
        with pytest.raises(UnavailableError):
            await client.generate("x")


async def test_deadline(fake: FakeGateway) -> None:
    async with AsyncClient(fake.address, timeout=0.3) as client:
        with pytest.raises(DeadlineExceededError):
            await client.generate("slow:3")
        with pytest.raises(DeadlineExceededError):
            await client.stream("slow:3").completion()
        assert (await client.generate("fast", timeout=None)).text == "echo: fast"
    first = fake.state.attempts("Generate")[0].time_remaining
    assert first is not None and 0 < first <= 0.35
    assert fake.state.attempts("Generate")[1].time_remaining is None


async def test_cancelling_the_task_cancels_the_call(fake: FakeGateway) -> None:
    async with AsyncClient(fake.address, timeout=10) as client:
        stream = client.stream("drip " + "w " * 50)
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in stream:
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):  # up to 10 s: on a busy box the cancel takes a while to land
            if fake.state.attempts("GenerateStream")[0].outcome != "running":
                break
            await asyncio.sleep(0.02)
        assert fake.state.attempts("GenerateStream")[0].outcome == "cancelled"


async def test_async_stream_context_manager_cancels(fake: FakeGateway) -> None:
    async with AsyncClient(fake.address, timeout=10) as client:
        async with client.stream("drip " + "w " * 50) as stream:
            assert await stream.__anext__() == "echo: "
        for _ in range(500):  # up to 10 s: on a busy box the cancel takes a while to land
            if fake.state.attempts("GenerateStream")[0].outcome != "running":
                break
            await asyncio.sleep(0.02)
        assert fake.state.attempts("GenerateStream")[0].outcome == "cancelled"

"""Malformed and extreme requests: every answer is a proper status and no tier crashes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmesh.v1 import inference_pb2
from tests.gateway.conftest import DEMO_KEY
from tests.gateway.helpers import bearer, stub

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF), max_size=20),
    st.sampled_from(["", "\x00", "\ud7ff", "🎉" * 50, "a" * 5000, " " * 100, "<|im_start|>", "\n\n"]),
)
floats = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32))
ints = st.one_of(st.none(), st.integers(min_value=-(2**31), max_value=2**31 - 1))
uints = st.one_of(st.none(), st.integers(min_value=0, max_value=2**32 - 1))


@st.composite
def requests(draw: st.DrawFn) -> inference_pb2.GenerateRequest:
    sampling = inference_pb2.SamplingParams()
    for name, strategy in (
        ("temperature", floats), ("top_p", floats), ("min_p", floats), ("repetition_penalty", floats),
        ("presence_penalty", floats), ("frequency_penalty", floats), ("top_k", ints),
        ("max_tokens", st.one_of(st.none(), st.integers(0, 64), st.integers(0, 2**32 - 1))),
        ("min_tokens", uints), ("logprobs", st.one_of(st.none(), st.integers(0, 64))),
        ("seed", st.one_of(st.none(), st.integers(0, 2**64 - 1))),
    ):
        value = draw(strategy)
        if value is not None:
            setattr(sampling, name, value)
    sampling.stop.extend(draw(st.lists(text, max_size=20)))
    sampling.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=4)))
    if draw(st.booleans()):
        sampling.ignore_eos = draw(st.booleans())
    messages = draw(st.lists(
        st.builds(lambda r, c: inference_pb2.ChatMessage(role=r, content=c),
                  st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), text), text),
        max_size=5,
    ))
    return inference_pb2.GenerateRequest(
        model=draw(st.one_of(st.just(""), text)),
        prompt=draw(st.one_of(st.just(""), text)),
        messages=messages,
        sampling=sampling,
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        request_id=draw(st.one_of(st.just(""), text)),
    )


@pytest.mark.filterwarnings("ignore")
def test_fuzzed_requests_get_proper_statuses(fake_mesh):
    address = f"{fake_mesh.config.gateway.host}:{fake_mesh.config.gateway.port}"
    seen: set[grpc.StatusCode] = set()

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests())
    def check(req: inference_pb2.GenerateRequest) -> None:
        async def call() -> None:
            async with grpc.aio.insecure_channel(address) as channel:
                try:
                    await stub(channel).Generate(req, metadata=bearer(DEMO_KEY), timeout=5)
                    seen.add(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as err:
                    assert err.code() in ALLOWED, (err.code(), err.details())
                    assert err.details(), "every error carries a message"
                    seen.add(err.code())

        asyncio.run(call())

    check()
    assert grpc.StatusCode.INVALID_ARGUMENT in seen
    for proc in fake_mesh.procs:
        assert proc.alive(), f"{proc.name} died during the fuzz run"

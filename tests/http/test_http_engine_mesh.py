"""The OpenAI-compatible HTTP surface through a real mesh with one vLLM CPU worker on SmolLM2,
driven by the official ``openai`` client.

The mesh is the session-wide ``engine_mesh`` of tests/conftest.py (gRPC and HTTP).
"""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmesh.up import Mesh
from tests.http.conftest import client, stream_events

pytestmark = pytest.mark.engine

PARIS: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_paris_streamed_equals_non_streamed(engine_mesh: Mesh) -> None:
    api = client(engine_mesh)
    unary = api.chat.completions.create(model=engine_mesh.model_name, messages=PARIS,
                                        temperature=0, max_tokens=32)
    answer = unary.choices[0].message.content or ""
    assert "Paris" in answer
    assert unary.choices[0].finish_reason in ("stop", "length")
    assert unary.usage is not None and unary.usage.completion_tokens > 0
    before = stream_events(engine_mesh)
    chunks = list(api.chat.completions.create(model=engine_mesh.model_name, messages=PARIS,
                                              temperature=0, max_tokens=32, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    # After the first event, the text went straight from the postprocessor's frames to the
    # connection (tests/http/test_http_fake_mesh.py has the count in detail).
    assert stream_events(engine_mesh)["direct"] > before["direct"]
    assert chunks[-2].choices[0].finish_reason == unary.choices[0].finish_reason
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens


def test_completions_streamed_equals_non_streamed(engine_mesh: Mesh) -> None:
    api = client(engine_mesh)
    prompt = "The capital of France is"
    unary = api.completions.create(model="", prompt=prompt, temperature=0, max_tokens=8)
    assert "Paris" in unary.choices[0].text
    chunks = list(api.completions.create(model="", prompt=prompt, temperature=0, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == unary.choices[0].text
    assert {c.model for c in chunks} == {engine_mesh.model_name}


def test_skip_reading_prefix_cache_under_its_own_name(engine_mesh: Mesh) -> None:
    """The JSON body takes skip_reading_prefix_cache under the proto's name (as vLLM's own
    server does); the engine then computes a cached prompt afresh."""
    api = client(engine_mesh)
    prompt = "Statement of account, line by line, with value dates. " * 40

    def cached_tokens(**extra: object) -> int:
        reply = api.completions.create(model="", prompt=prompt, temperature=0, max_tokens=2,
                                       extra_body=extra or None)
        assert reply.usage is not None and reply.usage.prompt_tokens > 256
        details = reply.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0

    cached_tokens()  # warm the cache
    assert cached_tokens(skip_reading_prefix_cache=True) == 0
    assert cached_tokens() > 0

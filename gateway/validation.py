"""Validation of public requests. Every failure names the offending field."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.types import GenerateCall, ModelMeta
from services.common.errors import FieldViolation, InvalidArgument
from services.common.sampling_rules import MAX_LOGPROBS, sampling_violations

ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int = 200_000
    max_messages: int = 256
    max_message_chars: int = 100_000
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_logprobs: int = 20
    max_priority: int = 1000


def validate_input(call: GenerateCall, limits: Limits, violations: list[FieldViolation]) -> None:
    if not call.prompt and not call.messages:
        violations.append(FieldViolation("prompt", "one of prompt or messages is required"))
    if call.prompt and call.messages:
        violations.append(FieldViolation("messages", "set either prompt or messages, not both"))
    if len(call.prompt) > limits.max_prompt_chars:
        violations.append(FieldViolation(
            "prompt", f"{len(call.prompt)} characters exceeds the limit of {limits.max_prompt_chars}"
        ))
    if len(call.messages) > limits.max_messages:
        violations.append(FieldViolation(
            "messages", f"{len(call.messages)} messages exceeds the limit of {limits.max_messages}"
        ))
    for i, message in enumerate(call.messages[: limits.max_messages]):
        if message.role not in ROLES:
            violations.append(FieldViolation(
                f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {message.role[:32]!r}"
            ))
        if len(message.content) > limits.max_message_chars:
            violations.append(FieldViolation(
                f"messages[{i}].content",
                f"{len(message.content)} characters exceeds the limit of {limits.max_message_chars}",
            ))
    if "\x00" in call.prompt:
        violations.append(FieldViolation("prompt", "must not contain NUL characters"))


def validate_call(call: GenerateCall, model: ModelMeta, limits: Limits) -> None:
    """Check everything that can be checked before tokenizing; raise InvalidArgument."""
    v: list[FieldViolation] = []
    validate_input(call, limits, v)
    s = call.sampling
    # The engine's own bounds, shared with the worker (services/common/sampling_rules.py).
    v += sampling_violations(s, "sampling")
    if s.top_k is not None and model.vocab_size and s.top_k > model.vocab_size:
        v.append(FieldViolation("sampling.top_k", f"must be at most the vocabulary size {model.vocab_size}"))
    if s.max_tokens is not None and s.max_tokens >= max(1, model.max_context_length):
        v.append(FieldViolation(
            "sampling.max_tokens",
            f"{s.max_tokens} does not fit the model's context of {model.max_context_length} tokens",
        ))
    if len(s.stop) > limits.max_stop_strings:
        v.append(FieldViolation(
            "sampling.stop", f"{len(s.stop)} stop strings exceeds the limit of {limits.max_stop_strings}"
        ))
    for i, stop in enumerate(s.stop[: limits.max_stop_strings]):
        if not stop:
            v.append(FieldViolation(f"sampling.stop[{i}]", "must not be empty"))
        elif len(stop) > limits.max_stop_chars:
            v.append(FieldViolation(
                f"sampling.stop[{i}]", f"{len(stop)} characters exceeds the limit of {limits.max_stop_chars}"
            ))
    for i, token_id in enumerate(s.stop_token_ids):
        if model.vocab_size and token_id >= model.vocab_size:
            v.append(FieldViolation(
                f"sampling.stop_token_ids[{i}]", f"{token_id} is outside the vocabulary ({model.vocab_size})"
            ))
    if s.logprobs is not None and limits.max_logprobs < s.logprobs <= MAX_LOGPROBS:
        v.append(FieldViolation("sampling.logprobs", f"must be at most {limits.max_logprobs}"))
    if abs(call.priority) > limits.max_priority:
        v.append(FieldViolation("priority", f"must be within ±{limits.max_priority}"))
    if call.request_id and not REQUEST_ID_RE.match(call.request_id):
        v.append(FieldViolation(
            "request_id", "must be 1-128 characters of letters, digits and . _ : - (starting alphanumeric)"
        ))
    if v:
        raise InvalidArgument.many(v)


def check_context(call: GenerateCall, model: ModelMeta, prompt_tokens: int, default_max_tokens: int) -> int:
    """Check the tokenized prompt against the context; return the max_tokens to use."""
    field = "messages" if call.messages else "prompt"
    room = model.max_context_length - prompt_tokens
    if room < 1:
        raise InvalidArgument(
            field,
            f"{prompt_tokens} tokens leave no room in the model's context of "
            f"{model.max_context_length} tokens",
        )
    requested = call.sampling.max_tokens
    if requested is None:
        return min(default_max_tokens, room)
    if requested > room:
        raise InvalidArgument(
            "sampling.max_tokens",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({requested}) exceeds the model's "
            f"context of {model.max_context_length} tokens",
        )
    return requested

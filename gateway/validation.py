"""Validation of public requests. Every failure names the offending field.

Two steps: :func:`validate_request` checks sizes, counts and text against the limits
shared with the tokenizer (:mod:`services.common.limits`) before anything else is done
for the call, so nothing oversized reaches a log, an audit record or another tier;
:func:`validate_call` then checks the request against the model it resolved to.
"""

from __future__ import annotations

import re

from gateway.types import GenerateCall, ModelMeta
from services.common.errors import FieldViolation, InvalidArgument
from services.common.limits import RequestLimits, check_text, clip
from services.common.sampling import MAX_LOGPROBS, sampling_violations

ROLES = ("system", "user", "assistant", "tool")
MAX_STREAM_INTERVAL = 256
"""Most tokens per stream delta a caller or deployment may ask for."""
MAX_STREAM_MAX_DELAY_MS = 60_000
"""Longest hold-back of streamed text a caller or deployment may ask for."""
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]*$")


def validate_input(call: GenerateCall, limits: RequestLimits, violations: list[FieldViolation]) -> None:
    """The prompt or conversation: presence, sizes and the text rule."""
    if not call.prompt and not call.messages:
        violations.append(FieldViolation("prompt", "one of prompt or messages is required"))
    if call.prompt and call.messages:
        violations.append(FieldViolation("messages", "set either prompt or messages, not both"))
    check_text("prompt", call.prompt, limits.max_input_chars, violations)
    if len(call.messages) > limits.max_messages:
        violations.append(FieldViolation(
            "messages", f"{len(call.messages)} messages exceeds the limit of {limits.max_messages}"
        ))
        return
    total = sum(len(m.content) for m in call.messages)
    if total > limits.max_input_chars:
        violations.append(FieldViolation(
            "messages", f"{total} characters of content exceeds the limit of {limits.max_input_chars}"
        ))
        return
    for i, message in enumerate(call.messages):
        if message.role not in ROLES:
            violations.append(FieldViolation(
                f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {clip(message.role, 32)!r}"
            ))
        check_text(f"messages[{i}].content", message.content, limits.max_input_chars, violations)


def validate_request(call: GenerateCall, limits: RequestLimits) -> None:
    """Sizes, counts and text of every client-controlled field; raise InvalidArgument.

    Cheap and model-free: run first, so what is logged or audited about a refused call
    (model, request id) is already known to be bounded.
    """
    v: list[FieldViolation] = []
    check_text("model", call.model, limits.max_model_chars, v)
    validate_input(call, limits, v)
    s = call.sampling
    if len(s.stop) > limits.max_stop_strings:
        v.append(FieldViolation(
            "sampling.stop", f"{len(s.stop)} stop strings exceeds the limit of {limits.max_stop_strings}"
        ))
    else:
        for i, stop in enumerate(s.stop):
            if not stop:
                v.append(FieldViolation(f"sampling.stop[{i}]", "must not be empty"))
            check_text(f"sampling.stop[{i}]", stop, limits.max_stop_chars, v)
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        v.append(FieldViolation(
            "sampling.stop_token_ids",
            f"{len(s.stop_token_ids)} token ids exceeds the limit of {limits.max_stop_token_ids}",
        ))
    if call.request_id and (
        len(call.request_id) > limits.max_request_id_chars or not REQUEST_ID_RE.match(call.request_id)
    ):
        v.append(FieldViolation(
            "request_id", f"must be 1-{limits.max_request_id_chars} characters of letters, digits "
            "and . _ : - (starting alphanumeric)"
        ))
    o = call.stream_options
    if not 0 <= o.interval <= MAX_STREAM_INTERVAL:
        v.append(FieldViolation(
            "stream_options.interval",
            f"must be 1-{MAX_STREAM_INTERVAL} tokens per delta (0 for the deployment's default), "
            f"got {o.interval}",
        ))
    if not 0 <= o.max_delay_ms <= MAX_STREAM_MAX_DELAY_MS:
        v.append(FieldViolation(
            "stream_options.max_delay_ms",
            f"must be 1-{MAX_STREAM_MAX_DELAY_MS} ms (0 for the deployment's default), got {o.max_delay_ms}",
        ))
    if v:
        raise InvalidArgument.many(v)


def validate_call(call: GenerateCall, model: ModelMeta, limits: RequestLimits) -> None:
    """Check the request against its model before tokenizing; raise InvalidArgument.

    Expects :func:`validate_request` to have passed (sizes and counts are bounded)."""
    v: list[FieldViolation] = []
    s = call.sampling
    # The engine's own bounds, shared with the worker (services/common/sampling.py).
    v += sampling_violations(s, "sampling", vocab_size=model.vocab_size)
    if s.top_k is not None and model.vocab_size and s.top_k > model.vocab_size:
        v.append(FieldViolation("sampling.top_k", f"must be at most the vocabulary size {model.vocab_size}"))
    if s.max_tokens is not None and s.max_tokens >= max(1, model.max_context_length):
        v.append(FieldViolation(
            "sampling.max_tokens",
            f"{s.max_tokens} does not fit the model's context of {model.max_context_length} tokens",
        ))
    if s.logprobs is not None and limits.max_logprobs < s.logprobs <= MAX_LOGPROBS:
        v.append(FieldViolation("sampling.logprobs", f"must be at most {limits.max_logprobs}"))
    if abs(call.priority) > limits.max_priority:
        v.append(FieldViolation("priority", f"must be within ±{limits.max_priority}"))
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

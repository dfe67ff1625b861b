"""The one table from domain errors to HTTP status and OpenAI's error shape, and the
streamed chunk's encoding (no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.http import _TEXT_MARK, _delta_event_parts, _json_string, error_body, openai_param
from services.common.errors import (
    Cancelled,
    DeadlineExceeded,
    FieldViolation,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)


@pytest.mark.parametrize(("exc", "status", "kind", "code"), [
    (InvalidArgument("prompt", "is required"), 400, "invalid_request_error", "invalid_argument"),
    (NotFound("model: 'x' is not served"), 404, "invalid_request_error", "model_not_found"),
    (Unauthenticated("unknown API key"), 401, "authentication_error", "unauthenticated"),
    (PermissionDenied("no"), 403, "permission_error", "permission_denied"),
    (ResourceExhausted("slow down", retry_after_s=2.0), 429, "rate_limit_error", "resource_exhausted"),
    (Unavailable("no replica"), 503, "service_unavailable", "unavailable"),
    (DeadlineExceeded("too slow"), 504, "timeout", "deadline_exceeded"),
    (Cancelled("gone"), 499, "cancelled", "cancelled"),
    (Internal("bug"), 500, "server_error", "internal"),
])
def test_status_table(exc: Exception, status: int, kind: str, code: str) -> None:
    got_status, body, _ = error_body(exc)
    assert got_status == status
    assert body == {"error": {"message": exc.args[0], "type": kind,
                              "param": "prompt" if status == 400 else None, "code": code}}


def test_unexpected_errors_do_not_leak_their_text() -> None:
    status, body, _ = error_body(KeyError("secret prompt text"))
    assert status == 500
    assert "secret" not in body["error"]["message"]
    assert body["error"]["type"] == "server_error"


@pytest.mark.parametrize(("retry_after_s", "header"), [(0.05, "1"), (1.0, "1"), (1.2, "2"), (59.9, "60")])
def test_retry_after_is_whole_seconds_never_early(retry_after_s: float, header: str) -> None:
    _, _, headers = error_body(ResourceExhausted("over", retry_after_s=retry_after_s))
    assert headers == {"Retry-After": header}


def test_fields_are_named_as_the_json_body_names_them() -> None:
    assert openai_param("sampling.temperature") == "temperature"
    assert openai_param("messages[2].role") == "messages[2].role"
    assert openai_param("sampling.max_tokens", {"max_tokens": 0}) == "max_tokens"
    assert openai_param("sampling.max_tokens", {"max_completion_tokens": 0}) == "max_completion_tokens"
    assert openai_param("sampling.logprobs", {"logprobs": 5}) == "logprobs"
    assert openai_param("sampling.logprobs", {"logprobs": True, "top_logprobs": 50}) == "top_logprobs"
    many = InvalidArgument.many([
        FieldViolation("sampling.top_p", "must be in (0, 1]"),
        FieldViolation("sampling.min_tokens", "must not exceed sampling.max_tokens"),
    ])
    _, body, _ = error_body(many, {"top_p": 5, "min_tokens": 9, "max_tokens": 3})
    assert body["error"]["param"] == "top_p"
    assert body["error"]["message"] == "top_p: must be in (0, 1]; min_tokens: must not exceed max_tokens"


@pytest.mark.parametrize("text", ["plain", 'quote " and \\ backslash', "line\nbreak\ttab", "中文 🙂 é",
                                  "\u2063llmesh-text\u2063", "", "\x00\x1f</script>",
                                  "lone \ud800 surrogate"])
@pytest.mark.parametrize("chat", [True, False])
def test_a_text_delta_event_is_the_chunk_as_json(text: str, chat: bool) -> None:
    """The streamed delta is written from a template split around its text: byte for
    byte what encoding the whole chunk would give, whatever the text holds."""
    def chunk(value: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None}
        choice["delta" if chat else "text"] = {"content": value} if chat else value
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [choice]}

    head, tail = _delta_event_parts(chunk(_TEXT_MARK))
    assert head + _json_string(text) + tail == f"data: {json.dumps(chunk(text))}\n\n".encode()
    assert _json_string(text) == json.dumps(text).encode()

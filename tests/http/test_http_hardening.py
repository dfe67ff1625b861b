"""The OpenAI-compatible HTTP surface refuses cheaply too: bounded bodies, keys checked
before the body is read, refusals audited, and the same text rule as gRPC."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import psutil

from gateway.tenants import hash_key
from llmesh.up import Mesh
from services.common.limits import RequestLimits
from tests.http.conftest import DEMO_KEY, http_base

MB = 1024 * 1024


def _auth_failures(mesh: Mesh) -> list[dict]:  # type: ignore[type-arg]
    path = Path(mesh.config.gateway.audit_log)
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if e["event"] == "auth_failure"]


def test_bodies_beyond_the_limits_are_refused_with_413(http_fake_mesh) -> None:  # type: ignore[no-untyped-def]
    limit = RequestLimits().max_json_bytes()
    body = json.dumps({"prompt": "x" * (limit + 1), "max_tokens": 1})
    with httpx.Client(timeout=60) as http:
        response = http.post(f"{http_base(http_fake_mesh)}/completions", content=body,
                             headers={"Authorization": f"Bearer {DEMO_KEY}",
                                      "Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_keyless_large_bodies_are_refused_unread_and_audited(http_fake_mesh) -> None:  # type: ignore[no-untyped-def]
    gateway = psutil.Process(next(p for p in http_fake_mesh.procs if p.tier == "gateway").pid)
    before_rss = gateway.memory_info().rss
    before = len(_auth_failures(http_fake_mesh))
    body = b'{"prompt": "' + b"x" * (30 * MB) + b'"}'
    with httpx.Client(timeout=60) as http:
        for key in ("", "wrong-http-key"):
            headers = {"Content-Type": "application/json"}
            if key:
                headers["Authorization"] = f"Bearer {key}"
            try:
                response = http.post(f"{http_base(http_fake_mesh)}/completions", content=body,
                                     headers=headers)
            except httpx.TransportError:
                continue  # the gateway may close the connection before the body is sent
            assert response.status_code == 401
    assert (gateway.memory_info().rss - before_rss) / MB < 100
    failures = _auth_failures(http_fake_mesh)[before:]
    assert [e["reason"] for e in failures] == ["missing", "unknown_key"]
    assert all(e["surface"] == "http" and e["peer"] for e in failures)
    assert failures[1]["key_sha256_prefix"] == hash_key("wrong-http-key")[:12]
    assert "wrong-http-key" not in Path(http_fake_mesh.config.gateway.audit_log).read_text()


def test_nul_in_message_content_is_refused_like_in_the_prompt(http_fake_mesh) -> None:  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {DEMO_KEY}"}
    with httpx.Client(timeout=30) as http:
        chat = http.post(f"{http_base(http_fake_mesh)}/chat/completions", headers=headers,
                         json={"messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 1})
        prompt = http.post(f"{http_base(http_fake_mesh)}/completions", headers=headers,
                           json={"prompt": "a\x00b", "max_tokens": 1})
        surrogate = http.post(f"{http_base(http_fake_mesh)}/completions", headers=headers,
                              content=b'{"prompt": "a\\ud800b", "max_tokens": 1}')
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].content"
    assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "prompt"
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt"

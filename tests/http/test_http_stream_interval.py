"""Stream interval on the OpenAI-compatible surface: ``stream_options.interval`` and
``stream_options.max_delay_ms`` coalesce SSE chunks, never change their text.

The fake engine echoes the prompt (CJK, emoji, an e-mail address, a stop string), one
tenant has the redact filter; the deployment default is interval 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmesh.meshconfig import GatewayConfig, MeshConfig, RouterConfig, TenantConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from tests.http.conftest import client, http_base, key_hash, running_mesh

EMAIL = "alice.smith@example.com"
PROMPT = f"東京タワー 🙂👍🏽 write to {EMAIL} today; café 北京 😀 end"
KEYS = {"plain": "si-plain-key", "redact": "si-redact-key"}


@pytest.fixture(scope="module")
def echo_http_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), settings={"drain_seconds": 0}),
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake",
                              settings={"fake_token_delay_ms": 1, "fake_echo": True})],
        tenants=[TenantConfig(name="plain", key_sha256=key_hash(KEYS["plain"])),
                 TenantConfig(name="redact", key_sha256=key_hash(KEYS["redact"]), filter_mode="redact")],
    )
    with running_mesh(config, tmp_path_factory.mktemp("http-interval-mesh")) as mesh:
        yield mesh


def _stream(mesh: Mesh, key: str, options: dict[str, Any] | None, chat: bool, **kwargs: Any,
            ) -> tuple[list[str], str | None, int]:
    """Text of every content chunk, the finish reason and the usage's completion tokens."""
    api = client(mesh, KEYS[key])
    stream_options: dict[str, Any] = {"include_usage": True, **(options or {})}
    if chat:
        chunks = list(api.chat.completions.create(
            model="", messages=[{"role": "user", "content": PROMPT}], stream=True,
            stream_options=stream_options, **kwargs))  # type: ignore[arg-type]
        texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    else:
        chunks = list(api.completions.create(model="", prompt=PROMPT, stream=True,
                                             stream_options=stream_options, **kwargs))  # type: ignore[arg-type]
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    usage = chunks[-1].usage
    assert usage is not None
    return texts, finish, usage.completion_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("key", sorted(KEYS))
def test_coalesced_sse_is_byte_identical_to_interval_one(echo_http_mesh: Mesh, key: str, chat: bool) -> None:
    n = 64
    kwargs = {"max_tokens": n, "temperature": 0, "extra_body": {"ignore_eos": True}}
    base, finish, tokens = _stream(echo_http_mesh, key, None, chat, **kwargs)
    base_text = "".join(base)
    assert (EMAIL in base_text) is (key == "plain") and ("[REDACTED:email]" in base_text) is (key == "redact")
    for interval in (4, 16):
        options = {"interval": interval, "max_delay_ms": 60000}
        texts, f, t = _stream(echo_http_mesh, key, options, chat, **kwargs)
        assert "".join(texts).encode() == base_text.encode()
        assert (f, t) == (finish, tokens)
        assert len(texts) <= min(2 + n // interval, len(base))
        assert interval < 16 or len(texts) < len(base)


def test_stop_strings_across_coalesced_sse_chunks(echo_http_mesh: Mesh) -> None:
    kwargs = {"max_tokens": 80, "temperature": 0, "stop": ["北京"], "extra_body": {"ignore_eos": True}}
    base, finish, tokens = _stream(echo_http_mesh, "plain", None, False, **kwargs)
    assert finish == "stop" and "北京" not in "".join(base)
    texts, f, t = _stream(echo_http_mesh, "plain", {"interval": 8}, False, **kwargs)
    assert "".join(texts) == "".join(base)
    assert (f, t) == (finish, tokens)


@pytest.mark.parametrize(("options", "param"), [
    ({"interval": 257}, "stream_options.interval"),
    ({"interval": -1}, "stream_options.interval"),
    ({"interval": "4"}, "stream_options.interval"),
    ({"interval": True}, "stream_options.interval"),
    ({"max_delay_ms": 60001}, "stream_options.max_delay_ms"),
    ({"max_delay_ms": 2.5}, "stream_options.max_delay_ms"),
])
def test_an_invalid_stream_option_is_a_400_naming_it(echo_http_mesh: Mesh, options: dict[str, Any],
                                                     param: str) -> None:
    body = {"prompt": "x", "max_tokens": 2, "stream": True, "stream_options": options}
    r = httpx.post(f"{http_base(echo_http_mesh)}/completions", json=body,
                   headers={"Authorization": f"Bearer {KEYS['plain']}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["code"] == "invalid_argument"
    assert param in error["message"]

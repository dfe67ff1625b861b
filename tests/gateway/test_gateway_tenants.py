"""Per-tenant output filters and token quotas, end to end through every tier.

The workers run the fake engine in echo mode: the answer repeats the prompt, so a prompt
holding an e-mail address puts one in the model output, where the postprocessor's filter
must act according to the caller's tenant.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.meshconfig import MeshConfig, RouterConfig, TenantConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import bearer, collect_stream, request, retry_delay_ms, stream_request, stub

EMAIL = "alice.smith@example.com"
PROMPT = f"please write to {EMAIL} today"
KEYS = {"plain": "plain-key", "redact": "redact-key", "block": "block-key", "tpm": "tpm-key"}
TPM_LIMIT = 60


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def echo_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1, "settings": {"drain_seconds": 0}},
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake",
                              settings={"fake_token_delay_ms": 1, "fake_echo": True})],
        tenants=[
            TenantConfig(name="plain", key_sha256=_hash(KEYS["plain"])),
            TenantConfig(name="redact", key_sha256=_hash(KEYS["redact"]), filter_mode="redact"),
            TenantConfig(name="block", key_sha256=_hash(KEYS["block"]), filter_mode="block"),
            TenantConfig(name="tpm", key_sha256=_hash(KEYS["tpm"]), tokens_per_minute=TPM_LIMIT),
        ],
    )
    with running_mesh(config, tmp_path_factory.mktemp("echo-mesh")) as mesh:
        yield mesh


@pytest.fixture
async def channel(echo_mesh: Mesh):
    async with grpc.aio.insecure_channel(gateway_address(echo_mesh)) as ch:
        yield ch


async def _prompt_tokens(s, key: str) -> int:  # type: ignore[no-untyped-def]
    reply = await s.Tokenize(inference_pb2.TokenizeRequest(prompt=PROMPT), metadata=bearer(key))
    return int(reply.count)


async def test_filter_mode_follows_the_tenant(channel) -> None:  # type: ignore[no-untyped-def]
    s = stub(channel)
    n = await _prompt_tokens(s, KEYS["plain"])
    sampling = {"max_tokens": n, "ignore_eos": True, "temperature": 0.0}

    plain, final, _ = await collect_stream(s, stream_request(prompt=PROMPT, sampling=sampling),
                                           metadata=bearer(KEYS["plain"]))
    assert EMAIL in plain  # the echo really carries the address: the checks below mean something
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH

    redacted, final, _ = await collect_stream(s, stream_request(prompt=PROMPT, sampling=sampling),
                                              metadata=bearer(KEYS["redact"]))
    assert EMAIL not in redacted and "example.com" not in redacted
    assert redacted == plain.replace(EMAIL, "[REDACTED:email]")
    unary = await s.Generate(request(prompt=PROMPT, sampling=sampling), metadata=bearer(KEYS["redact"]))
    assert unary.text == redacted

    blocked, final, _ = await collect_stream(s, stream_request(prompt=PROMPT, sampling=sampling),
                                             metadata=bearer(KEYS["block"]))
    assert final.finish_reason == inference_pb2.FINISH_REASON_CONTENT_FILTER
    assert "@" not in blocked and plain.startswith(blocked)


async def test_tokens_per_minute_limit_is_resource_exhausted_with_retry_info(channel) -> None:  # type: ignore[no-untyped-def]
    s = stub(channel)
    key = bearer(KEYS["tpm"])
    used = 0
    for _ in range(10):
        try:
            reply = await s.Generate(request(prompt=PROMPT, sampling={"max_tokens": 8, "ignore_eos": True}),
                                     metadata=key)
        except grpc.aio.AioRpcError as err:
            assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tokens per minute" in (err.details() or "")
            delay = retry_delay_ms(err)
            assert delay is not None and 0 < delay <= 60_000
            break
        # Prompt and completion tokens both count against the tenant's budget.
        assert used < TPM_LIMIT, "a request was admitted with the budget already spent"
        used += reply.usage.prompt_tokens + reply.usage.completion_tokens
    else:
        pytest.fail("the tokens-per-minute limit never applied")
    assert used >= TPM_LIMIT
    # Another tenant is not affected.
    await s.Generate(request(prompt=PROMPT, sampling={"max_tokens": 2}), metadata=bearer(KEYS["plain"]))


async def test_logs_are_json_with_request_and_trace_ids_and_never_text(channel, echo_mesh) -> None:  # type: ignore[no-untyped-def]
    import asyncio
    import json
    import os

    s = stub(channel)
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    rid = "log-check-" + os.urandom(4).hex()
    await s.Generate(request(prompt=PROMPT, request_id=rid, sampling={"max_tokens": 8}),
                     metadata=(*bearer(KEYS["plain"]), ("traceparent", f"00-{trace_id}-{parent}-01")))
    from gateway.core import scoped_request_id
    from gateway.tenants import Tenant

    # Logs carry the id every tier knows the request by: the client's, scoped to its tenant.
    logged_id = scoped_request_id(Tenant("plain"), rid)
    gateway = next(p for p in echo_mesh.procs if p.tier == "gateway")
    assert gateway.log_path is not None
    line = None
    for _ in range(50):  # the line is written when the call ends
        lines = [json.loads(raw) for raw in gateway.log_path.read_text().splitlines() if raw.strip()]
        line = next((entry for entry in lines if entry.get("request_id") == logged_id), None)
        if line is not None:
            break
        await asyncio.sleep(0.1)
    assert line is not None, "the gateway logged no line for the request"
    assert line["level"] == "INFO" and line["trace_id"] == trace_id and line["tier"] == "gateway"
    assert line["tenant"] == "plain" and line["status"] == "OK" and line["completion_tokens"] == 8
    for proc in echo_mesh.procs:
        assert proc.log_path is not None
        for raw in proc.log_path.read_text().splitlines():
            if not raw.strip():
                continue
            entry = json.loads(raw)  # every line is one JSON object
            assert EMAIL not in raw and "please write to" not in raw, (proc.name, entry)

"""Cheap refusals and hostile input (issue 16, parts 3 and 6) through a real fake-engine mesh.

Every tier is a real process (``fake_mesh``); the gateway is measured from outside
(psutil RSS, its /metrics, its audit log and every tier's log file).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from gateway.core import GatewayCore, scoped_request_id
from gateway.tenants import AuthenticationFailed, Tenant, TenantRegistry, hash_key
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from tests.gateway.conftest import DEMO_KEY, gateway_address
from tests.gateway.helpers import bearer, request, stream_request, stub, violations

AUTH = bearer(DEMO_KEY)
OTHER_TENANT = bearer("redact-key")  # tenant "redacted" in fake_mesh
MB = 1024 * 1024
BIG_OPTIONS = [("grpc.max_send_message_length", -1)]


def _proc(mesh: Mesh, tier: str):  # type: ignore[no-untyped-def]
    return next(p for p in mesh.procs if p.tier == tier)


def _audit(mesh: Mesh) -> list[dict]:  # type: ignore[type-arg]
    path = Path(mesh.config.gateway.audit_log)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _metric(mesh: Mesh, name: str, **labels: str) -> float:
    port = _proc(mesh, "gateway").metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.05)


# -- part 3: cheap refusals -----------------------------------------------------------


async def test_ten_30mb_requests_without_a_key_are_refused_and_cost_little_memory(fake_mesh) -> None:  # type: ignore[no-untyped-def]
    gateway = psutil.Process(_proc(fake_mesh, "gateway").pid)
    async with grpc.aio.insecure_channel(gateway_address(fake_mesh), options=BIG_OPTIONS) as channel:
        s = stub(channel)
        await s.Generate(request(prompt="warm", sampling={"max_tokens": 1}), metadata=AUTH)
        before = gateway.memory_info().rss
        payload = "x" * (30 * MB)

        async def keyless(i: int) -> grpc.StatusCode:
            try:
                if i % 2:
                    await s.Generate(request(prompt=payload), timeout=60)
                else:
                    async for _ in s.GenerateStream(stream_request(prompt=payload), timeout=60):
                        pass
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        codes = await asyncio.gather(*(keyless(i) for i in range(10)))
        after = gateway.memory_info().rss
        # The gateway still serves afterwards.
        await s.Generate(request(prompt="still here", sampling={"max_tokens": 1}), metadata=AUTH)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 10, codes
    growth = (after - before) / MB
    print(f"gateway RSS {before / MB:.1f} MB -> {after / MB:.1f} MB (+{growth:.1f} MB) "
          "after ten keyless 30 MB requests")
    assert growth < 100, f"gateway RSS grew by {growth:.1f} MB"


async def test_a_message_beyond_the_limits_is_refused_before_parsing_even_with_a_key(fake_mesh) -> None:  # type: ignore[no-untyped-def]
    gateway = psutil.Process(_proc(fake_mesh, "gateway").pid)
    async with grpc.aio.insecure_channel(gateway_address(fake_mesh), options=BIG_OPTIONS) as channel:
        before = gateway.memory_info().rss
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub(channel).Generate(request(prompt="x" * (30 * MB)), metadata=AUTH, timeout=60)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (gateway.memory_info().rss - before) / MB < 100


async def test_a_million_stop_token_ids_are_refused(fake_channel) -> None:  # type: ignore[no-untyped-def]
    # A million ids do not fit the message size the limits allow: refused before parsing.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(fake_channel).Generate(
            request(prompt="x", sampling={"stop_token_ids": [1] * 1_000_000}), metadata=AUTH, timeout=30)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # Within the size, the count is bounded by the shared limits.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(fake_channel).Generate(
            request(prompt="x", sampling={"stop_token_ids": [1] * 65}), metadata=AUTH, timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err.value) == ["sampling.stop_token_ids"]
    reply = await stub(fake_channel).Generate(
        request(prompt="x", sampling={"stop_token_ids": [1] * 64, "max_tokens": 2}), metadata=AUTH)
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize(("fields", "field"), [
    ({"prompt": "x", "model": "m" * 257}, "model"),
    ({"prompt": "x", "request_id": "r" * 129}, "request_id"),
    ({"prompt": "x", "sampling": {"stop": ["s" * 257]}}, "sampling.stop[0]"),
    ({"messages": [("u" * 1000, "hi")]}, "messages[0].role"),
])
async def test_every_string_field_is_bounded(fake_channel, fake_mesh, fields, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(fake_channel).Generate(request(**fields), metadata=AUTH, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err.value) == [field]
    assert len(err.value.details() or "") < 300


async def test_a_long_model_name_reaches_neither_audit_nor_log_unbounded(fake_channel, fake_mesh) -> None:  # type: ignore[no-untyped-def]
    marker = "long-model-" + "q" * 100_000
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(fake_channel).Generate(request(prompt="x", model=marker, request_id="long-model-1"),
                                          metadata=AUTH, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    await _wait_for(lambda: any(e.get("request_id") == "long-model-1" for e in _audit(fake_mesh)))
    entry = next(e for e in _audit(fake_mesh) if e.get("request_id") == "long-model-1")
    assert entry["status"] == "INVALID_ARGUMENT"
    assert len(entry["model"]) < 300
    for proc in fake_mesh.procs:
        assert proc.log_path is not None
        assert "q" * 300 not in proc.log_path.read_text(), proc.name
    assert "q" * 300 not in Path(fake_mesh.config.gateway.audit_log).read_text()


# -- part 6: the smaller items ----------------------------------------------------------


@pytest.mark.parametrize(("fields", "field"), [
    ({"prompt": "a\x00b"}, "prompt"),
    ({"messages": [("user", "a\x00b")]}, "messages[0].content"),
    ({"messages": [("user\x00", "hi")]}, "messages[0].role"),
    ({"prompt": "x", "sampling": {"stop": ["a\x00"]}}, "sampling.stop[0]"),
    ({"prompt": "x", "model": "tiny\x00"}, "model"),
    ({"prompt": "x", "request_id": "r\x00"}, "request_id"),
])
async def test_nul_is_refused_in_every_string_field(fake_channel, fields, field) -> None:  # type: ignore[no-untyped-def]
    for call, req in (("Generate", request(**fields)), ("GenerateStream", stream_request(**fields))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if call == "Generate":
                await stub(fake_channel).Generate(req, metadata=AUTH, timeout=10)
            else:
                async for _ in stub(fake_channel).GenerateStream(req, metadata=AUTH, timeout=10):
                    pass
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (call, err.value.details())
        assert violations(err.value) == [field], call


@pytest.mark.parametrize(("fields", "field"), [
    ({"prompt": "a\x00b"}, "prompt"),
    ({"messages": [inference_pb2.ChatMessage(role="user", content="a\x00b")]}, "messages[0].content"),
])
async def test_nul_is_refused_by_tokenize_too(fake_channel, fields, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(fake_channel).Tokenize(inference_pb2.TokenizeRequest(**fields), metadata=AUTH, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err.value) == [field]


@pytest.mark.parametrize("payload", [b"\x0a\x02\xc3\x28", b"\x12\x03a\xffb", b"\xff\xff\xff\xff"],
                         ids=["model-not-utf8", "prompt-not-utf8", "undecodable"])
async def test_undecodable_requests_are_invalid_argument(fake_channel, payload: bytes) -> None:  # type: ignore[no-untyped-def]
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    unary = fake_channel.unary_unary("/llmesh.v1.InferenceService/Generate", **identity)
    streaming = fake_channel.unary_stream("/llmesh.v1.InferenceService/GenerateStream", **identity)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await unary(payload, metadata=AUTH, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "llmesh.v1.GenerateRequest" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in streaming(payload, metadata=AUTH, timeout=10):
            pass
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_failed_authentications_are_counted_and_audited(fake_channel, fake_mesh) -> None:  # type: ignore[no-untyped-def]
    wrong_key = "not-a-key-" + "z" * 20
    before_unknown = _metric(fake_mesh, "llmesh_gateway_auth_failures_total", surface="grpc",
                             reason="unknown_key")
    before_missing = _metric(fake_mesh, "llmesh_gateway_auth_failures_total", surface="grpc",
                             reason="missing")
    count_before = len([e for e in _audit(fake_mesh) if e["event"] == "auth_failure"])
    s = stub(fake_channel)
    for metadata, method in ((bearer(wrong_key), "Generate"), ((), "ListModels"),
                             ((("authorization", "Basic abc"),), "Tokenize")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if method == "Generate":
                await s.Generate(request(prompt="x"), metadata=metadata, timeout=10)
            elif method == "ListModels":
                await s.ListModels(inference_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
            else:
                await s.Tokenize(inference_pb2.TokenizeRequest(prompt="x"), metadata=metadata, timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    await _wait_for(lambda: len([e for e in _audit(fake_mesh) if e["event"] == "auth_failure"])
                    >= count_before + 3)
    failures = [e for e in _audit(fake_mesh) if e["event"] == "auth_failure"][count_before:]
    assert [e["reason"] for e in failures] == ["unknown_key", "missing", "malformed"]
    unknown = failures[0]
    assert unknown["key_sha256_prefix"] == hash_key(wrong_key)[:12]
    assert unknown["surface"] == "grpc" and unknown["peer"].startswith("ipv")
    raw = Path(fake_mesh.config.gateway.audit_log).read_text()
    assert wrong_key not in raw and hash_key(wrong_key) not in raw  # never the key, nor its full hash
    assert _metric(fake_mesh, "llmesh_gateway_auth_failures_total", surface="grpc",
                   reason="unknown_key") == before_unknown + 1
    assert _metric(fake_mesh, "llmesh_gateway_auth_failures_total", surface="grpc",
                   reason="missing") == before_missing + 1
    gateway_log = _proc(fake_mesh, "gateway").log_path.read_text()
    assert "authentication failed (unknown_key)" in gateway_log and wrong_key not in gateway_log


async def test_request_ids_are_scoped_per_tenant(fake_channel) -> None:  # type: ignore[no-untyped-def]
    s = stub(fake_channel)
    rid = "shared-id-1"
    long_run = {"max_tokens": 400, "ignore_eos": True}
    # Two tenants, one id, at the same time: both are served, each sees its own id.
    first = s.GenerateStream(stream_request(prompt="one", request_id=rid, sampling=long_run), metadata=AUTH)
    await first.read()  # running now
    other = await s.Generate(request(prompt="two", request_id=rid, sampling={"max_tokens": 3}),
                             metadata=OTHER_TENANT, timeout=30)
    assert other.request_id == rid and other.usage.completion_tokens == 3
    # The same tenant reusing its own running id: a clear error naming the field.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await s.Generate(request(prompt="three", request_id=rid), metadata=AUTH, timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err.value) == ["request_id"]
    assert "already in use" in (err.value.details() or "")
    first.cancel()
    # Once it ended, the id is free again, and the response carries the client's id.
    async def reuse() -> inference_pb2.GenerateResponse:
        while True:
            try:
                return await s.Generate(request(prompt="four", request_id=rid, sampling={"max_tokens": 2}),
                                        metadata=AUTH, timeout=30)
            except grpc.aio.AioRpcError as e:
                if "already in use" not in (e.details() or ""):
                    raise
                await asyncio.sleep(0.05)  # until the cancelled stream's clean-up ran

    reply = await asyncio.wait_for(reuse(), 10)
    assert reply.request_id == rid


def test_internal_ids_carry_the_tenant_scope() -> None:
    a, b = Tenant("alpha"), Tenant("beta")
    assert scoped_request_id(a, "x") != scoped_request_id(b, "x")
    assert scoped_request_id(a, "x").endswith("/x")
    assert re.fullmatch(r"t[0-9a-f]{12}/x", scoped_request_id(a, "x"))


async def test_cancelled_streams_log_no_error_in_any_tier(fake_channel, fake_mesh) -> None:  # type: ignore[no-untyped-def]
    offsets = {p.name: p.log_path.stat().st_size for p in fake_mesh.procs if p.log_path is not None}
    s = stub(fake_channel)
    ids = [f"cancel-me-{i}" for i in range(6)]
    for rid in ids:
        call = s.GenerateStream(stream_request(prompt="hello", request_id=rid,
                                               sampling={"max_tokens": 300, "ignore_eos": True}),
                                metadata=AUTH)
        await call.read()
        await call.read()
        call.cancel()
    gateway = _proc(fake_mesh, "gateway")

    def new_lines(proc) -> list[dict]:  # type: ignore[no-untyped-def, type-arg]
        with proc.log_path.open("rb") as f:
            f.seek(offsets[proc.name])
            return [json.loads(raw) for raw in f.read().decode(errors="replace").splitlines()
                    if raw.startswith("{")]

    scoped = {scoped_request_id(Tenant("demo"), rid) for rid in ids}
    await _wait_for(lambda: scoped <= {e.get("request_id") for e in new_lines(gateway)
                                       if e.get("status") == "CANCELLED"})
    for proc in fake_mesh.procs:
        if proc.log_path is None:
            continue
        errors = [e for e in new_lines(proc) if e.get("level") in ("ERROR", "CRITICAL")]
        assert not errors, (proc.name, errors[:2])


def test_core_counts_failed_authentications() -> None:
    from prometheus_client import REGISTRY

    from gateway.audit import AuditLog

    class Tiers:
        replicas = 1

    written: list[tuple[dict, str]] = []  # type: ignore[type-arg]

    class Audit(AuditLog):
        def write(self, entry, event="request"):  # type: ignore[no-untyped-def]
            written.append((entry, event))

    registry = TenantRegistry([Tenant("t", key_sha256=hashlib.sha256(b"good").hexdigest())])
    core = GatewayCore(Tiers(), Tiers(), Tiers(), tenants=registry, audit=Audit(None))  # type: ignore[arg-type]

    def count() -> float:
        return REGISTRY.get_sample_value(
            "llmesh_gateway_auth_failures_total", {"surface": "http", "reason": "unknown_key"}) or 0.0

    before = count()
    assert core.authenticate("Bearer good", peer="p", surface="http").name == "t"
    with pytest.raises(AuthenticationFailed):
        core.authenticate("Bearer bad", peer="ipv4:10.0.0.1:5", surface="http")
    assert count() == before + 1
    assert written == [({"surface": "http", "peer": "ipv4:10.0.0.1:5", "reason": "unknown_key",
                         "key_sha256_prefix": hash_key("bad")[:12]}, "auth_failure")]

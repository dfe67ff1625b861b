"""Caller identity on internal hops: the policy table, identity parsing, and every method
of every internal service over real mutual-TLS aio servers on port 0.

The servers below are built by the tiers' own ``create_server`` with a stand-in for each
tier's service in which every method answers UNIMPLEMENTED: a call the policy allows gets
UNIMPLEMENTED from the stand-in, a refused one gets PERMISSION_DENIED before it, so each
method's verdict is visible without starting engines or loading tokenizers. The whole
mesh with real servicers is in tests/gateway/test_mtls_identity.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmesh.certs import TIERS, identity_files, write_dev_certs
from llmesh.postprocess.v1 import postprocess_pb2
from llmesh.router.v1 import router_pb2
from llmesh.tokenizer.v1 import tokenizer_pb2
from llmesh.worker.v1 import worker_pb2
from services.common import authz
from services.common.authz import (
    OPERATOR_IDENTITY,
    TIER_POLICIES,
    CallerAuthorizer,
    caller_authz_interceptors,
    client_identity,
    peer_identities,
    tier_identity,
)
from services.common.errors import PermissionDenied, map_exception
from services.common.server import ServerHandle, create_server
from services.common.settings import ServerSettings, add_settings_arguments, settings_from_args

SERVICES: dict[str, pb_descriptor.ServiceDescriptor] = {
    "router": router_pb2.DESCRIPTOR.services_by_name["RouterService"],
    "worker": worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
    "tokenizer": tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"],
    "postprocessor": postprocess_pb2.DESCRIPTOR.services_by_name["PostprocessService"],
}

# The promise in the issue and the README, written out independently of authz.py:
# tier -> method -> roles allowed. Everything else is refused.
EXPECTED: dict[str, dict[str, set[str]]] = {
    "router": {"Generate": {"gateway"}, "Session": {"gateway"}, "Abort": {"gateway"},
               "ListWorkers": {"gateway", "operator"}},
    "worker": {"Generate": {"router"}, "GenerateBatch": {"router"}, "Session": {"router"},
               "Abort": {"router"}, "GetLoad": {"router", "operator"}, "WatchLoad": {"router", "operator"},
               "GetModelInfo": {"router", "operator"}},
    "tokenizer": {"Encode": {"gateway"}, "EncodeBatch": {"gateway"}, "Session": {"gateway"},
                  "ListModels": {"gateway", "router", "operator"}},
    "postprocessor": {"Process": {"gateway"}, "Session": {"gateway"}},
}


def _path(tier: str, method: str) -> str:
    return f"/{SERVICES[tier].full_name}/{method}"


# -- the policy table ----------------------------------------------------------------------


def test_policy_names_the_real_services_and_methods() -> None:
    """The table cannot drift from the protos: every service and method it names exists."""
    assert set(TIER_POLICIES) == set(SERVICES)
    for tier, policy in TIER_POLICIES.items():
        service = SERVICES[tier]
        assert policy.service == service.full_name
        assert set(policy.methods) <= set(service.methods_by_name), tier
        assert set(EXPECTED[tier]) == set(service.methods_by_name), f"{tier}: a method is not covered"


@pytest.mark.parametrize("tier", sorted(SERVICES))
def test_policy_table_matches_the_promise(tier: str) -> None:
    authorizer = CallerAuthorizer.build(tier)
    for method, allowed in EXPECTED[tier].items():
        for role in authz.ROLES:
            peer = [authz.default_identity(role)]
            if role in allowed:
                authorizer.check(_path(tier, method), peer)
            else:
                with pytest.raises(PermissionDenied):
                    authorizer.check(_path(tier, method), peer)
        for outsider in ([client_identity("llmesh-client")], [], ["spiffe://other.domain/tier/gateway"]):
            with pytest.raises(PermissionDenied, match=method):
                authorizer.check(_path(tier, method), outsider)


def test_health_and_reflection_are_open_and_other_services_closed() -> None:
    authorizer = CallerAuthorizer.build("router")
    for method in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                   "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"):
        authorizer.check(method, [])
    # A method of another tier's service is nobody's, even the router's own caller.
    with pytest.raises(PermissionDenied):
        authorizer.check(_path("worker", "Generate"), [tier_identity("gateway")])


def test_refusal_is_permission_denied_and_names_method_and_identity() -> None:
    with pytest.raises(PermissionDenied) as info:
        CallerAuthorizer.build("worker").check(_path("worker", "Abort"), [client_identity("bob")])
    mapped = map_exception(info.value)
    assert mapped.code is grpc.StatusCode.PERMISSION_DENIED
    assert "WorkerService/Abort" in mapped.message and "client/bob" in mapped.message
    with pytest.raises(PermissionDenied, match="without a URI identity"):
        CallerAuthorizer.build("worker").check(_path("worker", "Abort"), [])


def test_identities_of_the_development_ca() -> None:
    assert tier_identity("router") == "spiffe://llmesh.local/tier/router"
    assert OPERATOR_IDENTITY == "spiffe://llmesh.local/operator"
    assert client_identity("a b/c") == "spiffe://llmesh.local/client/a%20b%2Fc"
    with pytest.raises(ValueError, match="unknown role"):
        authz.default_identity("admin")


def test_configured_identities_replace_the_defaults() -> None:
    """Kubernetes: a service mesh's SPIFFE IDs stand for the roles instead."""
    gateway_sa = "spiffe://cluster.local/ns/llmesh/sa/llmesh-gateway"
    authorizer = CallerAuthorizer.build("router", {"gateway": [gateway_sa]})
    authorizer.check(_path("router", "Generate"), ["spiffe://x/other", gateway_sa])
    with pytest.raises(PermissionDenied):  # the development identity no longer counts
        authorizer.check(_path("router", "Generate"), [tier_identity("gateway")])
    authorizer.check(_path("router", "ListWorkers"), [OPERATOR_IDENTITY])  # unnamed: default
    with pytest.raises(ValueError, match="unknown role"):
        CallerAuthorizer.build("router", {"admin": ["spiffe://x"]})


def test_interceptor_only_for_internal_tiers_with_mutual_tls() -> None:
    assert len(caller_authz_interceptors("router", mutual_tls=True, enabled=True)) == 1
    assert caller_authz_interceptors("router", mutual_tls=False, enabled=True) == []
    assert caller_authz_interceptors("router", mutual_tls=True, enabled=False) == []
    assert caller_authz_interceptors("gateway", mutual_tls=True, enabled=True) == []


def test_peer_identities_from_auth_context(tmp_path: Path) -> None:
    certs = write_dev_certs(tmp_path)
    assert peer_identities({"peer_uri": [b"spiffe://llmesh.local/tier/router", b"urn:x"]}) == (
        "spiffe://llmesh.local/tier/router", "urn:x")
    # A grpc build without peer_uri: read the URI SANs from the PEM certificate.
    pem = certs["operator_cert"].read_bytes()
    assert peer_identities({"x509_pem_cert": [pem]}) == (OPERATOR_IDENTITY,)
    assert peer_identities({"x509_pem_cert": [certs["server_cert"].read_bytes()]}) == ()
    assert peer_identities({}) == ()


def test_settings_fields_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ServerSettings)
    help_text = parser.format_help()
    assert "--authorize-callers" in help_text and "--caller-identities" in help_text
    args = parser.parse_args([
        "--no-authorize-callers", "--caller-identities", '{"gateway": "spiffe://c/ns/l/sa/gw"}',
    ])
    settings = settings_from_args(ServerSettings, args)
    assert settings.authorize_callers is False
    assert settings.caller_identities == {"gateway": ["spiffe://c/ns/l/sa/gw"]}
    assert ServerSettings().authorize_callers is True and ServerSettings().caller_identities == {}
    assert not ServerSettings(tls_cert="c", tls_key="k").mutual_tls
    assert ServerSettings(tls_cert="c", tls_key="k", tls_client_ca="ca").mutual_tls


# -- real servers over mutual TLS ----------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_dev_certs(tmp_path_factory.mktemp("authz-certs"))


def _credentials(certs: dict[str, Path], identity: str) -> grpc.ChannelCredentials:
    cert, key = identity_files(certs, identity)
    return grpc.ssl_channel_credentials(
        root_certificates=certs["ca"].read_bytes(), private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )


async def _reached(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "reached the servicer")


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _stand_in(service: pb_descriptor.ServiceDescriptor) -> grpc.GenericRpcHandler:
    """Every method of ``service``, answering UNIMPLEMENTED once a call gets that far."""
    return grpc.method_handlers_generic_handler(service.full_name, {
        m.name: _HANDLERS[(m.client_streaming, m.server_streaming)](_reached) for m in service.methods
    })


async def _build(tier: str, settings: ServerSettings) -> ServerHandle:
    service = SERVICES[tier]
    handle = await create_server(
        settings, tier=tier, register=lambda s: s.add_generic_rpc_handlers((_stand_in(service),)),
        service_names=[service.full_name], tracing=False,
    )
    await handle.server.start()
    await handle.set_live(True)
    await handle.set_ready(True)
    return handle


async def _start(tier: str, certs: dict[str, Path], **extra: Any) -> ServerHandle:
    cert, key = identity_files(certs, tier)
    return await _build(tier, ServerSettings(
        tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(certs["ca"]), **extra,
    ))


@pytest.fixture
async def servers(certs: dict[str, Path]) -> AsyncIterator[dict[str, ServerHandle]]:
    handles = {tier: await _start(tier, certs) for tier in SERVICES}
    yield handles
    for handle in handles.values():
        await handle.server.stop(0)


async def _call(channel: grpc.aio.Channel, path: str, method: pb_descriptor.MethodDescriptor
                ) -> grpc.StatusCode:
    """Call ``path`` (one empty request message; none on a client stream, so the client's
    write cannot race the server's refusal); the status it ends with."""
    kwargs: dict[str, Any] = {"request_serializer": lambda m: m, "response_deserializer": lambda b: b}
    try:
        if method.client_streaming:
            requests: Any = iter([])
            if method.server_streaming:
                async for _ in channel.stream_stream(path, **kwargs)(requests, timeout=10):
                    pass
            else:
                await channel.stream_unary(path, **kwargs)(requests, timeout=10)
        elif method.server_streaming:
            async for _ in channel.unary_stream(path, **kwargs)(b"", timeout=10):
                pass
        else:
            await channel.unary_unary(path, **kwargs)(b"", timeout=10)
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def _verdicts(handle: ServerHandle, tier: str, credentials: grpc.ChannelCredentials
                    ) -> dict[str, grpc.StatusCode]:
    service = SERVICES[tier]
    async with grpc.aio.secure_channel(f"localhost:{handle.port}", credentials) as channel:
        return {m.name: await _call(channel, _path(tier, m.name), m) for m in service.methods}


CALLERS = ["client", "operator", *TIERS]  # server.pem cannot dial at all (serverAuth only)


@pytest.mark.parametrize("caller", CALLERS)
async def test_every_method_of_every_internal_tier_over_mtls(
    servers: dict[str, ServerHandle], certs: dict[str, Path], caller: str
) -> None:
    """PERMISSION_DENIED for every method the caller's identity is not allowed; the
    allowed ones reach the servicer (UNIMPLEMENTED from the stand-in)."""
    credentials = _credentials(certs, caller)
    for tier, handle in servers.items():
        got = await _verdicts(handle, tier, credentials)
        want = {
            method: grpc.StatusCode.UNIMPLEMENTED if caller in allowed
            else grpc.StatusCode.PERMISSION_DENIED
            for method, allowed in EXPECTED[tier].items()
        }
        assert got == want, f"{caller} -> {tier}"


async def test_health_and_reflection_stay_open_to_any_mesh_certificate(
    servers: dict[str, ServerHandle], certs: dict[str, Path]
) -> None:
    credentials = _credentials(certs, "client")
    for tier, handle in servers.items():
        service = SERVICES[tier].full_name
        async with grpc.aio.secure_channel(f"localhost:{handle.port}", credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
            first = await asyncio.wait_for(watch.read(), 5)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()

            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = reflect.ServerReflectionInfo(timeout=5)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            answer = await call.read()
            await call.done_writing()
            names = {s.name for s in answer.list_services_response.service}
            assert service in names, tier


async def test_identity_check_can_be_turned_off_and_needs_mutual_tls(certs: dict[str, Path]) -> None:
    off = await _start("router", certs, authorize_callers=False)
    try:
        got = await _verdicts(off, "router", _credentials(certs, "client"))
        assert set(got.values()) == {grpc.StatusCode.UNIMPLEMENTED}
    finally:
        await off.server.stop(0)
    # Server-only TLS: no client certificate, so no identity to check and no interceptor.
    cert, key = identity_files(certs, "router")
    handle = await _build("router", ServerSettings(tls_cert=str(cert), tls_key=str(key)))
    try:
        no_cert = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
        got = await _verdicts(handle, "router", no_cert)
        assert set(got.values()) == {grpc.StatusCode.UNIMPLEMENTED}
    finally:
        await handle.server.stop(0)


async def test_kubernetes_style_identities_configured_on_the_server(
    certs: dict[str, Path], tmp_path: Path
) -> None:
    """caller_identities maps a role to another identity; the development one then fails."""
    handle = await _start("worker", certs, caller_identities={"router": OPERATOR_IDENTITY})
    try:
        as_operator = await _verdicts(handle, "worker", _credentials(certs, "operator"))
        assert set(as_operator.values()) == {grpc.StatusCode.UNIMPLEMENTED}
        as_router = await _verdicts(handle, "worker", _credentials(certs, "router"))
        assert set(as_router.values()) == {grpc.StatusCode.PERMISSION_DENIED}
    finally:
        await handle.server.stop(0)

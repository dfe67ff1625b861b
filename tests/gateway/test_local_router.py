"""router_transport local: the gateway runs the router in its own process and event loop.

With the tokenizer and postprocessor local too (deploy/local/edge.yaml), an engine step
wakes the worker and the gateway only. The router is the router tier's own server,
reached on a loopback port: these tests check that it routes, fails over and stops as a
router process does, and that `llmesh up` starts no router for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway import cli as gateway_cli
from gateway.settings import GatewaySettings, local_router_settings
from llmesh.meshconfig import MeshConfig, RouterConfig, WorkerConfig, load_mesh_config
from llmesh.procs import TierProcess, free_port, spawn_tier
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from services.router.server import start_in_process, stop_in_process
from services.router.settings import RouterSettings
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import (
    collect_stream,
    gateway_in_process,
    same_streams,
    stream_and_kill,
    stream_request,
    stub,
)

MODEL = "tiny"
MAX_TOKENS = 48
ZONES = ["zone-a", "zone-b"]


@pytest.fixture(scope="module")
def edge_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """`llmesh up` with all three tiers local, two fake workers in two zones."""
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        served_model_name=MODEL,
        gateway={"port": free_port(), "http_port": -1,
                 "settings": {"drain_seconds": 0, "tokenizer_transport": "local",
                              "postprocessor_transport": "local", "router_transport": "local"}},
        router=RouterConfig(zones=ZONES, settings={"batch_max_wait_ms": 2}),
        workers=[WorkerConfig(zone=zone, engine="fake", settings={"fake_token_delay_ms": 10})
                 for zone in ZONES],
    )
    with running_mesh(config, tmp_path_factory.mktemp("local-router-mesh")) as mesh:
        yield mesh


def _workers(mesh: Mesh) -> list[dict[str, Any]]:
    """The mesh's workers as a router's ``workers`` setting."""
    return [{"address": p.address, "zone": p.zone, "models": [MODEL], "worker_id": f"{p.name}-{p.zone}"}
            for p in mesh.procs if p.tier == "worker"]


@pytest.fixture(scope="module")
async def reference_gateway(edge_mesh: Mesh, tiny_deepseek_dir: Path) -> AsyncIterator[str]:
    """The same workers through a router server of its own (the router tier's layout):
    the reference. Its gateway encodes and postprocesses in process as the mesh's does."""
    models = [f"{MODEL}={tiny_deepseek_dir}"]
    router = await start_in_process(
        RouterSettings.model_validate({"port": 0, "workers": _workers(edge_mesh), "zones": ZONES,
                                       "tokenizer_models": models}),
        wait_ready=10.0,
    )
    try:
        settings = GatewaySettings(
            port=0, http_port=-1, drain_seconds=0, tokenizer_transport="local",
            postprocessor_transport="local", local_models=models,
            router_targets=[f"127.0.0.1:{router.handle.port}"],
        )
        async with gateway_in_process(settings) as address:
            yield address
    finally:
        await stop_in_process(router)


def _request(prompt: str, **sampling: Any) -> inference_pb2.GenerateStreamRequest:
    return stream_request(prompt=prompt, sampling={"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                   "ignore_eos": True, **sampling})


def _metrics(mesh: Mesh) -> str:
    """The gateway's /metrics (the in-process router's metrics are among them)."""
    gateway = next(p for p in mesh.procs if p.tier == "gateway")
    url = f"http://127.0.0.1:{gateway.metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=5).read().decode()


async def test_the_edge_mesh_runs_no_router_process_and_gives_a_routers_text(edge_mesh, reference_gateway):
    assert sorted({p.tier for p in edge_mesh.procs}) == ["gateway", "worker"]
    prompts = [f"prompt {i} on {'zones ' * (i % 4)}" for i in range(10)]
    got = await same_streams(reference_gateway, gateway_address(edge_mesh), prompts, _request)
    assert sum(f.finish_reason == inference_pb2.FINISH_REASON_STOP for _, f in got[len(prompts):]) >= 8
    # The zone ladder's first zone serves while it is healthy, as a router process's
    # would; the in-process router's own metrics are on the gateway's /metrics.
    assert {f.served_by.zone for _, f in got} == {ZONES[0]}
    text = _metrics(edge_mesh)
    assert re.search(r"^llmesh_router_worker_healthy\{.*\} 1\.0$", text, re.M)
    assert "llmesh_rpc_requests_total" in text


async def test_a_worker_killed_mid_stream_resumes_on_the_other_through_the_in_process_router(
        edge_mesh, reference_gateway):
    request = _request("the worker goes away", max_tokens=120)
    async with grpc.aio.insecure_channel(reference_gateway) as channel:
        want, _, _ = await collect_stream(stub(channel), request)
    workers = {p.address: p for p in edge_mesh.procs if p.tier == "worker"}

    def carrier() -> TierProcess:
        # The in-process router's in-flight gauge names the worker carrying the stream.
        text = _metrics(edge_mesh)
        busy = [p for p in workers.values()
                if re.search(rf'^llmesh_router_worker_in_flight\{{[^}}]*worker="{re.escape(p.name)}-[^"]*"'
                             rf'[^}}]*\}} [1-9]', text, re.M)]
        assert len(busy) == 1, f"one worker should carry the stream: {text}"
        return busy[0]

    async with grpc.aio.insecure_channel(gateway_address(edge_mesh)) as channel:
        text, final, victim = await stream_and_kill(channel, request, carrier)
    victim.popen.wait(10)
    assert text == want
    assert final.usage.completion_tokens == 120
    assert final.served_by.resumed >= 1
    assert final.served_by.worker_id != f"{victim.name}-{victim.zone}"


def test_a_bad_local_router_fails_the_gateway_at_start_naming_the_field(capsys):
    cases = (("{}", "local_router.workers"),
             ('{"workers": [{"address": "127.0.0.1:1"}], "wrkers": []}', "local_router.wrkers"),
             ('{"workers": [{"address": 7}]}', "local_router.workers.0.address"))
    for local_router, field in cases:
        code = gateway_cli.main(["--router-transport", "local", "--local-router", local_router])
        assert code == 2
        assert field in capsys.readouterr().err


def test_the_in_process_router_listens_on_loopback_in_plaintext_without_a_drain():
    settings = GatewaySettings(router_transport="local", local_router={
        "workers": [{"address": "10.0.0.1:50081", "zone": "z"}], "port": 50071, "tls_cert": "x.pem",
        "metrics_port": 9100, "drain_seconds": 5, "batch_max_wait_ms": 3, "latency_slice_us": 100})
    router = local_router_settings(settings)
    assert (router.host, router.port, router.metrics_port, router.tls_cert, router.drain_seconds) == (
        "127.0.0.1", 0, -1, "", 0.0)
    assert router.latency_slice_us == 0 and router.latency_nice == 0  # the process's are the gateway's
    assert router.batch_max_wait_ms == 3  # the rest is the router's own
    # TLS to the workers: the gateway's, unless the router's own is named.
    secure = {"downstream_tls_ca": "ca.pem", "downstream_tls_cert": "gw.pem",
              "downstream_tls_key": "gw-key.pem"}
    workers = [{"address": "10.0.0.1:50081"}]
    inherited = local_router_settings(
        GatewaySettings(router_transport="local", local_router={"workers": workers}, **secure))
    assert (inherited.downstream_tls_ca, inherited.downstream_tls_cert) == ("ca.pem", "gw.pem")
    own = local_router_settings(GatewaySettings(router_transport="local", **secure, local_router={
        "workers": workers, "downstream_tls_cert": "router.pem", "downstream_tls_key": "router-key.pem"}))
    assert (own.downstream_tls_ca, own.downstream_tls_cert, own.downstream_tls_key) == (
        "ca.pem", "router.pem", "router-key.pem")


def test_the_edge_example_config_runs_everything_in_the_gateway():
    config = load_mesh_config(Path(__file__).resolve().parents[2] / "deploy" / "local" / "edge.yaml")
    # `llmesh up` adds the router's settings (local_router) from the mesh's workers.
    settings = GatewaySettings(**config.gateway.settings,
                               local_router={"workers": [{"address": "127.0.0.1:1"}]})
    assert (settings.tokenizer_transport, settings.postprocessor_transport, settings.router_transport) == (
        "local", "local", "local")


async def test_sigterm_finishes_a_stream_before_the_in_process_router_stops(edge_mesh, tmp_path):
    """A gateway process of its own on the mesh's workers: SIGTERM mid-stream; the
    stream still ends with every token (the router outlives the gateway's grace), and
    the process exits 0."""
    port = free_port()
    args = ["--port", str(port), "--http-port", "-1", "--drain-seconds", "0", "--grace-seconds", "10",
            "--router-transport", "local", "--local-router", json.dumps({"workers": _workers(edge_mesh),
                                                                         "zones": ZONES}),
            "--tokenizer-transport", "local", "--postprocessor-transport", "local",
            "--local-models", json.dumps([f"{MODEL}={edge_mesh.model_dir}"])]
    proc = spawn_tier("gateway-sigterm", "gateway", args, address=f"127.0.0.1:{port}",
                      service="llmesh.v1.InferenceService", log_dir=tmp_path)
    try:
        await asyncio.to_thread(proc.wait_serving, 60)
        parts: list[str] = []
        final = None
        async with grpc.aio.insecure_channel(proc.address) as channel:
            async for item in stub(channel).GenerateStream(_request("drain me", max_tokens=80), timeout=60):
                if item.HasField("delta"):
                    parts.append(item.delta.text)
                    if len(parts) == 3:
                        os.kill(proc.pid, signal.SIGTERM)
                else:
                    final = item.final
        assert final is not None and final.usage.completion_tokens == 80
        assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert await asyncio.to_thread(proc.popen.wait, 30) == 0
        log = (tmp_path / "gateway-sigterm.log").read_text()
        assert log.index("gateway stopping") < log.index("router stopping")
    finally:
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(10)


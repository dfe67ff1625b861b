"""``--mesh-config``: every tier takes its part of llmesh.yaml (the schema `llmesh up` reads),
flags and environment variables override it, and a worker picks its entry by zone and
device. One test starts a real tier process from an overlay's rendered ConfigMap."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from deploy.tools import kustomize
from gateway.settings import GatewaySettings
from llmesh.procs import free_port, spawn_tier
from services.common.settings import add_settings_arguments, settings_from_args
from services.postprocessor.settings import PostprocessorSettings
from services.router.settings import RouterSettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings
from tests.deploy.conftest import by_kind

MESH = {
    "model": "/models/chat",
    "served_model_name": "chat",
    "gateway": {"host": "0.0.0.0", "port": 50051, "http_port": -1, "default_filter_mode": "redact"},
    "tokenizer": {"address": "dns:///tok:50061", "settings": {"encode_threads": 3}},
    "postprocessor": {"address": "dns:///post:50062"},
    "router": {"address": "dns:///router:50071", "zones": ["zone-a", "kunpeng"],
               "degraded_zones": ["kunpeng"], "settings": {"max_queue": 7}},
    "workers": [
        {"zone": "zone-a", "device": "cuda", "address": "w-a:50081",
         "settings": {"tensor_parallel_size": 2}, "engine_args": {"max_logprobs": 50}},
        {"zone": "kunpeng", "device": "cpu", "address": "w-k:50081",
         "settings": {"cpu_kvcache_space_gb": 4}},
    ],
}


def build(cls: Any, argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, cls)
    return settings_from_args(cls, parser.parse_args(argv))


@pytest.fixture
def mesh_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key in list(os.environ):
        if key.startswith("LLMESH_") and key != "LLMESH_HOME":
            monkeypatch.delenv(key)
    path = tmp_path / "llmesh.yaml"
    path.write_text(yaml.safe_dump(MESH))
    return path


def test_each_tier_takes_its_part(mesh_file: Path) -> None:
    flag = f"--mesh-config={mesh_file}"
    gw = build(GatewaySettings, [flag])
    assert (gw.host, gw.port, gw.http_port, gw.default_filter_mode, gw.default_model) == (
        "0.0.0.0", 50051, -1, "redact", "chat")
    assert (gw.tokenizer_targets, gw.router_targets, gw.postprocessor_targets) == (
        ["dns:///tok:50061"], ["dns:///router:50071"], ["dns:///post:50062"])
    # What its in-process postprocessor would load (postprocessor_transport local).
    assert list(gw.local_models) == ["chat=/models/chat"]
    tok = build(TokenizerSettings, [flag])
    assert list(tok.models) == ["chat=/models/chat"] and tok.encode_threads == 3
    assert list(build(PostprocessorSettings, [flag]).models) == ["chat=/models/chat"]
    router = build(RouterSettings, [flag])
    assert list(router.zones) == ["zone-a", "kunpeng"] and router.max_queue == 7
    assert router.tokenizer_target == "dns:///tok:50061" and router.default_model == "chat"
    assert [(t.name, t.zone, t.device) for t in router.dns_targets] == [
        ("w-a:50081", "zone-a", "cuda"), ("w-k:50081", "kunpeng", "cpu")]
    worker = build(WorkerSettings, [flag, "--zone=zone-a", "--device=cuda"])
    assert (worker.model, worker.served_model_name) == ("/models/chat", "chat")
    assert worker.tensor_parallel_size == 2
    assert worker.engine_args == {"max_logprobs": 50}
    cpu = build(WorkerSettings, [flag, "--zone=kunpeng"])
    assert (cpu.device, cpu.cpu_kvcache_space_gb, cpu.tensor_parallel_size) == ("cpu", 4, 1)


def test_a_gateway_running_the_router_takes_the_routers_part(mesh_file: Path) -> None:
    """router_transport local in the gateway's settings: the in-process router gets what
    a router of this mesh would (and the model's tokenizer files when it encodes too)."""
    mesh = {**MESH, "gateway": {**MESH["gateway"], "settings": {
        "router_transport": "local", "tokenizer_transport": "local"}}}
    mesh_file.write_text(yaml.safe_dump(mesh))
    gw = build(GatewaySettings, [f"--mesh-config={mesh_file}"])
    router = build(RouterSettings, [f"--mesh-config={mesh_file}"])
    assert gw.router_transport == "local"
    assert gw.local_router["zones"] == list(router.zones)
    assert [(t["name"], t["zone"]) for t in gw.local_router["dns_targets"]] == [
        (t.name, t.zone) for t in router.dns_targets]
    assert gw.local_router["max_queue"] == router.max_queue == 7
    assert gw.local_router["tokenizer_models"] == ["chat=/models/chat"]


def test_flags_override_environment_overrides_mesh_config(
    mesh_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMESH_ROUTER_MESH_CONFIG", str(mesh_file))  # the env var form
    monkeypatch.setenv("LLMESH_ROUTER_MAX_QUEUE", "9")
    router = build(RouterSettings, ["--zones=kunpeng"])
    assert list(router.zones) == ["kunpeng"]  # flag over the file
    assert router.max_queue == 9  # environment over the file
    assert list(router.degraded_zones) == ["kunpeng"]  # the file over the default


def test_worker_entry_is_chosen_by_zone_and_device(mesh_file: Path) -> None:
    flag = f"--mesh-config={mesh_file}"
    with pytest.raises(ValueError, match="no workers: entry for zone=zone-b device=npu"):
        build(WorkerSettings, [flag, "--zone=zone-b", "--device=npu"])
    with pytest.raises(ValueError, match="2 workers: entries"):
        build(WorkerSettings, [flag])
    mesh_file.write_text(yaml.safe_dump({**MESH, "workers": [{"zonee": "a"}]}))
    with pytest.raises(ValueError, match=r"(?s)mesh config .*zonee"):
        build(WorkerSettings, [flag])
    with pytest.raises(ValueError, match=r"mesh config /nonexistent\.yaml"):
        build(RouterSettings, ["--mesh-config=/nonexistent.yaml"])


def test_a_tier_process_serves_what_the_overlay_configmap_says(tmp_path: Path) -> None:
    """The dev overlay's rendered ConfigMap, with its served model name changed and its
    model pointed at the prepared local model, run by `llmesh tokenizer` with the
    Deployment's own arguments: ListModels answers with the ConfigMap's name."""
    from llmesh.models import DEFAULT_MODEL, model_path
    from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

    local_model = model_path(DEFAULT_MODEL)
    if not (local_model / "config.json").is_file():
        pytest.skip("the default model is not prepared (llmesh model prepare)")
    objects = kustomize.build(kustomize.K8S / "overlays" / "dev")
    (config,) = [c for c in by_kind(objects, "ConfigMap")
                 if c["metadata"]["name"].startswith("llmesh-config")]
    mesh = yaml.safe_load(config["data"]["llmesh.yaml"])
    mesh.update(model=str(local_model), served_model_name="bank-assistant")
    (tmp_path / "llmesh.yaml").write_text(yaml.safe_dump(mesh))
    (dep,) = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == "llmesh-tokenizer"]
    mount = "/etc/llmesh/config/"
    container = dep["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace(mount, f"{tmp_path}/") for a in container["args"]]
    port = free_port()
    # The pod's ports are the cluster's; here the explicit flags after them win.
    args += ["--host=127.0.0.1", f"--port={port}", "--metrics-port=-1"]
    proc = spawn_tier("tokenizer", "tokenizer", args, address=f"127.0.0.1:{port}",
                      service="llmesh.tokenizer.v1.TokenizerService", log_dir=tmp_path)
    try:
        proc.wait_serving(timeout=120)
        with grpc.insecure_channel(proc.address) as channel:
            reply = tokenizer_pb2_grpc.TokenizerServiceStub(channel).ListModels(
                tokenizer_pb2.ListModelsRequest(), timeout=10
            )
        assert [m.model for m in reply.models] == ["bank-assistant"]
    finally:
        proc.stop()

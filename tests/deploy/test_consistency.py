"""deploy/ against the code: the consistency check passes on the real manifests and
Dockerfiles, and catches each kind of mistake it exists for (the mesh config itself is
written once and read by every tier, so no copies are compared)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.tools import consistency, kustomize
from tests.deploy.conftest import named

PROD = "deploy/k8s/overlays/prod"


def tier_code_missing() -> list[str]:
    return [tier for tier in consistency.TIERS if consistency.settings_class(tier) is None]


@pytest.fixture(scope="module")
def prod() -> list[dict[str, Any]]:
    missing = tier_code_missing()
    if missing:
        pytest.skip(f"tier settings modules not written yet: {missing}")
    return kustomize.build(consistency.REPO / PROD)


def container(objects: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    return named(objects, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def problems(objects: list[dict[str, Any]]) -> list[str]:
    return consistency.check_objects(objects, "test").problems


def test_everything_in_deploy_is_consistent_with_the_code() -> None:
    report = consistency.check_all()
    assert report.problems == []
    if report.unchecked:
        pytest.skip(f"tier code missing, flags of {sorted(report.unchecked)} unchecked")


def test_cli_reports_zero_problems(capsys: pytest.CaptureFixture[str]) -> None:
    if tier_code_missing():
        pytest.skip("tier code missing")
    assert consistency.main([]) == 0
    assert capsys.readouterr().out.strip().endswith("0 problem(s)")


def test_every_tier_is_a_cli_command_with_a_real_service() -> None:
    from llmesh.cli import COMMANDS

    for tier in consistency.TIERS:
        assert tier in COMMANDS
        assert consistency.readiness_service(tier).startswith("llmesh.")


def test_unknown_flag_is_caught(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    container(objects, "llmesh-worker-zone-a")["args"].append("--tensor-paralel-size=2")
    assert any("unrecognized arguments: --tensor-paralel-size=2" in p for p in problems(objects))


def mesh_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The llmesh.yaml of the ConfigMap every pod mounts (write it back with edit_mesh)."""
    return dict(yaml.safe_load(config_map(objects)["data"]["llmesh.yaml"]))


def config_map(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = [o for o in objects
             if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("llmesh-config")]
    return cm


def edit_mesh(objects: list[dict[str, Any]], mesh: dict[str, Any]) -> None:
    config_map(objects)["data"]["llmesh.yaml"] = yaml.safe_dump(mesh)


def test_bad_mesh_config_is_caught(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    mesh = mesh_config(objects)
    mesh["workers"][0]["zonee"] = "zone-a"
    edit_mesh(objects, mesh)
    found = problems(objects)
    assert any("invalid settings for router" in p and "zonee" in p for p in found)
    objects = copy.deepcopy(prod)
    mesh = mesh_config(objects)
    mesh["router"]["settings"] = {"max_queue": -1}
    edit_mesh(objects, mesh)
    assert any("invalid settings for router" in p and "max_queue" in p for p in problems(objects))


def test_mesh_config_must_be_mounted_where_the_flag_says(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    args = container(objects, "llmesh-router")["args"]
    args[args.index("--mesh-config=/etc/llmesh/config/llmesh.yaml")] = "--mesh-config=/etc/llmesh/mesh.yaml"
    mounts = container(objects, "llmesh-tokenizer")["volumeMounts"]
    mounts[:] = [m for m in mounts if m["name"] != "config"]
    found = problems(objects)
    assert any("llmesh-router container router: /etc/llmesh/mesh.yaml is not under any volumeMount" in p
               for p in found)
    assert any("llmesh-tokenizer container tokenizer: /etc/llmesh/config/llmesh.yaml is not under" in p
               for p in found)


def test_unknown_or_misprefixed_env_var_is_caught(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    container(objects, "llmesh-tokenizer")["env"].append({"name": "LLMESH_GATEWAY_PORT", "value": "1"})
    container(objects, "llmesh-gateway")["env"].append({"name": "LLMESH_GATEWAY_TENANT_FILE", "value": "x"})
    found = problems(objects)
    assert any("LLMESH_GATEWAY_PORT is not a field of TokenizerSettings" in p for p in found)
    assert any("LLMESH_GATEWAY_TENANT_FILE is not a field of GatewaySettings" in p for p in found)


def test_probe_service_and_port_are_checked(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    dev = kustomize.build(consistency.REPO / "deploy/k8s/overlays/dev")
    c = container(dev, "llmesh-postprocessor")
    c["readinessProbe"]["grpc"]["service"] = "llmesh.postprocessor.v1.PostprocessService"
    c["livenessProbe"]["grpc"]["port"] = 50061
    found = problems(dev)
    assert any("expected 'llmesh.postprocess.v1.PostprocessService'" in p for p in found)
    assert any("livenessProbe port 50061 is not the gRPC port 50062" in p for p in found)
    container(objects, "llmesh-gateway")["livenessProbe"] = {"grpc": {"port": 50051, "service": ""}}
    assert any("kubelet probes cannot speak TLS" in p for p in problems(objects))


def test_ports_and_bind_address_are_checked(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    args = container(objects, "llmesh-tokenizer")["args"]
    args[args.index("--host=0.0.0.0")] = "--host=127.0.0.1"
    args[args.index("--metrics-port=9090")] = "--metrics-port=9091"
    found = problems(objects)
    assert any("--host=127.0.0.1 is not reachable" in p for p in found)
    assert any("--metrics-port=9091" in p for p in found)


def test_worker_pools_and_the_mesh_config_must_match(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    mesh = mesh_config(objects)
    mesh["workers"] = [w for w in mesh["workers"] if w["zone"] != "zone-b"]
    edit_mesh(objects, mesh)
    # A pool whose worker entry is gone cannot start (and no router would reach it).
    assert any("llmesh-worker-zone-b container worker" in p and "no workers: entry for zone=zone-b" in p
               for p in problems(objects))
    objects = copy.deepcopy(prod)
    mesh = mesh_config(objects)
    mesh["router"]["zones"] = ["zone-a", "kunpeng"]
    next(w for w in mesh["workers"] if w["zone"] == "zone-a")["address"] = "llmesh-worker-zone-a:50091"
    edit_mesh(objects, mesh)
    named(objects, "Deployment", "llmesh-router")["spec"]["replicas"] = 3
    found = problems(objects)
    assert any("worker zone zone-b is not on the router's ladder" in p for p in found)
    assert any("llmesh-worker-zone-a:50091: Service has no port 50091" in p for p in found)
    assert any("Deployment/llmesh-router sets spec.replicas although HPA" in p for p in found)


def test_worker_address_must_be_a_headless_service_of_that_zone(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    named(objects, "Service", "llmesh-worker-zone-a")["spec"]["clusterIP"] = "10.0.0.1"
    assert any("llmesh-worker-zone-a:50081 is not a headless Service" in p for p in problems(objects))
    objects = copy.deepcopy(prod)
    selector = named(objects, "Service", "llmesh-worker-zone-b")["spec"]["selector"]
    selector.update({"llmesh.io/zone": "zone-a", "llmesh.io/device": "cuda"})
    found = problems(objects)
    assert any("is zone=zone-b device=npu, its pods run zone-a/cuda" in p for p in found)
    assert any("llmesh-worker-zone-b container worker: no workers: address" in p for p in found)


def test_wiring_between_objects_is_checked(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    named(objects, "HorizontalPodAutoscaler", "llmesh-gateway")["spec"]["scaleTargetRef"]["name"] = "gw"
    named(objects, "Service", "llmesh-router")["spec"]["ports"][0]["targetPort"] = "grcp"
    volumes = named(objects, "Deployment", "llmesh-tokenizer")["spec"]["template"]["spec"]["volumes"]
    next(v for v in volumes if v["name"] == "models")["persistentVolumeClaim"]["claimName"] = "models"
    found = problems(objects)
    assert any("refers to PersistentVolumeClaim/models, which is not in the manifests" in p for p in found)
    assert any("scales missing Deployment/gw" in p for p in found)
    assert any("targetPort 'grcp' not exposed" in p for p in found)


def test_command_must_run_a_known_tier(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    container(objects, "llmesh-router")["command"] = ["llmesh", "routr"]
    container(objects, "llmesh-gateway")["command"] = ["python", "-m", "gateway"]
    found = problems(objects)
    assert any("`llmesh routr` is not a command" in p for p in found)
    assert any("does not run `llmesh <tier>`" in p for p in found)


def test_dockerfile_drift_is_caught(tmp_path: Path) -> None:
    if tier_code_missing():
        pytest.skip("tier code missing")
    good = tmp_path / "good.Dockerfile"
    good.write_text(
        'FROM python:3.11.13-slim\nENV LLMESH_HOME=/h LLMESH_WORKER_ZONE=z\nENTRYPOINT ["llmesh", "worker"]\n'
    )
    assert consistency.check_dockerfile(good).problems == []
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text(
        "FROM python:3.11.13-slim\nENV LLMESH_WORKER_ZONEZ=z\n"
        'ENV LLMESH_ROUTER_ZONES kunpeng\nENTRYPOINT ["llmesh"]\nCMD ["wrker"]\n'
    )
    found = consistency.check_dockerfile(bad).problems
    assert any("`llmesh wrker` is not a command" in p for p in found)
    assert any("ENV LLMESH_WORKER_ZONEZ" in p for p in found)
    assert not any("LLMESH_ROUTER_ZONES" in p for p in found)  # a real field (legacy ENV form)


def test_worker_device_and_engine_choices_are_checked(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    args = container(objects, "llmesh-worker-zone-b")["args"]
    args[args.index("--device=npu")] = "--device=ascend"
    mesh = mesh_config(objects)
    next(w for w in mesh["workers"] if w["zone"] == "zone-b")["device"] = "ascend"
    edit_mesh(objects, mesh)
    container(objects, "llmesh-worker-kunpeng")["args"].append("--engine=fake")
    found = problems(objects)
    assert any("--device=ascend is not one of auto, cpu, cuda, npu" in p for p in found)
    assert any("--engine=fake is a test engine" in p for p in found)


def test_session_tiers_are_found_from_the_protos() -> None:
    assert {t for t in consistency.TIERS if consistency.serves_session(t)} == {
        "postprocessor", "router", "worker", "tokenizer"}


def replace_arg(objects: list[dict[str, Any]], deployment: str, old: str, new: str | None) -> None:
    args = container(objects, deployment)["args"]
    index = args.index(old)
    if new is None:
        del args[index]
    else:
        args[index] = new


def test_session_port_must_be_fixed_and_declared(prod: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(prod)
    replace_arg(objects, "llmesh-router", "--session-port=50072", "--session-port=0")
    replace_arg(objects, "llmesh-worker-zone-a", "--session-port=50082", None)  # default: a free port
    replace_arg(objects, "llmesh-worker-zone-b", "--session-port=50082", "--session-port=-1")
    ports = container(objects, "llmesh-postprocessor")["ports"]
    next(p for p in ports if p["name"] == "session")["containerPort"] = 50064
    container(objects, "llmesh-gateway")["ports"].append(
        {"name": "session", "containerPort": 50060, "protocol": "TCP"})
    replace_arg(objects, "llmesh-worker-kunpeng", "--session-port=50082", "--session-port=9090")
    found = problems(objects)
    assert any("llmesh-router container router: --session-port=0 picks a free port" in p for p in found)
    assert any("llmesh-router container router: containerPort session=50072 but --session-port=0" in p
               for p in found)
    assert any("llmesh-worker-zone-a container worker: --session-port=0 picks a free port" in p
               for p in found)
    assert any("llmesh-worker-zone-b container worker: --session-port=-1 serves Session over gRPC only" in p
               for p in found)
    assert any("llmesh-postprocessor container postprocessor: containerPort session=50064 but "
               "--session-port=50063" in p for p in found)
    assert any("llmesh-gateway container gateway: containerPort session but `llmesh gateway` "
               "serves no Session" in p for p in found)
    assert any("llmesh-worker-kunpeng container worker: --session-port=9090 is also --metrics-port" in p
               for p in found)


def test_session_port_must_be_where_the_grpc_port_is(prod: list[dict[str, Any]]) -> None:
    """Every Service with a Session tier's gRPC port has its session port (same number as
    the process reports), and every policy rule admitting one admits the other."""
    objects = copy.deepcopy(prod)
    router_svc = named(objects, "Service", "llmesh-router")["spec"]
    router_svc["ports"] = [p for p in router_svc["ports"] if p["name"] != "session"]
    post_svc = named(objects, "Service", "llmesh-postprocessor")["spec"]
    next(p for p in post_svc["ports"] if p["name"] == "session")["port"] = 60063
    workers = named(objects, "NetworkPolicy", "llmesh-workers-from-router")["spec"]["ingress"][0]
    workers["ports"] = [p for p in workers["ports"] if p["port"] != 50082]
    tiers = named(objects, "NetworkPolicy", "llmesh-tiers-from-gateway")["spec"]["ingress"][0]
    tiers["ports"] = [p for p in tiers["ports"] if p["port"] not in (50071, 50065)]
    found = problems(objects)
    assert any("Service/llmesh-router exposes the gRPC port of router but not its session port 50072" in p
               for p in found)
    assert any("Service/llmesh-postprocessor: session port [60063] is not 50063" in p for p in found)
    for pool in ("zone-a", "zone-b", "kunpeng"):
        assert any(f"NetworkPolicy/llmesh-workers-from-router ingress[0] lets peers reach the gRPC port "
                   f"50081 of llmesh-worker-{pool} but not its session port 50082" in p for p in found)
    assert any("NetworkPolicy/llmesh-tiers-from-gateway ingress[0] lets peers reach the session port "
               "50072 of llmesh-router but not its gRPC port 50071" in p for p in found)
    assert not any("llmesh-postprocessor but not" in p for p in found)
    # The gateway calls the tokenizer's Session; the router only its ListModels, so the
    # router's rule (gRPC port alone) is right and the gateway's must have both.
    assert any("NetworkPolicy/llmesh-tiers-from-gateway ingress[0] lets peers reach the gRPC port "
               "50061 of llmesh-tokenizer but not its session port 50065" in p for p in found)
    assert not any("llmesh-tokenizer-from-router" in p for p in found)
    # Named ports and port ranges count as the numbers they stand for.
    objects = copy.deepcopy(prod)
    workers = named(objects, "NetworkPolicy", "llmesh-workers-from-router")["spec"]["ingress"][0]
    workers["ports"] = [{"port": "grpc", "protocol": "TCP"},
                        {"port": 50082, "endPort": 50090, "protocol": "TCP"}]
    assert problems(objects) == []

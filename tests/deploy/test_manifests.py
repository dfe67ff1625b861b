"""Kubernetes manifests: rendered by the real kustomize and strictly schema-valid, one
mesh config read by every tier, and saying what the deployment promises (rollouts,
disruption budgets, autoscaling, accelerators, non-root pods, and a network that lets
through exactly the calls the tiers make)."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.tools import consistency, kustomize, validate
from tests.deploy.conftest import (
    K8S,
    built_settings,
    by_kind,
    ingress_allowed,
    kustomization_dirs,
    named,
    overlay_dirs,
    rel,
    selector_matches,
)

KUSTOMIZATIONS = [rel(d) for d in kustomization_dirs()]
OVERLAYS = [rel(d) for d in overlay_dirs()]
CPU_TIERS = ("gateway", "tokenizer", "postprocessor", "router")
# The framed Session listener of each tier that serves Session, next to its gRPC port
# (tokenizer 50061, postprocessor 50062, router 50071, worker 50081); deploy/k8s/README.md
# lists them.
SESSION_PORTS = {"tokenizer": 50065, "postprocessor": 50063, "router": 50072, "worker": 50082}
MESH_CONFIG = "--mesh-config=/etc/llmesh/config/llmesh.yaml"


def resource_files() -> list[Path]:
    files = set()
    for directory in kustomization_dirs():
        spec = yaml.safe_load(kustomize.kustomization_file(directory).read_text())  # type: ignore[union-attr]
        for entry in spec.get("resources", []):
            path = (directory / entry).resolve()
            if path.is_file():
                files.add(path)
    return sorted(files)


def test_every_kustomization_and_overlay_is_covered() -> None:
    assert {"deploy/k8s/overlays/dev", "deploy/k8s/overlays/prod"} <= set(OVERLAYS)
    assert {
        "deploy/k8s/base",
        "deploy/k8s/zones/zone-a-cuda",
        "deploy/k8s/zones/zone-b-npu",
        "deploy/k8s/zones/kunpeng-cpu",
    } <= set(KUSTOMIZATIONS)
    # Discovered, not listed: every directory holding a kustomization that is not a component.
    found = {rel(p.parent) for p in K8S.rglob("kustomization.yaml")}
    assert found - set(KUSTOMIZATIONS) == {"deploy/k8s/components/tls"}


@pytest.mark.parametrize("path", resource_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_files_are_schema_valid(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    assert validate.validate_objects(docs) == []


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rendered_output_is_schema_valid(
    kustomization: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    objects = rendered[kustomization]
    assert objects
    assert validate.validate_objects(objects) == []


def test_validation_is_strict_for_builtin_and_custom_kinds(rendered: dict, tmp_path: Path) -> None:
    dep = copy.deepcopy(named(rendered["deploy/k8s/overlays/prod"], "Deployment", "llmesh-router"))
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    dep["spec"]["template"]["spec"]["nodeSelecter"] = {}
    found = validate.validate_objects([dep])
    assert any("nodeSelecter" in p for p in found) and any("3 is not of type" in p for p in found)
    # A CRD kind: its vendored CustomResourceDefinition, made strict; none at all is an error.
    (tmp_path / "widgets.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "names": {"kind": "Widget", "plural": "widgets"},
                 "scope": "Namespaced", "versions": [{"name": "v1", "served": True, "storage": True,
                 "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                     "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                     "metadata": {"type": "object"},
                     "spec": {"type": "object", "properties": {"size": {"type": "integer"}}}}}}}]},
    }))
    custom = validate.CustomSchemas.load(tmp_path)
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"},
              "spec": {"size": 2}}
    assert validate.validate_object(widget, custom) == []
    assert any("'sise' was unexpected" in p for p in validate.validate_object(
        {**widget, "spec": {"sise": 2}}, custom))
    assert any("'two' is not of type 'integer'" in p for p in validate.validate_object(
        {**widget, "spec": {"size": "two"}}, custom))
    (problem,) = validate.validate_object({**widget, "apiVersion": "example.com/v2"}, custom)
    assert "no schema for kind Widget of example.com/v2" in problem
    assert "deploy/k8s/schemas/example.com/widget_v2.json" in problem


def test_vendored_schemas_are_documented_and_used() -> None:
    custom = validate.CustomSchemas.load()
    readme = (validate.SCHEMAS / "README.md").read_text()
    for key, source in custom.sources.items():
        assert str(source.relative_to(validate.SCHEMAS)) in readme, f"{source}: source not noted"
        assert key[2] in readme


def test_validate_cli_renders_and_checks_every_kustomization() -> None:
    run = subprocess.run([sys.executable, "-m", "deploy.tools.validate"], capture_output=True, text=True,
                         timeout=300, cwd=K8S.parent.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith(f"{len(KUSTOMIZATIONS)} kustomization(s), 0 problem(s)")


# ---------------------------------------------------------------------------- one mesh config

# What a Deployment's arguments may still say: who the pod is (a worker's zone and device)
# and how the pod is wired (ports matching containerPort, probes, Services and policies,
# processes matching its CPU and metrics ports, drain time matching
# terminationGracePeriodSeconds, files mounted from volumes). Everything else is llmesh.yaml.
POD_FLAGS = {"--host", "--port", "--session-port", "--metrics-port", "--processes", "--grace-seconds",
             "--log-format", "--mesh-config", "--tenants-file", "--tls-cert", "--tls-key",
             "--tls-client-ca", "--downstream-tls-ca", "--downstream-tls-cert", "--downstream-tls-key"}
IDENTITY_FLAGS = {"--zone", "--device"}


def kustomization_texts() -> list[Path]:
    return sorted(p for name in kustomize.KUSTOMIZATION_FILES for p in K8S.rglob(name))


def test_no_patch_edits_a_container_argument_by_index() -> None:
    for path in kustomization_texts():
        text = path.read_text()
        assert not re.search(r"/args/\d", text), f"{rel(path)} patches an argument by its index"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_arguments_are_identity_and_pod_wiring(overlay: str, rendered: dict) -> None:
    for dep in by_kind(rendered[overlay], "Deployment"):
        container = dep["spec"]["template"]["spec"]["containers"][0]
        flags = {a.split("=", 1)[0] for a in container["args"]}
        component = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        allowed = POD_FLAGS | (IDENTITY_FLAGS if component == "worker" else set())
        assert flags <= allowed, f"{dep['metadata']['name']}: {sorted(flags - allowed)}"
        assert MESH_CONFIG in container["args"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == mounts["/etc/llmesh/config"])
        assert volume["configMap"]["name"].startswith("llmesh-config-")


def overlay_with_mesh_change(tmp_path: Path, overlay: str, change: Any) -> list[dict[str, Any]]:
    """``overlay`` rendered through a further overlay whose llmesh.yaml is the original
    with ``change`` applied (configMapGenerator behavior: replace, as the overlays do)."""
    base = K8S.parent.parent / overlay
    original = named(kustomize.build(base), "ConfigMap",
                     next(c["metadata"]["name"] for c in by_kind(kustomize.build(base), "ConfigMap")
                          if c["metadata"]["name"].startswith("llmesh-config-")))
    mesh = yaml.safe_load(original["data"]["llmesh.yaml"])
    change(mesh)
    (tmp_path / "llmesh.yaml").write_text(yaml.safe_dump(mesh))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(base, tmp_path)],  # kustomize refuses absolute roots
        "configMapGenerator": [{"name": "llmesh-config", "behavior": "replace", "files": ["llmesh.yaml"]}],
    }))
    return kustomize.build(tmp_path)


def test_one_configmap_value_reaches_every_tier_that_uses_it(tmp_path: Path, rendered: dict) -> None:
    """Change the served model name once, in the prod overlay's ConfigMap: every tier that
    names the model (gateway and router defaults, tokenizer and postprocessor model lists,
    every worker pool) picks the new value up through --mesh-config, and every Deployment
    mounts the new ConfigMap (its name hash changed, so they all roll)."""
    before = rendered["deploy/k8s/overlays/prod"]

    def rename(mesh: dict[str, Any]) -> None:
        mesh["served_model_name"] = "bank-assistant"

    after = overlay_with_mesh_change(tmp_path, "deploy/k8s/overlays/prod", rename)
    assert [(o["kind"], o["metadata"]["name"]) for o in by_kind(after, "Deployment")] == [
        (o["kind"], o["metadata"]["name"]) for o in by_kind(before, "Deployment")
    ]
    old_cm = {c["metadata"]["name"] for c in by_kind(before, "ConfigMap")}
    (new_cm,) = [c["metadata"]["name"] for c in by_kind(after, "ConfigMap")
                 if c["metadata"]["name"].startswith("llmesh-config-")]
    assert new_cm not in old_cm
    with built_settings(after) as settings:
        assert settings["llmesh-gateway"].default_model == "bank-assistant"
        assert settings["llmesh-router"].default_model == "bank-assistant"
        for tier in ("tokenizer", "postprocessor"):
            assert list(settings[f"llmesh-{tier}"].models) == [
                "bank-assistant=/models/deepseek-v2-lite-chat"
            ]
        workers = [n for n in settings if n.startswith("llmesh-worker-")]
        assert len(workers) == 3
        for name in workers:
            assert settings[name].served_model_name == "bank-assistant"
    for dep in by_kind(after, "Deployment"):
        volumes = dep["spec"]["template"]["spec"]["volumes"]
        assert [v["configMap"]["name"] for v in volumes if "configMap" in v] == [new_cm]


def test_one_worker_setting_changes_only_its_pool(tmp_path: Path) -> None:
    def bigger_zone_b(mesh: dict[str, Any]) -> None:
        next(w for w in mesh["workers"] if w["zone"] == "zone-b")["settings"]["max_model_len"] = 65536

    after = overlay_with_mesh_change(tmp_path, "deploy/k8s/overlays/prod", bigger_zone_b)
    with built_settings(after) as settings:
        assert settings["llmesh-worker-zone-b"].max_model_len == 65536
        assert settings["llmesh-worker-zone-a"].max_model_len == 32768
        assert settings["llmesh-worker-kunpeng"].max_model_len == 8192


def test_the_router_ladder_comes_from_the_mesh_config(tmp_path: Path) -> None:
    def reorder(mesh: dict[str, Any]) -> None:
        mesh["router"]["zones"] = ["zone-b", "zone-a", "kunpeng"]

    after = overlay_with_mesh_change(tmp_path, "deploy/k8s/overlays/prod", reorder)
    with built_settings(after) as settings:
        assert list(settings["llmesh-router"].zones) == ["zone-b", "zone-a", "kunpeng"]
        targets = {(t.name, t.zone, t.device) for t in settings["llmesh-router"].dns_targets}
        assert targets == {("llmesh-worker-zone-a:50081", "zone-a", "cuda"),
                           ("llmesh-worker-zone-b:50081", "zone-b", "npu"),
                           ("llmesh-worker-kunpeng:50081", "kunpeng", "cpu")}


# ---------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployments_roll_out_without_losing_capacity(overlay: str, rendered: dict) -> None:
    deployments = by_kind(rendered[overlay], "Deployment")
    assert len(deployments) >= 5
    for dep in deployments:
        strategy = dep["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate"
        assert strategy["rollingUpdate"] == {"maxSurge": 2, "maxUnavailable": 0}, dep["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_non_root_and_bounded(overlay: str, rendered: dict) -> None:
    for dep in by_kind(rendered[overlay], "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        name = dep["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["automountServiceAccountToken"] is False, name
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["capabilities"]["drop"] == ["ALL"], name
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(
                resources["limits"]
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_a_disruption_budget_and_an_autoscaler(overlay: str, rendered: dict) -> None:
    objects = rendered[overlay]
    pdbs = by_kind(objects, "PodDisruptionBudget")
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in by_kind(objects, "HorizontalPodAutoscaler")}
    for dep in by_kind(objects, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        covering = [
            p
            for p in pdbs
            if all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items())
        ]
        assert len(covering) == 1, f"{dep['metadata']['name']}: {len(covering)} PDBs"
        hpa = hpas[dep["metadata"]["name"]]
        metrics = hpa["spec"]["metrics"]
        component = labels["app.kubernetes.io/component"]
        if component in ("tokenizer", "postprocessor", "router"):
            assert [m["resource"]["name"] for m in metrics if m["type"] == "Resource"] == ["cpu"]
            assert all(m["type"] == "Resource" for m in metrics)
        else:  # gateway and workers scale on their own load, from Prometheus
            pods_metrics = [m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"]
            assert pods_metrics, dep["metadata"]["name"]
            assert all(name.startswith("llmesh_") for name in pods_metrics)


def test_prod_worker_pools_per_zone_and_device(rendered: dict) -> None:
    objects = rendered["deploy/k8s/overlays/prod"]
    pools = {
        d["metadata"]["name"]: d
        for d in by_kind(objects, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    }
    assert set(pools) == {"llmesh-worker-zone-a", "llmesh-worker-zone-b", "llmesh-worker-kunpeng"}
    expected = {
        "llmesh-worker-zone-a": (
            "zone-a",
            "cuda",
            "nvidia.com/gpu",
            "registry.llmesh.example/llmesh/worker-cuda:",
        ),
        "llmesh-worker-zone-b": (
            "zone-b",
            "npu",
            "huawei.com/Ascend910",
            "registry.llmesh.example/llmesh/worker-ascend:",
        ),
        "llmesh-worker-kunpeng": ("kunpeng", "cpu", None, "registry.llmesh.example/llmesh/worker-cpu:"),
    }
    accelerators = {"nvidia.com/gpu", "huawei.com/Ascend910"}
    with built_settings(objects) as built:
        settings = dict(built)
    for name, (zone, device, accelerator, image) in expected.items():
        dep = pools[name]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["llmesh.io/zone"] == zone and labels["llmesh.io/device"] == device
        assert dep["spec"]["selector"]["matchLabels"]["llmesh.io/zone"] == zone  # pools do not share pods
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert f"--zone={zone}" in container["args"] and f"--device={device}" in container["args"]
        assert container["image"].startswith(image)
        limits = container["resources"]["limits"]
        assert dep["spec"]["template"]["spec"]["nodeSelector"]["llmesh.io/zone"] == zone
        if accelerator:
            assert int(limits[accelerator]) >= 1
            # One rank per device: the pool's tensor_parallel_size (from llmesh.yaml).
            assert settings[name].tensor_parallel_size == int(limits[accelerator])
        else:
            assert not accelerators & set(limits)
            assert dep["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/arch"] == "arm64"
        service = named(objects, "Service", name)
        assert service["spec"]["clusterIP"] == "None"  # headless: the router sees every pod
        assert service["spec"]["selector"]["llmesh.io/zone"] == zone


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cpu_tiers_run_on_kunpeng_spread_across_zones(overlay: str, rendered: dict) -> None:
    for tier in CPU_TIERS:
        dep = named(rendered[overlay], "Deployment", f"llmesh-{tier}")
        pod = dep["spec"]["template"]["spec"]
        assert pod["nodeSelector"]["kubernetes.io/arch"] == "arm64"
        keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
        assert "topology.kubernetes.io/zone" in keys


def test_dev_probes_are_native_grpc_and_prod_probes_speak_tls(rendered: dict) -> None:
    for dep in by_kind(rendered["deploy/k8s/overlays/dev"], "Deployment"):
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert container["livenessProbe"]["grpc"]["service"] == ""
        assert container["readinessProbe"]["grpc"]["service"].startswith("llmesh.")
    for dep in by_kind(rendered["deploy/k8s/overlays/prod"], "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["readinessProbe"]["exec"]["command"] == ["llmesh-healthcheck", "--readiness"]
        assert "--tls-cert=/etc/llmesh/tls/tls.crt" in container["args"]
        # Each tier its own certificate: its identity is what internal tiers authorize.
        tier = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert f"llmesh-tls-{tier}" in secrets and "llmesh-tls" not in secrets


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_generated_config_and_tenant_secret_are_wired_into_the_gateway(overlay: str, rendered: dict) -> None:
    objects = rendered[overlay]
    config = [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].startswith("llmesh-config-")]
    tenants = [s for s in by_kind(objects, "Secret") if s["metadata"]["name"].startswith("llmesh-tenants-")]
    assert len(config) == 1 and len(tenants) == 1
    gateway = named(objects, "Deployment", "llmesh-gateway")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in gateway["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config[0]["metadata"]["name"]
    assert volumes["tenants"]["secret"]["secretName"] == tenants[0]["metadata"]["name"]
    args = gateway["containers"][0]["args"]
    assert "--tenants-file=/etc/llmesh/tenants/tenants.yaml" in args and MESH_CONFIG in args


# ---------------------------------------------------------------------------- network


def test_session_ports_are_those_of_the_tiers_that_serve_session() -> None:
    assert {t for t in consistency.TIERS if consistency.serves_session(t)} == set(SESSION_PORTS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_session_tiers_listen_on_a_fixed_port_their_service_exposes(overlay: str, rendered: dict) -> None:
    """Callers learn the framed Session port from the gRPC port and dial the host they use
    for gRPC (the tier's Service): the process, its container and its Service agree on one
    fixed port per tier; tiers without Session have none."""
    objects = rendered[overlay]
    with built_settings(objects) as built:
        settings = dict(built)
    seen = set()
    for dep in by_kind(objects, "Deployment"):
        name = dep["metadata"]["name"]
        tier = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        container = dep["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        service_ports = {p["name"]: p for p in named(objects, "Service", name)["spec"]["ports"]}
        if tier not in SESSION_PORTS:
            assert "session" not in ports and "session" not in service_ports, name
            assert not any(a.startswith("--session-port") for a in container["args"]), name
            continue
        seen.add(tier)
        assert settings[name].session_port == ports["session"] == SESSION_PORTS[tier], name
        assert f"--session-port={SESSION_PORTS[tier]}" in container["args"], name
        assert service_ports["session"]["port"] == SESSION_PORTS[tier], name
        assert service_ports["session"]["targetPort"] == "session", name
        assert service_ports["session"]["protocol"] == "TCP", name
    assert seen == set(SESSION_PORTS)



def call_graph(objects: list[dict[str, Any]], where: str) -> set[tuple[str, str, int]]:
    """(caller component, callee Service, port) for every address a tier's settings dial,
    and, where the callee serves Session and the caller calls it (not the router's
    tokenizer_target: ListModels only), its session port: callers ask the gRPC port for
    it and dial the same host (sessionwire.SessionOpener), i.e. the same Service."""
    report = consistency.Report()
    edges: set[tuple[str, str, int]] = set()
    session_callers: set[tuple[str, str, int]] = set()
    stack = contextlib.ExitStack()
    runs = consistency.invocations(objects, where, report)
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    for inv in runs:
        consistency.check_invocation(inv, report, stack)
        settings = inv.settings
        targets: list[tuple[str, bool]] = []
        for name in ("tokenizer_targets", "router_targets", "postprocessor_targets"):
            targets += [(t, True) for t in getattr(settings, name, []) or []]
        if getattr(settings, "tokenizer_target", ""):
            targets.append((settings.tokenizer_target, False))
        targets += [(t.name, True) for t in getattr(settings, "dns_targets", []) or []]
        for target, session in targets:
            host, _, port = target.removeprefix("dns:///").rpartition(":")
            edges.add((inv.tier, host.split(".")[0], int(port)))
            if session:
                session_callers.add((inv.tier, host.split(".")[0], int(port)))
    for caller, service, grpc_port in session_callers:
        if service not in services:
            continue
        selector = {"matchLabels": services[service]["spec"]["selector"]}
        for callee in runs:
            labels = callee.workload["spec"]["template"]["metadata"]["labels"]
            if (callee.settings is not None and callee.settings.port == grpc_port
                    and consistency.serves_session(callee.tier) and selector_matches(selector, labels)):
                edges.add((caller, service, callee.settings.session_port))
    stack.close()
    assert not report.problems, report.problems
    return edges


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_mesh_calls(overlay: str, rendered: dict) -> None:
    objects = rendered[overlay]
    policies = by_kind(objects, "NetworkPolicy")
    namespace = policies[0]["metadata"]["namespace"]
    mesh_ns = {"kubernetes.io/metadata.name": namespace}
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in by_kind(objects, "Deployment")
    }
    component = {name: labels["app.kubernetes.io/component"] for name, labels in pods.items()}
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    edges = call_graph(objects, overlay)
    assert ("gateway", "llmesh-router", 50071) in edges and any(e[0] == "router" for e in edges)
    # Session frames on the callee's own port, from the same callers as its gRPC port.
    assert {("gateway", "llmesh-router", 50072), ("gateway", "llmesh-postprocessor", 50063),
            ("gateway", "llmesh-tokenizer", 50065)} <= edges
    assert ("router", "llmesh-tokenizer", 50065) not in edges  # ListModels only
    assert ("router", "llmesh-worker-kunpeng", 50082) in edges

    def allowed(src_pod: str, dst_pod: str, port: int) -> bool:
        return ingress_allowed(policies, namespace, pods[src_pod], mesh_ns, namespace, pods[dst_pod], port)

    for src in pods:
        for dst in pods:
            for svc_name, svc in services.items():
                if not selector_matches({"matchLabels": svc["spec"]["selector"]}, pods[dst]):
                    continue
                for port in (p["port"] for p in svc["spec"]["ports"]):
                    expected = (component[src], svc_name, port) in edges
                    assert allowed(src, dst, port) == expected, f"{src} -> {svc_name}:{port}"

    client_ns = {"kubernetes.io/metadata.name": "payments", "llmesh.io/client": "true"}
    other_ns = {"kubernetes.io/metadata.name": "other"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    client_pod = {"app": "payments-backend"}
    for dst, labels in pods.items():
        container = named(objects, "Deployment", dst)["spec"]["template"]["spec"]["containers"][0]
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        # Every serving port (gRPC, and the gateway's HTTP listener where enabled).
        for port in [p["containerPort"] for p in container["ports"] if not p["name"].startswith("metrics")]:
            from_clients = ingress_allowed(
                policies, namespace, client_pod, client_ns, "payments", labels, port
            )
            assert from_clients == (component[dst] == "gateway"), f"clients -> {dst}:{port}"
            assert not ingress_allowed(policies, namespace, client_pod, other_ns, "other", labels, port)
        assert ingress_allowed(
            policies, namespace, {"app": "prometheus"}, monitoring, "monitoring", labels, 9090
        )
        assert not ingress_allowed(
            policies, namespace, {"app": "prometheus"}, monitoring, "monitoring", labels, grpc_port
        )

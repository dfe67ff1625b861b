"""Kubernetes manifests: schema-valid, rendered identically to kustomize, and saying what
the deployment promises (rollouts, disruption budgets, autoscaling, accelerators,
non-root pods, and a network that lets through exactly the calls the tiers make)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy.tools import consistency, render
from tests.deploy.conftest import K8S, K8S_VERSION, by_kind, kustomization_dirs, named, overlay_dirs, rel

KUSTOMIZATIONS = [rel(d) for d in kustomization_dirs()]
OVERLAYS = [rel(d) for d in overlay_dirs()]
CPU_TIERS = ("gateway", "tokenizer", "postprocessor", "router")


def validate(obj: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        pytest.fail(
            f"{where}: {obj['kind']}/{obj['metadata'].get('name')}: {err.message} at {list(err.path)}"
        )


def resource_files() -> list[Path]:
    files = set()
    for directory in kustomization_dirs():
        spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
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


@pytest.mark.parametrize("path", resource_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_files_are_schema_valid(path: Path) -> None:
    docs = render.load_documents(path)
    assert docs
    for doc in docs:
        validate(doc, str(path))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rendered_output_is_schema_valid(
    kustomization: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    objects = rendered[kustomization]
    assert objects
    for obj in objects:
        validate(obj, kustomization)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renderer_matches_kubectl_kustomize(
    kustomization: str, rendered: dict[str, list[dict[str, Any]]], kubectl: str
) -> None:
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S.parent.parent / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    expected = [doc for doc in yaml.safe_load_all(out) if doc]
    ours = rendered[kustomization]
    assert [(o["kind"], o["metadata"]["name"]) for o in ours] == [
        (o["kind"], o["metadata"]["name"]) for o in expected
    ]
    for mine, theirs in zip(ours, expected, strict=True):
        assert mine == theirs, f"{mine['kind']}/{mine['metadata']['name']} differs from kubectl kustomize"


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
            tp = next(a for a in container["args"] if a.startswith("--tensor-parallel-size="))
            assert int(tp.split("=")[1]) == int(limits[accelerator])  # one rank per device
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
    assert "--tenants-file=/etc/llmesh/tenants/tenants.yaml" in args


# ---------------------------------------------------------------------------- network


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels and matchExpressions); {} matches all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        value, op = labels.get(expr["key"]), expr["operator"]
        if (
            (op == "In" and value not in expr["values"])
            or (op == "NotIn" and value in expr["values"])
            or (op == "Exists" and value is None)
            or (op == "DoesNotExist" and value is not None)
        ):
            return False
    return True


def ingress_allowed(
    policies: list[dict[str, Any]],
    namespace: str,
    src: dict[str, str],
    src_ns: dict[str, str],
    src_ns_name: str,
    dst: dict[str, str],
    port: int,
) -> bool:
    """Whether NetworkPolicies let a pod (labels src, in a namespace) reach dst:port."""
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], dst)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                pod_ok = "podSelector" not in peer or selector_matches(peer["podSelector"], src)
                if "namespaceSelector" in peer:
                    ns_ok = selector_matches(peer["namespaceSelector"], src_ns)
                else:
                    ns_ok = src_ns_name == namespace
                if pod_ok and ns_ok:
                    return True
    return False


def call_graph(objects: list[dict[str, Any]], where: str) -> set[tuple[str, str, int]]:
    """(caller component, callee Service, port) for every address a tier's settings dial."""
    report = consistency.Report()
    edges: set[tuple[str, str, int]] = set()
    for inv in consistency.invocations(objects, where, report):
        consistency.check_invocation(inv, report)
        if report.unchecked:
            pytest.skip(f"tier code missing: {sorted(report.unchecked)}")
        settings = inv.settings
        targets: list[str] = []
        for name in ("tokenizer_targets", "router_targets", "postprocessor_targets"):
            targets += list(getattr(settings, name, []) or [])
        if getattr(settings, "tokenizer_target", ""):
            targets.append(settings.tokenizer_target)
        targets += [t.name for t in getattr(settings, "dns_targets", []) or []]
        for target in targets:
            host, _, port = target.removeprefix("dns:///").rpartition(":")
            edges.add((inv.tier, host.split(".")[0], int(port)))
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
        for port in [p["containerPort"] for p in container["ports"] if p["name"] != "metrics"]:
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

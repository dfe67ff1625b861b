"""The multi-node worker (deploy/k8s/multinode): LeaderWorkerSets rendered by the real
kustomize, validated against the vendored LWS CRD schema, and what they promise: the leader
runs `llmesh worker` as the engine's head, followers join it through LWS_LEADER_ADDRESS,
whole accelerator nodes per pod, readiness gated on the whole group, one router-facing
address per group (gRPC and Session frames), which the router may reach."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "deploy" / "k8s" / "multinode"
SCHEMA = REPO / "deploy" / "k8s" / "schemas" / "leaderworkerset.x-k8s.io" / "leaderworkerset_v1.json"

# zone kustomization -> (zone, device, accelerator resource, accelerators per node)
ZONES = {
    "zone-a-cuda": ("zone-a", "cuda", "nvidia.com/gpu", 8),
    "zone-b-npu": ("zone-b", "npu", "huawei.com/Ascend910", 8),
}
LEADER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GRPC_PORT, SESSION_PORT = 50081, 50082


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (its built-in kustomize) is not installed")
    out = {}
    for name in [*ZONES, "group"]:
        result = subprocess.run([kubectl, "kustomize", str(MULTINODE / name)], capture_output=True,
                                text=True, timeout=60, check=True)
        out[name] = [d for d in yaml.safe_load_all(result.stdout) if d]
    return out


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def templates(lws: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return t["leaderTemplate"], t["workerTemplate"]


def group_env(objects: list[dict[str, Any]], pod: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet gives it (envFrom ConfigMap, then env)."""
    container = pod["spec"]["containers"][0]
    (source,) = container["envFrom"]
    cm = [o for o in objects if o["kind"] == "ConfigMap"
          and o["metadata"]["name"] == source["configMapRef"]["name"]]
    assert len(cm) == 1, "envFrom names the generated ConfigMap (hash suffix followed)"
    env = dict(cm[0]["data"])
    env.update({e["name"]: e.get("value", "<fieldRef>") for e in container.get("env", [])})
    return env


def test_schema_is_a_valid_json_schema() -> None:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["x-kubernetes-group-version-kind"] == [
        {"group": "leaderworkerset.x-k8s.io", "version": "v1", "kind": "LeaderWorkerSet"}]


@pytest.mark.parametrize("name", [*ZONES, "group"])
def test_leaderworkersets_validate_against_the_crd_schema(name: str, rendered: dict) -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))
    lws = [o for o in rendered[name] if o["kind"] == "LeaderWorkerSet"]
    assert lws
    for obj in lws:
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
        assert not errors, errors


def test_schema_refuses_what_the_crd_refuses() -> None:
    """Strict: unknown fields and values outside the CRD's enums are errors."""
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))
    pod = {"spec": {"containers": [{"name": "c", "image": "i"}]}}
    good = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "x"},
            "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": pod}}}
    assert validator.is_valid(good)
    bad_policy = json.loads(json.dumps(good))
    bad_policy["spec"]["startupPolicy"] = "WhenReady"
    typo = json.loads(json.dumps(good))
    typo["spec"]["leaderWorkerTemplate"]["restartPolicyy"] = "Default"
    pod_typo = json.loads(json.dumps(good))
    pod_typo["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imag"] = "i"
    no_workers = {"apiVersion": good["apiVersion"], "kind": good["kind"],
                  "spec": {"leaderWorkerTemplate": {"size": 2}}}
    for bad in (bad_policy, typo, pod_typo, no_workers):
        assert not validator.is_valid(bad)


@pytest.mark.parametrize("name", ZONES)
def test_leader_runs_the_llmesh_worker_as_engine_head(name: str, rendered: dict) -> None:
    objects = rendered[name]
    zone, device, _, _ = ZONES[name]
    leader, _ = templates(one(objects, "LeaderWorkerSet"))
    container = leader["spec"]["containers"][0]
    assert container["command"][-2:] == ["llmesh", "worker"]
    env = group_env(objects, leader)
    assert env["LLMESH_WORKER_ZONE"] == zone and env["LLMESH_WORKER_DEVICE"] == device
    # The head binds the data-parallel handshake on its own pod address; it is rank 0.
    assert env["LLMESH_WORKER_DATA_PARALLEL_ADDRESS"] == "$(POD_IP)"
    assert "LLMESH_WORKER_DATA_PARALLEL_START_RANK" not in env
    port = int(env["LLMESH_WORKER_DATA_PARALLEL_RPC_PORT"])
    assert port in {p["containerPort"] for p in container["ports"]}
    assert leader["metadata"]["labels"]["llmesh.io/zone"] == zone
    assert leader["metadata"]["labels"]["llmesh.io/device"] == device


@pytest.mark.parametrize("name", ZONES)
def test_group_size_matches_the_data_parallel_layout(name: str, rendered: dict) -> None:
    objects = rendered[name]
    _, _, resource, per_node = ZONES[name]
    lws = one(objects, "LeaderWorkerSet")
    leader, worker = templates(lws)
    env = group_env(objects, leader)
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    dp = int(env["LLMESH_WORKER_DATA_PARALLEL_SIZE"])
    local = int(env["LLMESH_WORKER_DATA_PARALLEL_SIZE_LOCAL"])
    tp = int(env.get("LLMESH_WORKER_TENSOR_PARALLEL_SIZE", "1"))
    pp = int(env.get("LLMESH_WORKER_PIPELINE_PARALLEL_SIZE", "1"))
    assert size >= 2 and size * local == dp, "every node runs `local` ranks, the group all of them"
    assert local * tp * pp == per_node, "each pod uses exactly its node's accelerators"
    for pod in (leader, worker):
        res = pod["spec"]["containers"][0]["resources"]
        assert res["requests"][resource] == res["limits"][resource] == str(per_node)
        other = {"nvidia.com/gpu", "huawei.com/Ascend910"} - {resource}
        assert not other & (set(res["requests"]) | set(res["limits"]))
        assert pod["spec"]["nodeSelector"]["llmesh.io/zone"] == ZONES[name][0]


@pytest.mark.parametrize("name", ZONES)
def test_followers_join_the_leader_through_lws_leader_address(name: str, rendered: dict,
                                                              tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the follower's script with a stand-in `llmesh` that records its arguments and
    environment, then load that environment with the worker's real settings loader: the
    follower is `llmesh worker --headless` on the leader's settings plus its own rank."""
    import argparse

    from services.common.settings import add_settings_arguments, settings_from_args
    from services.worker.server import check_parallel_settings
    from services.worker.settings import WorkerSettings

    objects = rendered[name]
    leader, worker = templates(one(objects, "LeaderWorkerSet"))
    container = worker["spec"]["containers"][0]
    assert container["command"][-2:] == ["/bin/sh", "-c"]
    (script,) = container["args"]
    assert "$LWS_LEADER_ADDRESS" in script
    fake = tmp_path / "bin" / "llmesh"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "ARG %s\\n" "$a"; done\nenv\n', encoding="utf-8")
    fake.chmod(0o755)
    env = group_env(objects, worker)
    env = {k: v for k, v in env.items() if v != "<fieldRef>" and "$(" not in v}
    env.update(PATH=f"{fake.parent}:/usr/bin:/bin", TMPDIR=str(tmp_path),
               LWS_LEADER_ADDRESS="localhost", LWS_WORKER_INDEX="1")
    result = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True,
                            timeout=30, check=True)
    lines = result.stdout.splitlines()
    assert [line[4:] for line in lines if line.startswith("ARG ")] == ["worker", "--headless"]
    seen = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("ARG "))
    leader_env = group_env(objects, leader)
    local = int(leader_env["LLMESH_WORKER_DATA_PARALLEL_SIZE_LOCAL"])
    assert seen["LLMESH_WORKER_DATA_PARALLEL_START_RANK"] == str(1 * local)
    assert seen["LLMESH_WORKER_DATA_PARALLEL_ADDRESS"] in {"127.0.0.1", "::1"}  # localhost, resolved
    # Leader and followers read the same engine settings from the group ConfigMap.
    per_pod = {"LLMESH_WORKER_DATA_PARALLEL_ADDRESS", "LLMESH_WORKER_SERVICE_NAME"}
    for key, value in leader_env.items():
        if key.startswith("LLMESH_WORKER_") and key not in per_pod and "$(" not in value \
                and value != "<fieldRef>":
            assert seen.get(key) == value, key
    for key, value in seen.items():
        if key.startswith("LLMESH_WORKER_"):
            monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, WorkerSettings)
    settings = settings_from_args(WorkerSettings, parser.parse_args(["--headless"]))
    check_parallel_settings(settings)
    assert settings.headless and settings.data_parallel_start_rank == local


@pytest.mark.parametrize("name", ZONES)
def test_readiness_is_gated_on_the_whole_group(name: str, rendered: dict) -> None:
    lws = one(rendered[name], "LeaderWorkerSet")
    spec = lws["spec"]
    # The leader waits for its followers' engines: LeaderReady would hold them back forever.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = templates(lws)
    probe = leader["spec"]["containers"][0]["readinessProbe"]["grpc"]
    # SERVING on the worker's own service only after AsyncLLM (every engine) and warm-up.
    assert probe == {"port": 50081, "service": "llmesh.worker.v1.WorkerService"}
    assert "readinessProbe" not in worker["spec"]["containers"][0], "followers serve nobody"


@pytest.mark.parametrize("name", ZONES)
def test_router_sees_one_worker_per_group(name: str, rendered: dict) -> None:
    objects = rendered[name]
    zone, device, _, _ = ZONES[name]
    lws = one(objects, "LeaderWorkerSet")
    leader, worker = templates(lws)
    (svc,) = [o for o in objects if o["kind"] == "Service"]
    # The single-node pool's name: the router's dns target llmesh-worker-<zone>:50081 holds.
    assert svc["metadata"]["name"] == f"llmesh-worker-{zone}"
    assert svc["metadata"]["name"] != lws["metadata"]["name"], "LWS makes its own Service by its name"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    selector = svc["spec"]["selector"]
    assert selector.pop(LEADER_INDEX_LABEL) == "0", "leaders only (LWS labels the leader index 0)"
    assert selector["llmesh.io/zone"] == zone and selector["llmesh.io/device"] == device
    for key, value in selector.items():
        assert leader["metadata"]["labels"][key] == value
        assert worker["metadata"]["labels"][key] == value
    # gRPC, and the framed Session listener the router learns from it and dials on the
    # same leader address.
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "grpc": (GRPC_PORT, "grpc"), "session": (SESSION_PORT, "session")}
    ports = {p["name"]: p["containerPort"] for p in leader["spec"]["containers"][0]["ports"]}
    assert (ports["grpc"], ports["session"]) == (GRPC_PORT, SESSION_PORT)


def test_pdb_lets_one_pod_hence_one_group_go(rendered: dict) -> None:
    for name in ZONES:
        objects = rendered[name]
        pdb = one(objects, "PodDisruptionBudget")
        leader, worker = templates(one(objects, "LeaderWorkerSet"))
        assert pdb["spec"]["maxUnavailable"] == 1
        for key, value in pdb["spec"]["selector"]["matchLabels"].items():
            assert leader["metadata"]["labels"][key] == worker["metadata"]["labels"][key] == value


def test_group_pods_may_reach_each_other_within_their_zone(rendered: dict) -> None:
    """The base denies workers everything but the router: the group's own ranks are let in."""
    for name, (zone, _, _, _) in ZONES.items():
        objects = rendered[name]
        (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
        leader, worker = templates(one(objects, "LeaderWorkerSet"))
        selectors = [policy["spec"]["podSelector"]["matchLabels"]]
        selectors += [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
                      for peer in rule["from"]]
        for labels in selectors:
            assert labels["llmesh.io/zone"] == zone
            for key, value in labels.items():
                assert leader["metadata"]["labels"][key] == worker["metadata"]["labels"][key] == value


@pytest.mark.parametrize("name", ZONES)
def test_leader_settings_accept_the_group_environment(name: str, rendered: dict,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The llmesh worker reads the group ConfigMap as its own settings (env), checked as at start."""
    import argparse

    from services.common.settings import add_settings_arguments, settings_from_args
    from services.worker.server import check_parallel_settings
    from services.worker.settings import WorkerSettings

    objects = rendered[name]
    leader, _ = templates(one(objects, "LeaderWorkerSet"))
    env = group_env(objects, leader)
    env["LLMESH_WORKER_DATA_PARALLEL_ADDRESS"] = "10.0.0.1"  # $(POD_IP) at run time
    for key, value in env.items():
        if key.startswith("LLMESH_WORKER_"):
            monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, WorkerSettings)
    settings = settings_from_args(WorkerSettings, parser.parse_args(leader["spec"]["containers"][0]["args"]))
    check_parallel_settings(settings)
    zone, device, _, _ = ZONES[name]
    assert (settings.zone, settings.device, settings.host, settings.port) == (zone, device, "0.0.0.0", 50081)
    assert settings.session_port == SESSION_PORT  # fixed: in the leader Service and the policies
    assert settings.data_parallel_size == int(env["LLMESH_WORKER_DATA_PARALLEL_SIZE"])
    assert settings.data_parallel_address == "10.0.0.1" and settings.data_parallel_start_rank is None
    assert settings.enable_expert_parallel and not settings.enforce_eager


@pytest.mark.parametrize("name", ZONES)
def test_the_router_may_reach_the_leader_as_any_worker(name: str, rendered: dict) -> None:
    """The base's policies (deny by default, workers answer the router) select the leader
    as a worker: the router reaches its gRPC and Session ports, the gateway neither."""
    from deploy.tools import kustomize
    from tests.deploy.conftest import ingress_allowed, named

    base = kustomize.build(REPO / "deploy" / "k8s" / "base")
    policies = [o for o in base if o["kind"] == "NetworkPolicy"]
    policies += [o for o in rendered[name] if o["kind"] == "NetworkPolicy"]
    leader, _ = templates(one(rendered[name], "LeaderWorkerSet"))
    labels = leader["metadata"]["labels"]
    mesh = {"kubernetes.io/metadata.name": "llmesh"}

    def pod(tier: str) -> dict[str, str]:
        return dict(named(base, "Deployment", f"llmesh-{tier}")["spec"]["template"]["metadata"]["labels"])

    for port in (GRPC_PORT, SESSION_PORT):
        assert ingress_allowed(policies, "llmesh", pod("router"), mesh, "llmesh", labels, port), port
        assert not ingress_allowed(policies, "llmesh", pod("gateway"), mesh, "llmesh", labels, port), port

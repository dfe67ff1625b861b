"""Check that deploy/ agrees with the code it deploys (what kustomize and the schemas
cannot see).

The mesh itself is written once, in the llmesh-config ConfigMap (llmesh.yaml), which
every tier reads with --mesh-config; nothing here compares copies of it. What is checked:

- every container that runs ``llmesh <tier>`` names a command in ``llmesh.cli.COMMANDS``;
  its arguments are parsed by that tier's own argparse parser and its settings object is
  built as the process builds it, with the mesh config read from the ConfigMap the pod
  mounts at the --mesh-config path (so unknown flags, bad values, a missing mount, a
  malformed llmesh.yaml and a worker with no ``workers:`` entry all fail here), and every
  ``LLMESH_*`` variable it sets is a field of that tier's settings class;
- the server listens on the pod network (host 0.0.0.0) on the container's ``grpc`` port,
  with metrics on its ``metrics`` port; gRPC probes use that port: liveness asks for
  service "" and readiness for the tier's full service name (from the proto descriptors);
- a tier whose service has a ``Session`` method (from the proto descriptors) runs its
  framed Session listener on a fixed ``--session-port`` (callers learn it from the gRPC
  port and dial the same host, so a free port would be in no Service and no policy) that
  is the container's ``session`` port; every Service exposing its gRPC port exposes that
  port too, under the same number, and every NetworkPolicy rule that lets peers reach its
  gRPC port lets them reach the session port as well (and no rule only one of them);
- every Service's selector matches a workload and its target ports exist; every HPA
  scales an existing workload that leaves ``spec.replicas`` to it; every PDB selects a
  workload; every ConfigMap, Secret, PVC and ServiceAccount a pod names exists;
- every ``workers:`` entry of the mesh config has a worker Deployment (its zone and
  device) and an ``address`` that is a headless Service selecting exactly those pods on
  their gRPC port, and the router's zone ladder covers every worker zone;
- Dockerfiles' ``ENTRYPOINT`` runs ``llmesh <tier>`` for a known tier and their
  ``LLMESH_*`` variables exist; llmesh-healthcheck knows every tier's service and port.

Usage: ``python -m deploy.tools.consistency`` (exit status 1 on any problem).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from deploy.tools import kustomize

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = DEPLOY / "k8s" / "overlays"
DOCKERFILES = DEPLOY / "docker"

# Environment variables that llmesh reads outside the tiers' settings classes.
GLOBAL_ENV = {"LLMESH_HOME"}

# Objects the manifests use but deliberately do not contain (made outside git).
EXTERNAL = {("Secret", f"llmesh-tls-{tier}")
            for tier in ("gateway", "router", "worker", "tokenizer", "postprocessor")}


@dataclass(frozen=True)
class TierSpec:
    """Where a tier's settings, CLI and public service live."""

    settings_module: str
    settings_class: str
    cli_module: str
    proto_module: str
    service: str


TIERS: dict[str, TierSpec] = {
    "gateway": TierSpec("gateway.settings", "GatewaySettings", "gateway.cli",
                        "llmesh.v1.inference_pb2", "InferenceService"),
    "tokenizer": TierSpec("services.tokenizer.settings", "TokenizerSettings", "services.tokenizer.cli",
                          "llmesh.tokenizer.v1.tokenizer_pb2", "TokenizerService"),
    "postprocessor": TierSpec("services.postprocessor.settings", "PostprocessorSettings",
                              "services.postprocessor.cli", "llmesh.postprocess.v1.postprocess_pb2",
                              "PostprocessService"),
    "router": TierSpec("services.router.settings", "RouterSettings", "services.router.cli",
                       "llmesh.router.v1.router_pb2", "RouterService"),
    "worker": TierSpec("services.worker.settings", "WorkerSettings", "services.worker.cli",
                       "llmesh.worker.v1.worker_pb2", "WorkerService"),
}


@dataclass
class Report:
    """What a check found. ``unchecked`` names tiers whose code does not exist yet."""

    problems: list[str] = field(default_factory=list)
    unchecked: set[str] = field(default_factory=set)

    def extend(self, other: Report) -> None:
        self.problems += other.problems
        self.unchecked |= other.unchecked


class ArgumentError(Exception):
    """argparse refused the arguments (instead of exiting the process)."""


# ---------------------------------------------------------------------------- tiers


def settings_class(tier: str) -> Any | None:
    """The tier's settings class, or None while its module does not exist."""
    spec = TIERS[tier]
    try:
        module = importlib.import_module(spec.settings_module)
    except ModuleNotFoundError as err:
        if err.name and spec.settings_module.startswith(err.name):
            return None
        raise
    return getattr(module, spec.settings_class, None)


def readiness_service(tier: str) -> str:
    """The tier's full gRPC service name, from its generated descriptor."""
    spec = TIERS[tier]
    module = importlib.import_module(spec.proto_module)
    return str(module.DESCRIPTOR.services_by_name[spec.service].full_name)


SESSION_METHOD = "Session"
SESSION_PORT_NAME = "session"


def serves_session(tier: str) -> bool:
    """Whether the tier's service has a ``Session`` method, which it then also serves as
    frames on a port of its own (services/common/sessionwire.py)."""
    spec = TIERS[tier]
    module = importlib.import_module(spec.proto_module)
    return SESSION_METHOD in module.DESCRIPTOR.services_by_name[spec.service].methods_by_name


def tier_parser(tier: str) -> argparse.ArgumentParser:
    """The tier's own parser when its CLI exposes ``build_parser``, else the same flags
    derived from its settings class; errors raise ArgumentError instead of exiting."""
    from services.common.settings import add_settings_arguments

    parser: argparse.ArgumentParser | None = None
    with contextlib.suppress(ModuleNotFoundError):
        cli = importlib.import_module(TIERS[tier].cli_module)
        if callable(getattr(cli, "build_parser", None)):
            parser = cli.build_parser()
    if parser is None:
        cls = settings_class(tier)
        if cls is None:
            raise ArgumentError(f"the {tier} tier has no settings class yet")
        parser = argparse.ArgumentParser(prog=f"llmesh {tier}")
        add_settings_arguments(parser, cls)

    def error(message: str) -> NoReturn:
        raise ArgumentError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Only ``values`` among LLMESH_* variables, for the duration of the block."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("LLMESH_")}
    for key in saved:
        del os.environ[key]
    os.environ.update(values)
    try:
        yield
    finally:
        for key in values:
            os.environ.pop(key, None)
        os.environ.update(saved)


def env_field(tier: str, name: str, cls: Any) -> str | None:
    """The settings field an ``LLMESH_<TIER>_*`` variable sets, or None if it sets none."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    if not name.upper().startswith(prefix):
        return None
    field_name = name[len(prefix):].lower().split("__", 1)[0]
    return field_name if field_name in cls.model_fields else None


def build_settings(tier: str, args: list[str], env: dict[str, str]) -> Any:
    """Parse ``args`` with the tier's CLI and build its settings as the process would."""
    from services.common.settings import settings_from_args

    cls = settings_class(tier)
    if cls is None:
        raise ArgumentError(f"the {tier} tier has no settings class yet")
    namespace = tier_parser(tier).parse_args(args)
    with _environment({k: v for k, v in env.items() if k.startswith("LLMESH_")}):
        return settings_from_args(cls, namespace)


# ---------------------------------------------------------------------------- containers


@dataclass
class Invocation:
    """One container that runs an llmesh tier."""

    where: str
    tier: str
    args: list[str]
    env: dict[str, str]
    container: dict[str, Any]
    workload: dict[str, Any]
    objects: list[dict[str, Any]] = field(default_factory=list)
    """Everything rendered with the container (its ConfigMaps, Services)."""
    settings: Any = None


def llmesh_command(argv: list[str]) -> tuple[str, list[str]] | None:
    """(subcommand, rest) for an argv that runs ``llmesh <subcommand> ...``, possibly
    behind a wrapper (e.g. the Ascend image's llmesh-ascend-env)."""
    for i, word in enumerate(argv):
        if Path(word).name == "llmesh" and i + 1 < len(argv):
            return argv[i + 1], argv[i + 2:]
    return None


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Pod":
        return spec
    if obj.get("kind") == "CronJob":
        spec = ((spec.get("jobTemplate") or {}).get("spec")) or {}
    template = spec.get("template")
    return (template or {}).get("spec") if template else None


def invocations(objects: list[dict[str, Any]], where: str, report: Report) -> list[Invocation]:
    from llmesh.cli import COMMANDS

    found = []
    for obj in objects:
        pod = _pod_spec(obj)
        if pod is None:
            continue
        name = f"{where}: {obj['kind']}/{obj['metadata']['name']}"
        for container in pod.get("containers", []) or []:
            argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
            parsed = llmesh_command(argv)
            cname = f"{name} container {container.get('name')}"
            if parsed is None:
                report.problems.append(f"{cname}: command does not run `llmesh <tier>`: {argv}")
                continue
            tier, rest = parsed
            if tier not in COMMANDS:
                report.problems.append(f"{cname}: `llmesh {tier}` is not a command in llmesh.cli.COMMANDS")
                continue
            if tier not in TIERS:
                report.problems.append(f"{cname}: `llmesh {tier}` is not a serving tier")
                continue
            env = {e["name"]: str(e.get("value", "")) for e in container.get("env", []) or []}
            found.append(Invocation(cname, tier, rest, env, container, obj, objects))
    return found


class MountError(Exception):
    """A file a container's arguments name is not mounted from the manifests."""


MESH_CONFIG_FLAG = "--mesh-config"


def mounted_file(objects: list[dict[str, Any]], inv: Invocation, path: str) -> str:
    """The content of ``path`` in ``inv``'s container, from the ConfigMap mounted there."""
    pod = _pod_spec(inv.workload) or {}
    volumes = {v["name"]: v for v in pod.get("volumes", []) or []}
    for mount in inv.container.get("volumeMounts", []) or []:
        root = str(mount["mountPath"]).rstrip("/") + "/"
        if not path.startswith(root):
            continue
        source = volumes.get(mount["name"], {}).get("configMap")
        if source is None:
            raise MountError(f"{path} is mounted from volume {mount['name']}, not a ConfigMap")
        key = path[len(root):]
        maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == source["name"]]
        if not maps or key not in (maps[0].get("data") or {}):
            raise MountError(f"{path}: ConfigMap/{source['name']} has no key {key}")
        return str(maps[0]["data"][key])
    raise MountError(f"{path} is not under any volumeMount of the container")


def _with_mounted_mesh_config(inv: Invocation, stack: contextlib.ExitStack) -> list[str]:
    """``inv.args`` with --mesh-config pointing at a local copy of the mounted file."""
    args = list(inv.args)
    for i, arg in enumerate(args):
        if arg == MESH_CONFIG_FLAG and i + 1 < len(args):
            path, index, form = args[i + 1], i + 1, "{}"
        elif arg.startswith(MESH_CONFIG_FLAG + "="):
            path, index, form = arg.split("=", 1)[1], i, MESH_CONFIG_FLAG + "={}"
        else:
            continue
        text = mounted_file(inv.objects, inv, path)
        local = Path(stack.enter_context(tempfile.TemporaryDirectory())) / Path(path).name
        local.write_text(text, encoding="utf-8")
        args[index] = form.format(local)
    return args


def check_invocation(inv: Invocation, report: Report, stack: contextlib.ExitStack) -> None:
    cls = settings_class(inv.tier)
    if cls is None:
        report.unchecked.add(inv.tier)
        return
    for name in inv.env:
        if name.startswith("LLMESH_") and name not in GLOBAL_ENV and env_field(inv.tier, name, cls) is None:
            report.problems.append(f"{inv.where}: env {name} is not a field of {cls.__name__}")
    args = list(inv.args)
    try:
        args = _with_mounted_mesh_config(inv, stack)
        inv.settings = build_settings(inv.tier, args, inv.env)
    except MountError as err:
        report.problems.append(f"{inv.where}: {err}")
        return
    except ArgumentError as err:
        report.problems.append(f"{inv.where}: `llmesh {inv.tier}` rejects its arguments: {err}")
        return
    except ValueError as err:  # pydantic.ValidationError is a ValueError
        report.problems.append(f"{inv.where}: invalid settings for {inv.tier}: {err}")
        return
    settings = inv.settings
    if inv.tier == "worker":
        # Choices the worker checks only at start-up (services.worker.server.check_settings).
        with contextlib.suppress(ModuleNotFoundError):
            server = importlib.import_module("services.worker.server")
            for name, choices in (("device", "DEVICES"), ("engine", "ENGINES")):
                allowed = getattr(server, choices, None)
                if allowed is not None and getattr(settings, name) not in allowed:
                    report.problems.append(f"{inv.where}: --{name}={getattr(settings, name)} is not one of "
                                           f"{', '.join(allowed)}")
            if settings.engine != "vllm":
                report.problems.append(f"{inv.where}: --engine={settings.engine} is a test engine")
    ports = {p.get("name"): p.get("containerPort") for p in inv.container.get("ports", []) or []}
    if settings.host not in ("0.0.0.0", "::", "[::]"):
        report.problems.append(f"{inv.where}: --host={settings.host} is not reachable from other pods")
    if ports.get("grpc") != settings.port:
        report.problems.append(
            f"{inv.where}: containerPort grpc={ports.get('grpc')} but --port={settings.port}"
        )
    if ports.get("metrics") != settings.metrics_port:
        report.problems.append(
            f"{inv.where}: containerPort metrics={ports.get('metrics')} "
            f"but --metrics-port={settings.metrics_port}"
        )
    check_session_port(inv, ports, report)
    ready_name = readiness_service(inv.tier)
    for probe_name, expected in (("livenessProbe", ""), ("startupProbe", ""), ("readinessProbe", ready_name)):
        probe = inv.container.get(probe_name)
        if probe is None:
            if probe_name != "startupProbe":
                report.problems.append(f"{inv.where}: no {probe_name}")
            continue
        if "grpc" in probe:
            if probe["grpc"].get("port") != settings.port:
                report.problems.append(f"{inv.where}: {probe_name} port {probe['grpc'].get('port')} "
                                       f"is not the gRPC port {settings.port}")
            if probe["grpc"].get("service", "") != expected:
                report.problems.append(f"{inv.where}: {probe_name} asks for service "
                                       f"{probe['grpc'].get('service', '')!r}, expected {expected!r}")
            if settings.tls_cert:
                report.problems.append(f"{inv.where}: {probe_name} is a plaintext gRPC probe but the "
                                       "server serves TLS (kubelet probes cannot speak TLS)")
        elif "exec" in probe:
            command = probe["exec"].get("command", [])
            mode = "--readiness" if expected else "--liveness"
            if not command or Path(command[0]).name != "llmesh-healthcheck" or mode not in command:
                report.problems.append(f"{inv.where}: {probe_name} exec must run llmesh-healthcheck {mode}")
        else:
            report.problems.append(f"{inv.where}: {probe_name} must be a gRPC or llmesh-healthcheck probe")


def check_session_port(inv: Invocation, ports: dict[Any, Any], report: Report) -> None:
    """A Session tier's listener port is fixed, declared as its ``session`` port and clear
    of its other ports; other tiers declare no ``session`` port (nothing would listen)."""
    settings = inv.settings
    if not serves_session(inv.tier):
        if SESSION_PORT_NAME in ports:
            report.problems.append(f"{inv.where}: containerPort {SESSION_PORT_NAME} but `llmesh {inv.tier}` "
                                   "serves no Session")
        return
    port = settings.session_port
    if port <= 0:
        meaning = "picks a free port" if port == 0 else "serves Session over gRPC only"
        report.problems.append(
            f"{inv.where}: --session-port={port} {meaning}; give the framed Session listener a fixed "
            f"port (in the Service and NetworkPolicies, like the gRPC port)"
        )
    if ports.get(SESSION_PORT_NAME) != port:
        report.problems.append(f"{inv.where}: containerPort {SESSION_PORT_NAME}="
                               f"{ports.get(SESSION_PORT_NAME)} but --session-port={port}")
    taken = {settings.port: "--port"}
    if settings.metrics_port > 0:
        for i in range(settings.processes):
            taken[settings.metrics_port + i] = "--metrics-port" + (f" + {i}" if i else "")
    if port > 0 and port in taken:
        report.problems.append(f"{inv.where}: --session-port={port} is also {taken[port]}")


# ---------------------------------------------------------------------------- objects


def _selects(selector: dict[str, Any], labels: dict[str, Any]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def label_selector_matches(selector: dict[str, Any] | None, labels: dict[str, Any]) -> bool:
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


def _template_labels(workload: dict[str, Any]) -> dict[str, Any]:
    template = (workload.get("spec") or {}).get("template") or {}
    return dict((template.get("metadata") or {}).get("labels") or {})


def check_wiring(objects: list[dict[str, Any]], where: str, report: Report) -> None:
    workloads = [o for o in objects if _pod_spec(o) is not None]
    for svc in (o for o in objects if o["kind"] == "Service"):
        selector = (svc.get("spec") or {}).get("selector") or {}
        targets = [w for w in workloads if _selects(selector, _template_labels(w))]
        name = f"{where}: Service/{svc['metadata']['name']}"
        if not targets:
            report.problems.append(f"{name}: selector {selector} matches no workload")
            continue
        for port in svc["spec"].get("ports", []) or []:
            target = port.get("targetPort", port.get("port"))
            for w in targets:
                container_ports = [p for c in _pod_spec(w)["containers"] for p in c.get("ports", []) or []]  # type: ignore[index]
                if not any(target in (p.get("name"), p.get("containerPort")) for p in container_ports):
                    report.problems.append(f"{name}: targetPort {target!r} not exposed by "
                                           f"{w['kind']}/{w['metadata']['name']}")
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    for hpa in (o for o in objects if o["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = by_name.get((ref["kind"], ref["name"]))
        if target is None:
            report.problems.append(f"{where}: HPA/{hpa['metadata']['name']} scales missing "
                                   f"{ref['kind']}/{ref['name']}")
        elif "replicas" in target["spec"]:
            report.problems.append(f"{where}: {ref['kind']}/{ref['name']} sets spec.replicas although "
                                   f"HPA/{hpa['metadata']['name']} owns its scale")
    for obj in objects:
        for kind, holder, key in _reference_slots(obj):
            if (kind, holder.get(key)) not in by_name and (kind, holder.get(key)) not in EXTERNAL:
                report.problems.append(f"{where}: {obj['kind']}/{obj['metadata']['name']} refers to "
                                       f"{kind}/{holder.get(key)}, which is not in the manifests")
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"].get("matchLabels") or {}
        if not any(_selects(selector, _template_labels(w)) for w in workloads):
            report.problems.append(f"{where}: PDB/{pdb['metadata']['name']} selects no workload")


def _reference_slots(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(kind, dict holding the name, key of the name) for every object a pod names."""
    pod = _pod_spec(obj)
    if pod is None:
        return
    if "serviceAccountName" in pod:
        yield "ServiceAccount", pod, "serviceAccountName"
    for volume in pod.get("volumes", []) or []:
        if "configMap" in volume:
            yield "ConfigMap", volume["configMap"], "name"
        if "secret" in volume:
            yield "Secret", volume["secret"], "secretName"
        if "persistentVolumeClaim" in volume:
            yield "PersistentVolumeClaim", volume["persistentVolumeClaim"], "claimName"
    for container in pod.get("containers", []) or []:
        for env in container.get("env", []) or []:
            value_from = env.get("valueFrom", {}) or {}
            if "configMapKeyRef" in value_from:
                yield "ConfigMap", value_from["configMapKeyRef"], "name"
            if "secretKeyRef" in value_from:
                yield "Secret", value_from["secretKeyRef"], "name"


def _service_port_reaches(port: dict[str, Any], name: str, number: int) -> bool:
    """Whether a Service port forwards to the container port ``name``/``number``."""
    target = port.get("targetPort", port.get("port"))
    return target in (name, number)


def _policy_port_covers(entry: dict[str, Any], name: str, number: int) -> bool:
    """Whether one ``ports`` entry of a NetworkPolicy rule admits the container port."""
    if entry.get("protocol", "TCP") != "TCP":
        return False
    value = entry.get("port")
    if value is None:
        return True  # every port of the protocol
    if isinstance(value, str):
        return value == name
    return int(value) <= number <= int(entry.get("endPort", value))


def _session_roles(tier: str) -> frozenset[str]:
    """The roles the tier's caller policy lets call its Session (services/common/authz.py)."""
    from services.common.authz import TIER_POLICIES

    policy = TIER_POLICIES.get(tier)
    return policy.roles_for(f"/{policy.service}/{SESSION_METHOD}") if policy else frozenset()


def _rule_components(rule: dict[str, Any]) -> set[str] | None:
    """The mesh components an ingress rule admits, by their pods' component label; None
    when it admits anything else (other namespaces, address blocks, any pod)."""
    key = "app.kubernetes.io/component"
    components: set[str] = set()
    for peer in rule.get("from") or []:
        pods = peer.get("podSelector")
        if pods is None or set(peer) != {"podSelector"}:
            return None
        named = (pods.get("matchLabels") or {}).get(key)
        chosen = [e for e in pods.get("matchExpressions") or []
                  if e.get("key") == key and e.get("operator") == "In"]
        if named is None and not chosen:
            return None
        components |= {named} if named is not None else {v for e in chosen for v in e.get("values", [])}
    return components or None


def check_session_reach(objects: list[dict[str, Any]], runs: list[Invocation], where: str,
                        report: Report) -> None:
    """Callers reach a Session tier's listener as they reach its gRPC port: on the same
    host (so every Service with the gRPC port has the session port, under the number
    GetSessionEndpoint reports) and through the same NetworkPolicy rules, except rules
    for peers the tier's caller policy does not let call Session (the router reads the
    tokenizer's ListModels only)."""
    tiers = [inv for inv in runs if inv.settings is not None and serves_session(inv.tier)
             and inv.settings.session_port > 0]
    for inv in tiers:
        labels = _template_labels(inv.workload)
        grpc_port, session_port = inv.settings.port, inv.settings.session_port
        for svc in (o for o in objects if o["kind"] == "Service"):
            if not _selects((svc.get("spec") or {}).get("selector") or {}, labels):
                continue
            ports = svc["spec"].get("ports", []) or []
            if not any(_service_port_reaches(p, "grpc", grpc_port) for p in ports):
                continue
            session = [p for p in ports if _service_port_reaches(p, SESSION_PORT_NAME, session_port)]
            name = f"{where}: Service/{svc['metadata']['name']}"
            if not session:
                report.problems.append(f"{name} exposes the gRPC port of {inv.tier} but not its session port "
                                       f"{session_port} (callers dial the same host on it)")
            elif all(p.get("port") != session_port for p in session):
                report.problems.append(
                    f"{name}: session port {[p.get('port') for p in session]} is not {session_port}, "
                    f"the port {inv.tier} reports (callers dial that number)"
                )
        for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
            spec = policy.get("spec") or {}
            if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
                continue
            if not label_selector_matches(spec.get("podSelector"), labels):
                continue
            for i, rule in enumerate(spec.get("ingress") or []):
                entries = rule.get("ports") or []
                if not entries:
                    continue  # every port: both are in
                grpc_in = any(_policy_port_covers(e, "grpc", grpc_port) for e in entries)
                session_in = any(_policy_port_covers(e, SESSION_PORT_NAME, session_port) for e in entries)
                if grpc_in != session_in:
                    peers = _rule_components(rule)
                    if grpc_in and peers is not None and not peers & _session_roles(inv.tier):
                        continue  # these peers have no Session to call here
                    has, lacks = (("gRPC", grpc_port), ("session", session_port)) if grpc_in else (
                        ("session", session_port), ("gRPC", grpc_port))
                    report.problems.append(
                        f"{where}: NetworkPolicy/{policy['metadata']['name']} ingress[{i}] lets peers reach "
                        f"the {has[0]} port {has[1]} of {inv.workload['metadata']['name']} but not its "
                        f"{lacks[0]} port {lacks[1]}"
                    )


def check_mesh(objects: list[dict[str, Any]], runs: list[Invocation], where: str, report: Report) -> None:
    """The mesh config the pods read against the pods that exist: every worker entry has
    its pool, reached through a headless Service at its address; the ladder covers it."""
    if not runs or any(inv.settings is None for inv in runs):
        return
    routers = [inv for inv in runs if inv.tier == "router"]
    workers = [inv for inv in runs if inv.tier == "worker"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for router in routers:
        covered: set[int] = set()
        for target in router.settings.dns_targets:
            host, _, port = target.name.removeprefix("dns:///").rpartition(":")
            svc = services.get(host.split(".")[0])
            if svc is None or svc["spec"].get("clusterIP") != "None":
                report.problems.append(f"{where}: worker address {target.name} is not a headless Service")
                continue
            if not any(str(p.get("port")) == port for p in svc["spec"].get("ports", [])):
                report.problems.append(f"{where}: worker address {target.name}: Service has no port {port}")
            selected = [w for w in workers
                        if _selects(svc["spec"].get("selector") or {}, _template_labels(w.workload))]
            if not selected:
                report.problems.append(f"{where}: worker address {target.name} selects no worker pods "
                                       f"(no Deployment runs zone={target.zone} device={target.device})")
            for w in selected:
                covered.add(id(w))
                if (w.settings.zone, w.settings.device) != (target.zone, target.device):
                    report.problems.append(
                        f"{where}: worker address {target.name} is zone={target.zone} "
                        f"device={target.device}, its pods run {w.settings.zone}/{w.settings.device}"
                    )
                if str(w.settings.port) != port:
                    report.problems.append(
                        f"{where}: worker address {target.name}: its workers listen on {w.settings.port}"
                    )
            if target.zone not in router.settings.zones:
                report.problems.append(f"{where}: worker zone {target.zone} is not on the router's ladder")
        for w in workers:
            if id(w) not in covered:
                report.problems.append(f"{w.where}: no workers: address in the mesh config reaches "
                                       "this pool, so no router sends it requests")


def check_objects(objects: list[dict[str, Any]], where: str) -> Report:
    """Every check on one rendered overlay."""
    report = Report()
    runs = invocations(objects, where, report)
    with contextlib.ExitStack() as stack:
        for inv in runs:
            check_invocation(inv, report, stack)
    check_wiring(objects, where, report)
    check_session_reach(objects, runs, where, report)
    if not report.unchecked:
        check_mesh(objects, runs, where, report)
    return report


# ---------------------------------------------------------------------------- Dockerfiles


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        instructions.append((word.upper(), rest.strip()))
    if pending:
        instructions.append(tuple(pending.split(" ", 1)))  # type: ignore[arg-type]
    return instructions


def exec_form(text: str) -> list[str]:
    """A Dockerfile ENTRYPOINT/CMD: the JSON exec form, or the shell form split."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return shlex.split(text)
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def check_dockerfile(path: Path) -> Report:
    from llmesh.cli import COMMANDS

    report = Report()
    where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    instructions = dockerfile_instructions(path)
    entry = [exec_form(arg) for ins, arg in instructions if ins == "ENTRYPOINT"]
    cmd = [exec_form(arg) for ins, arg in instructions if ins == "CMD"]
    argv = (entry[-1] if entry else []) + (cmd[-1] if cmd else [])
    parsed = llmesh_command(argv)
    tier = None
    if parsed is None:
        report.problems.append(f"{where}: ENTRYPOINT/CMD does not run `llmesh <tier>`: {argv}")
    else:
        tier = parsed[0]
        if tier not in COMMANDS:
            report.problems.append(f"{where}: `llmesh {tier}` is not a command in llmesh.cli.COMMANDS")
    for ins, arg in instructions:
        if ins != "ENV":
            continue
        if "=" in arg.split(" ", 1)[0]:
            pairs = [p.split("=", 1)[0] for p in shlex.split(arg)]  # ENV A=1 B=2
        else:
            pairs = [arg.split()[0]]  # legacy ENV A 1
        for name in pairs:
            if not name.startswith("LLMESH_") or name in GLOBAL_ENV:
                continue
            owners = [t for t in TIERS if settings_class(t) is not None
                      and env_field(t, name, settings_class(t)) is not None]
            if (tier in TIERS and tier not in owners) or not owners:
                report.problems.append(f"{where}: ENV {name} is not a settings field of "
                                       f"{tier if tier in TIERS else 'any tier'}")
    return report


# ---------------------------------------------------------------------------- all


def overlay_dirs() -> list[Path]:
    """The environments: what `kubectl apply -k` is run on."""
    return sorted(p for p in OVERLAYS.iterdir() if kustomize.kustomization_file(p) is not None)


def check_all() -> Report:
    report = Report()
    for overlay in overlay_dirs():
        where = str(overlay.relative_to(REPO))
        try:
            objects = kustomize.build(overlay)
        except kustomize.KustomizeError as err:
            report.problems.append(f"{where}: does not render: {err}")
            continue
        report.extend(check_objects(objects, where))
    for dockerfile in sorted(DOCKERFILES.glob("*.Dockerfile")):
        report.extend(check_dockerfile(dockerfile))
    report.extend(check_healthcheck())
    return report


def check_healthcheck() -> Report:
    """llmesh-healthcheck (deploy/docker/healthcheck.py) must know every tier's service."""
    from deploy.docker import healthcheck  # type: ignore[attr-defined]

    report = Report()
    for tier in TIERS:
        if healthcheck.SERVICES.get(tier) != readiness_service(tier):
            report.problems.append(f"deploy/docker/healthcheck.py: {tier} readiness service is "
                                   f"{healthcheck.SERVICES.get(tier)!r}, not {readiness_service(tier)!r}")
        cls = settings_class(tier)
        if cls is not None and healthcheck.DEFAULT_PORTS.get(tier) != cls.model_fields["port"].default:
            report.problems.append(f"deploy/docker/healthcheck.py: {tier} default port differs from "
                                   f"{cls.__name__}.port")
    return report


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m deploy.tools.consistency",
        description="Check deploy/ (manifests, Dockerfiles, mesh config) against the tiers' code.",
    ).parse_args(argv)
    report = check_all()
    for problem in report.problems:
        print(problem)
    if report.unchecked:
        print(f"not checked (tier code missing): {', '.join(sorted(report.unchecked))}")
    print(f"{len(report.problems)} problem(s)")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())

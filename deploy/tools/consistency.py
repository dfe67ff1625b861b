"""Check that deploy/ agrees with the code it deploys.

Pydantic settings ignore unknown environment variables and a manifest can carry any
string as a flag, so drift between the manifests and the tiers is silent at render time
and fatal at rollout. This module makes it loud:

- every container that runs ``llmesh <tier>`` names a command in ``llmesh.cli.COMMANDS``;
  its arguments are parsed by that tier's own argparse parser and turned into the tier's
  settings object (so unknown flags, bad values and malformed JSON all fail here), and
  every ``LLMESH_*`` variable it sets is a field of that tier's settings class;
- the server listens on the pod network (host 0.0.0.0) on the container's ``grpc`` port,
  with metrics on its ``metrics`` port;
- gRPC probes use that port: liveness asks for service "" and readiness for the tier's
  full service name, read from the generated proto descriptors;
- every Service's selector matches a workload and its target ports exist; every HPA
  scales an existing workload;
- the mesh config in the ``llmesh-config`` ConfigMap (``llmesh.meshconfig`` schema)
  matches what the Deployments run: model, ports, replicas, zone ladder, worker pools and
  their engine settings, TLS, and the router's DNS targets resolve to headless Services;
- Dockerfiles' ``ENTRYPOINT`` runs ``llmesh <tier>`` for a known tier and their
  ``LLMESH_*`` variables exist.

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from deploy.tools import render

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
            found.append(Invocation(cname, tier, rest, env, container, obj))
    return found


def check_invocation(inv: Invocation, report: Report) -> None:
    cls = settings_class(inv.tier)
    if cls is None:
        report.unchecked.add(inv.tier)
        return
    for name in inv.env:
        if name.startswith("LLMESH_") and name not in GLOBAL_ENV and env_field(inv.tier, name, cls) is None:
            report.problems.append(f"{inv.where}: env {name} is not a field of {cls.__name__}")
    try:
        inv.settings = build_settings(inv.tier, inv.args, inv.env)
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


# ---------------------------------------------------------------------------- objects


def _selects(selector: dict[str, Any], labels: dict[str, Any]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _template_labels(workload: dict[str, Any]) -> dict[str, Any]:
    template = (workload.get("spec") or {}).get("template") or {}
    return dict((template.get("metadata") or {}).get("labels") or {})


def check_wiring(objects: list[dict[str, Any]], where: str, report: Report) -> None:
    workloads = [o for o in objects if o["kind"] in render.WORKLOADS]
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
        for kind, holder, key in render._reference_slots(obj):
            if (kind, holder.get(key)) not in by_name and (kind, holder.get(key)) not in EXTERNAL:
                report.problems.append(f"{where}: {obj['kind']}/{obj['metadata']['name']} refers to "
                                       f"{kind}/{holder.get(key)}, which is not in the manifests")
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"].get("matchLabels") or {}
        if not any(_selects(selector, _template_labels(w)) for w in workloads):
            report.problems.append(f"{where}: PDB/{pdb['metadata']['name']} selects no workload")


def _scale_floor(objects: list[dict[str, Any]], workload: dict[str, Any]) -> int:
    """The replicas a workload keeps at least: its HPA's minReplicas, else spec.replicas."""
    for hpa in (o for o in objects if o["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) == (workload["kind"], workload["metadata"]["name"]):
            return int(hpa["spec"].get("minReplicas", 1))
    return int(workload["spec"].get("replicas", 1))


def _mesh_config(objects: list[dict[str, Any]], where: str, report: Report) -> Any | None:
    from llmesh.meshconfig import MeshConfig

    maps = [o for o in objects if o["kind"] == "ConfigMap"
            and o["metadata"]["name"].startswith("llmesh-config") and "llmesh.yaml" in (o.get("data") or {})]
    if len(maps) != 1:
        report.problems.append(f"{where}: expected one llmesh-config ConfigMap with llmesh.yaml, "
                               f"found {len(maps)}")
        return None
    try:
        return MeshConfig.model_validate(yaml.safe_load(maps[0]["data"]["llmesh.yaml"]) or {})
    except ValueError as err:
        report.problems.append(f"{where}: llmesh.yaml does not follow llmesh.meshconfig: {err}")
        return None


def _settings_differ(settings: Any, wanted: dict[str, Any]) -> list[str]:
    differences = []
    for key, value in wanted.items():
        actual = getattr(settings, key, None)
        if isinstance(actual, tuple):
            actual = list(actual)
        if actual != value:
            differences.append(f"{key}={actual!r} (config says {value!r})")
    return differences


def check_config(
    objects: list[dict[str, Any]], runs: list[Invocation], where: str, report: Report
) -> None:
    config = _mesh_config(objects, where, report)
    if config is None or any(inv.settings is None for inv in runs):
        return
    by_tier: dict[str, list[Invocation]] = {}
    for inv in runs:
        by_tier.setdefault(inv.tier, []).append(inv)
    served = config.served_model_name or Path(config.model).name

    for tier in ("gateway", "tokenizer", "postprocessor", "router"):
        if len(by_tier.get(tier, [])) != 1:
            count = len(by_tier.get(tier, []))
            report.problems.append(f"{where}: expected one {tier} Deployment, found {count}")
            continue
        inv = by_tier[tier][0]
        tier_config = getattr(config, tier)
        floor = _scale_floor(objects, inv.workload)
        if tier != "gateway" and floor != tier_config.replicas:
            report.problems.append(
                f"{inv.where}: minimum replicas {floor}, config says {tier_config.replicas}"
            )
        for diff in _settings_differ(inv.settings, dict(tier_config.settings)):
            report.problems.append(f"{inv.where}: {diff}")
        if bool(inv.settings.tls_cert) != config.tls.enabled:
            report.problems.append(f"{inv.where}: TLS {'on' if inv.settings.tls_cert else 'off'}, "
                                   f"config tls.enabled={config.tls.enabled}")
        elif config.tls.enabled:
            certs_dir = config.tls.certs_dir.rstrip("/") + "/"
            if config.tls.certs_dir and not inv.settings.tls_cert.startswith(certs_dir):
                report.problems.append(f"{inv.where}: TLS files outside tls.certs_dir {certs_dir}")
            if bool(inv.settings.tls_client_ca) != config.tls.mutual:
                report.problems.append(
                    f"{inv.where}: mutual TLS does not match tls.mutual={config.tls.mutual}"
                )
        if tier in ("tokenizer", "postprocessor"):
            expected = [f"{served}={config.model}"]
            if list(inv.settings.models) != expected:
                report.problems.append(
                    f"{inv.where}: --models={inv.settings.models}, config implies {expected}"
                )

    if by_tier.get("gateway"):
        gw = by_tier["gateway"][0].settings
        wanted = {"host": config.gateway.host, "port": config.gateway.port,
                  "http_port": config.gateway.http_port,
                  "default_filter_mode": config.gateway.default_filter_mode}
        for diff in _settings_differ(gw, wanted):
            report.problems.append(f"{where}: gateway {diff}")
        if gw.http_port >= 0:
            gw_inv = by_tier["gateway"][0]
            ports = {p.get("name"): p.get("containerPort") for p in gw_inv.container.get("ports", [])}
            if ports.get("http") != gw.http_port or gw.http_host not in ("0.0.0.0", "::"):
                report.problems.append(f"{gw_inv.where}: HTTP listener {gw.http_host}:{gw.http_port} "
                                       f"is not the container's http port {ports.get('http')}")
        if gw.default_model != served:
            report.problems.append(f"{where}: gateway --default-model={gw.default_model}, model is {served}")

    workers = by_tier.get("worker", [])
    if by_tier.get("router"):
        router = by_tier["router"][0].settings
        ladder = list(config.router.zones) or list(dict.fromkeys(w.zone for w in config.workers))
        if list(router.zones) != ladder:
            report.problems.append(f"{where}: router --zones={router.zones}, config ladder {ladder}")
        if list(router.degraded_zones) != list(config.router.degraded_zones):
            report.problems.append(f"{where}: router --degraded-zones={router.degraded_zones}, "
                                   f"config {config.router.degraded_zones}")
        _check_dns_targets(objects, router, workers, where, report)

    pools: dict[tuple[str, str], Invocation | None] = {
        (w.settings.zone, w.settings.device): w for w in workers
    }
    for entry in config.workers:
        pool = pools.pop((entry.zone, entry.device), None)
        if pool is None:
            report.problems.append(f"{where}: config worker zone={entry.zone} device={entry.device} "
                                   "has no Deployment")
            continue
        model = entry.model or config.model
        wanted = {"model": model, "served_model_name": served, **entry.settings}
        if entry.cpu_omp_threads_bind:
            wanted["cpu_omp_threads_bind"] = entry.cpu_omp_threads_bind
        for diff in _settings_differ(pool.settings, wanted):
            report.problems.append(f"{pool.where}: {diff}")
        if bool(pool.settings.tls_cert) != config.tls.enabled:
            report.problems.append(f"{pool.where}: TLS does not match tls.enabled={config.tls.enabled}")
    for (zone, device), left in pools.items():
        if left is not None:
            report.problems.append(f"{left.where}: worker {zone}/{device} is not in the config")


def _check_dns_targets(
    objects: list[dict[str, Any]], router: Any, workers: list[Invocation], where: str, report: Report
) -> None:
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    covered = set()
    for target in router.dns_targets:
        host, _, port = target.name.rpartition(":")
        host = host.removeprefix("dns:///").split(".")[0]
        svc = services.get(host)
        if svc is None or svc["spec"].get("clusterIP") != "None":
            report.problems.append(f"{where}: router DNS target {target.name} is not a headless Service")
            continue
        if not any(str(p.get("port")) == port for p in svc["spec"].get("ports", [])):
            report.problems.append(f"{where}: router DNS target {target.name}: Service has no port {port}")
        selected = [w for w in workers if _selects(svc["spec"].get("selector") or {},
                                                   w.workload["spec"]["template"]["metadata"]["labels"])]
        if not selected:
            report.problems.append(f"{where}: router DNS target {target.name} selects no worker")
        for w in selected:
            covered.add(id(w))
            if (w.settings.zone, w.settings.device) != (target.zone, target.device):
                report.problems.append(
                    f"{where}: router DNS target {target.name} says zone={target.zone} "
                    f"device={target.device}, its pods run {w.settings.zone}/{w.settings.device}"
                )
            if str(w.settings.port) != port:
                report.problems.append(
                    f"{where}: router DNS target {target.name}: workers listen on {w.settings.port}"
                )
        if target.zone not in router.zones:
            report.problems.append(f"{where}: router DNS target zone {target.zone} is not on the ladder")
    for w in workers:
        if id(w) not in covered:
            report.problems.append(f"{w.where}: no router DNS target reaches this worker pool")


def check_objects(objects: list[dict[str, Any]], where: str) -> Report:
    """Every check on one rendered overlay."""
    report = Report()
    runs = invocations(objects, where, report)
    for inv in runs:
        check_invocation(inv, report)
    check_wiring(objects, where, report)
    if not report.unchecked:
        check_config(objects, runs, where, report)
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
    return sorted(p for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


def check_all() -> Report:
    report = Report()
    for overlay in overlay_dirs():
        where = str(overlay.relative_to(REPO))
        try:
            objects = render.build(overlay)
        except render.RenderError as err:
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

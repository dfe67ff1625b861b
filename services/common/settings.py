"""Settings: one frozen pydantic-settings object per tier.

Every field carries a docstring under it; that text becomes the ``--help`` of the
derived CLI flag. Precedence: CLI flag > environment (``LLMESH_<TIER>_<FIELD>``) >
default. Nothing is parsed at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TlsSettings(BaseModel):
    """TLS material for one endpoint; all paths are PEM files."""

    model_config = {"frozen": True}

    cert: str = ""
    """Certificate chain presented by this side."""
    key: str = ""
    """Private key of ``cert``."""
    ca: str = ""
    """CA bundle used to verify the peer."""


class ServerSettings(BaseSettings):
    """Fields every tier's server shares."""

    model_config = SettingsConfigDict(
        frozen=True, use_attribute_docstrings=True, extra="ignore", env_nested_delimiter="__"
    )

    host: str = "127.0.0.1"
    """Address to bind the gRPC server to."""
    port: int = 0
    """gRPC port; 0 picks a free port (printed at start)."""
    session_port: int = 0
    """Port of the framed Session listener (worker, router, postprocessor, tokenizer: their Session
    method as length-prefixed protobuf frames, with the gRPC port's TLS and caller policy;
    callers find it through the gRPC port); 0 picks a free port, -1 serves Session over
    gRPC only. The other tiers have no Session and ignore it."""
    metrics_port: int = -1
    """Prometheus /metrics port; 0 picks a free port, -1 disables it."""
    tls_cert: str = ""
    """Server certificate (PEM). Empty serves plaintext."""
    tls_key: str = ""
    """Server private key (PEM)."""
    tls_client_ca: str = ""
    """CA (PEM) that client certificates must chain to; set to require mutual TLS."""
    downstream_tls_ca: str = ""
    """CA (PEM) used to verify the servers this process calls; empty calls in plaintext."""
    downstream_tls_cert: str = ""
    """Client certificate (PEM) presented to downstream servers (mutual TLS)."""
    downstream_tls_key: str = ""
    """Client private key (PEM) for downstream calls."""
    authorize_callers: bool = True
    """With mutual TLS (--tls-client-ca), allow each method of an internal tier only to the
    roles its policy names (routers, tokenizers, postprocessors: the gateway; workers: the
    router; read-only introspection also the operator), recognised by a URI SAN of the
    caller's certificate (services/common/authz.py). Health and reflection stay open."""
    caller_identities: dict[str, list[str]] = Field(default_factory=dict)
    """Identities (certificate URI SANs, e.g. SPIFFE IDs) per caller role (gateway, router,
    operator, ...); a role not named keeps spiffe://llmesh.local/tier/<role>
    (operator: spiffe://llmesh.local/operator), as issued by `llmesh certs`."""
    grace_seconds: float = 5.0
    """On SIGTERM, how long in-flight calls may take to finish before they are cancelled."""
    drain_seconds: float = 1.0
    """On SIGTERM, how long to keep serving while reporting NOT_SERVING, so callers move away."""
    processes: int = Field(default=1, ge=1)
    """Processes serving this tier's port together (SO_REUSEPORT), forked by a supervisor
    that forwards SIGTERM and restarts nothing; each serves /metrics on --metrics-port +
    its index. Gateway, tokenizer and postprocessor only (services/common/processes.py)."""
    latency_slice_us: int = Field(default=300, ge=0, le=100_000)
    """Scheduler slice (µs) the process asks Linux for once warmed up (EEVDF,
    ``sched_attr.sched_runtime``, kernel 6.12 or later; no privilege needed): a tier woken
    on a core the engine keeps busy then runs at once instead of after the engine's slice
    (1.4 ms on 2 CPUs), hop by hop of a request's way (services/common/schedslice.py).
    0 keeps the kernel's default. A worker's engine processes keep the default."""
    latency_nice: int = Field(default=-10, ge=-20, le=0)
    """Nice value the process's threads ask for with the slice, once warmed up: below 0 a
    tier's short bursts of work come before an engine's compute on a shared core, so a
    reply is not preempted half-way by the engine's next step. Needs CAP_SYS_NICE (root,
    or the capability granted); without it the process logs it and keeps its nice. 0
    keeps the nice the process started with. A worker's engine processes keep theirs."""
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """Event loop of the process: uvloop (the loop vLLM's own server runs on; less CPU per
    message) or asyncio (the standard library's). Without uvloop installed: asyncio."""
    log_level: str = "INFO"
    """Log level (DEBUG, INFO, WARNING, ERROR). Prompt and output text never log at INFO."""
    log_format: str = "json"
    """Log format: json (one object per line) or text."""
    service_name: str = ""
    """OpenTelemetry service.name; empty uses OTEL_SERVICE_NAME or llmesh-<tier>."""
    mesh_config: str = ""
    """Mesh config file (llmesh.yaml, the schema `llmesh up --config` reads) to take this
    tier's settings from: model, peers' addresses, zone ladder, the worker entry of this
    --zone/--device, and the tier's `settings:`. Flags and environment variables override it."""

    @field_validator("caller_identities", mode="before")
    @classmethod
    def _one_identity_is_a_list(cls, value: Any) -> Any:
        # {"gateway": "spiffe://..."} is the common case; accept it for a one-item list.
        if isinstance(value, dict):
            return {role: [ids] if isinstance(ids, str) else ids for role, ids in value.items()}
        return value

    @property
    def mutual_tls(self) -> bool:
        """The server requires client certificates (so callers have an identity)."""
        return bool(self.tls_cert and self.tls_client_ca)

    @property
    def server_tls(self) -> TlsSettings | None:
        if not self.tls_cert:
            return None
        return TlsSettings(cert=self.tls_cert, key=self.tls_key, ca=self.tls_client_ca)

    @property
    def client_tls(self) -> TlsSettings | None:
        if not self.downstream_tls_ca:
            return None
        return TlsSettings(
            cert=self.downstream_tls_cert, key=self.downstream_tls_key, ca=self.downstream_tls_ca
        )


S = TypeVar("S", bound=BaseSettings)

_SCALARS = (str, int, float)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one flag per settings field, with the field's docstring as help."""
    prefix = cls.model_config.get("env_prefix", "")
    for name, info in cls.model_fields.items():
        annotation = _unwrap_optional(info.annotation)
        env = f"{prefix}{name}".upper()
        default = info.default if info.default is not None else ""
        help_text = f"{info.description or ''} [env {env}; default {default!r}]"
        help_text = help_text.replace("%", "%%")
        if annotation is bool:
            parser.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction,
                default=None, help=help_text,
            )
        elif annotation in _SCALARS:
            parser.add_argument(
                _flag(name), dest=name, type=annotation, default=None, help=help_text,
                metavar=name.upper(),
            )
        else:
            parser.add_argument(
                _flag(name), dest=name, type=str, default=None, metavar="JSON",
                help=help_text + " (JSON, or comma-separated for lists of strings)",
            )


def _parse_complex(value: str, annotation: Any) -> Any:
    text = value.strip()
    if text[:1] in "[{\"" or text in ("null", "true", "false") or text[:1].isdigit():
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def settings_from_args(cls: type[S], args: argparse.Namespace, **overrides: Any) -> S:
    """Build settings: explicit CLI values win over the environment, the environment over
    the mesh config (``--mesh-config``), and that over the defaults."""
    values: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        annotation = _unwrap_optional(info.annotation)
        if isinstance(value, str) and annotation not in _SCALARS:
            value = _parse_complex(value, annotation)
        values[name] = value
    values.update(overrides)
    if "mesh_config" in cls.model_fields:
        path = values.get("mesh_config") or _env_value(cls, "mesh_config")
        if path:
            from_mesh = mesh_values(cls, load_mesh(path), values)
            in_env = {name for name in from_mesh if _env_value(cls, name) is not None}
            values = {**{k: v for k, v in from_mesh.items() if k not in in_env}, **values}
    return cls(**values)


# ---------------------------------------------------------------------------- mesh config
# One file, llmesh.yaml (llmesh.meshconfig.MeshConfig, the schema `llmesh up` reads), says
# what the mesh is; every tier takes its part of it with --mesh-config. In Kubernetes the
# file is the llmesh-config ConfigMap and Deployment arguments say only who a pod is (its
# tier, and a worker's zone and device) and how its pod is wired (ports, mounted files).


def tier_of(cls: type[BaseSettings]) -> str:
    """The tier a settings class belongs to, from its env prefix (LLMESH_<TIER>_)."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    return prefix.removeprefix("LLMESH_").rstrip("_").lower()


def _env_value(cls: type[BaseSettings], name: str) -> str | None:
    """The environment variable that sets field ``name`` (or a nested key of it), if any."""
    wanted = f"{cls.model_config.get('env_prefix', '')}{name}".upper()
    for key, value in os.environ.items():
        upper = key.upper()
        if upper == wanted or upper.startswith(wanted + "__"):
            return value
    return None


def load_mesh(path: str) -> Any:
    """The mesh config at ``path`` (a clear ValueError naming the file when it is wrong)."""
    from llmesh.meshconfig import load_mesh_config

    try:
        return load_mesh_config(Path(path).expanduser())
    except OSError as exc:
        raise ValueError(f"mesh config {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # yaml errors and pydantic.ValidationError
        raise ValueError(f"mesh config {path}: {exc}") from exc


def _model_dir(spec: str) -> str:
    """A model the mesh config names: a name `llmesh model` knows, or a directory."""
    from llmesh.models import MODELS, model_path

    return str(model_path(spec)) if spec in MODELS else spec


def mesh_values(cls: type[BaseSettings], config: Any, explicit: dict[str, Any]) -> dict[str, Any]:
    """The settings of ``cls``'s tier that the mesh config determines, as `llmesh up` would
    pass them (``explicit`` are the values set by flags: a worker's zone and device choose
    its ``workers:`` entry). Fields the tier does not have are left out."""
    from services.common.modelinfo import served_model_name

    tier = tier_of(cls)
    model = _model_dir(config.model)
    served = served_model_name(model, config.served_model_name)
    values: dict[str, Any] = {}
    if tier == "gateway":
        gw = config.gateway
        values.update(host=gw.host, port=gw.port, http_port=gw.http_port, http_host=gw.host,
                      default_filter_mode=gw.default_filter_mode, default_model=served)
        if gw.audit_log:
            values["audit_log"] = gw.audit_log
        for name in ("tokenizer", "router", "postprocessor"):
            if getattr(config, name).address:
                values[f"{name}_targets"] = [getattr(config, name).address]
        values["local_models"] = [f"{served}={model}"]  # the in-process tiers (transport local)
        if gw.settings.get("router_transport") == "local":
            # The in-process router takes what a router of this mesh would.
            from services.router.settings import RouterSettings

            router = mesh_values(RouterSettings, config, {})
            if gw.settings.get("tokenizer_transport") == "local":
                router.setdefault("tokenizer_models", [f"{served}={model}"])
            values["local_router"] = router
        values.update(gw.settings)
    elif tier in ("tokenizer", "postprocessor"):
        values["models"] = [f"{served}={model}"]
        values.update(getattr(config, tier).settings)
    elif tier == "router":
        router = config.router
        values.update(
            zones=list(router.zones) or list(dict.fromkeys(w.zone for w in config.workers)),
            degraded_zones=list(router.degraded_zones),
            default_model=served,
            dns_targets=[{"name": w.address, "zone": w.zone, "device": w.device}
                         for w in config.workers if w.address],
        )
        if config.tokenizer.address:
            values["tokenizer_target"] = config.tokenizer.address
        values.update(router.settings)
    elif tier == "worker":
        entry = _worker_entry(config, explicit)
        settings = dict(entry.settings)
        engine_args = {**settings.pop("engine_args", {}), **entry.engine_args}
        values.update(model=_model_dir(entry.model) if entry.model else model,
                      served_model_name=served, zone=entry.zone, device=entry.device,
                      engine=entry.engine, **settings)
        if engine_args:
            values["engine_args"] = engine_args
        if entry.cpu_omp_threads_bind:
            values["cpu_omp_threads_bind"] = entry.cpu_omp_threads_bind
    return {k: v for k, v in values.items() if k in cls.model_fields}


def _worker_entry(config: Any, explicit: dict[str, Any]) -> Any:
    """The ``workers:`` entry of this worker: the one with its --zone (and --device)."""
    zone = explicit.get("zone") or os.environ.get("LLMESH_WORKER_ZONE", "")
    device = explicit.get("device") or os.environ.get("LLMESH_WORKER_DEVICE", "")
    found = [w for w in config.workers
             if (not zone or w.zone == zone) and (device in ("", "auto") or w.device == device)]
    if len(found) == 1:
        return found[0]
    who = f"zone={zone or '(any)'} device={device or '(any)'}"
    listed = ", ".join(f"{w.zone}/{w.device}" for w in config.workers) or "none"
    if not found:
        raise ValueError(f"mesh config has no workers: entry for {who} (entries: {listed})")
    raise ValueError(f"mesh config has {len(found)} workers: entries for {who}; "
                     "give --zone and --device to choose one")

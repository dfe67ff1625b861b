"""The configuration schema of a whole mesh, shared by ``llmesh up`` and the Kubernetes ConfigMaps.

A YAML file; every key is optional::

    model: smollm2-135m-instruct      # a name `llmesh model` knows, or a model directory
    served_model_name: ""             # id clients use (default: the directory name)
    gateway: {host: 127.0.0.1, port: 50051, http_port: 8080, default_filter_mode: off, processes: 1,
              audit_log: "", settings: {...}}          # settings: any GatewaySettings field
    tokenizer: {replicas: 1, settings: {...}, address: ""}  # address: for --mesh-config
    postprocessor: {replicas: 1, processes: 1, settings: {...}}  # processes: per replica, one port
    router: {replicas: 1, zones: [zone-a, zone-b, kunpeng], degraded_zones: [kunpeng],
             settings: {...}}
    workers:                          # one process each
      - {zone: zone-a, device: cpu, engine: vllm, cpu_omp_threads_bind: "0", address: "",
         settings: {max_num_seqs: 32, ...},              # any WorkerSettings field
         engine_args: {kv_cache_dtype: fp8, ...}}        # any other vLLM EngineArgs field
    tls: {enabled: false, mutual: true, certs_dir: ""}  # certs from `llmesh certs`, one per tier
    tenants:                          # API keys are stored only as SHA-256
      - {name: demo, key_sha256: <hex>, requests_per_minute: 30, tokens_per_minute: 0,
         filter_mode: redact}
    otel: {exporter: none, endpoint: ""}

Each tier also reads its part of this file itself: ``llmesh <tier> --mesh-config FILE``
(services/common/settings.py ``mesh_values``), as the Kubernetes Deployments do with the
llmesh-config ConfigMap; a worker takes the ``workers:`` entry of its --zone/--device, and
explicit flags override the file. ``tls``, ``tenants`` and ``otel`` are `llmesh up`'s only
(in Kubernetes they are the tls component's flags, a Secret and the environment).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TierConfig(_Strict):
    replicas: int = 1
    """How many processes of this tier to start."""
    processes: int = Field(default=1, ge=1)
    """Processes per replica sharing its port (SO_REUSEPORT, the tier's --processes):
    tokenizer and postprocessor, and the gateway. Each uses one core."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Extra settings passed as flags (any field of the tier's settings class)."""
    address: str = ""
    """Where callers reach this tier when it runs outside `llmesh up` (which dials the
    processes it starts), e.g. dns:///llmesh-tokenizer:50061 for a headless Service: the
    gateway (and, for the tokenizer, the router) dial it when started with --mesh-config."""


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8080
    """OpenAI-compatible HTTP port (on ``host``); -1 disables it. Test meshes that run side by
    side must set -1 or a free port, or they all compete for 8080."""
    default_filter_mode: str = "off"
    audit_log: str = ""
    processes: int = Field(default=1, ge=1)
    """Gateway processes sharing ``port`` and ``http_port`` (SO_REUSEPORT, --processes)."""
    settings: dict[str, Any] = Field(default_factory=dict)


class RouterConfig(TierConfig):
    processes: int = Field(default=1, ge=1, le=1)
    """Always 1: a router's admission queue and breakers are one process's state."""
    zones: list[str] = Field(default_factory=list)
    """Zone ladder, best first; empty means the workers' zones in order of appearance."""
    degraded_zones: list[str] = Field(default_factory=list)


class WorkerConfig(_Strict):
    zone: str = "zone-a"
    device: str = "cpu"
    engine: str = "vllm"
    """vllm, or fake (a deterministic test engine)."""
    cpu_omp_threads_bind: str = ""
    """Cores for this worker's engine (VLLM_CPU_OMP_THREADS_BIND), e.g. "0" or "0-1"."""
    model: str = ""
    """Overrides the mesh's model for this worker."""
    address: str = ""
    """host:port whose DNS name resolves to this entry's workers (a headless Service in
    Kubernetes, e.g. llmesh-worker-zone-a:50081): a router started with --mesh-config
    re-resolves it and routes to every address. `llmesh up` dials its own processes."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Any WorkerSettings field, e.g. tensor_parallel_size, data_parallel_size,
    distributed_executor_backend."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Any other vLLM engine argument by its EngineArgs name (the worker's --engine-args);
    the worker refuses an unknown name at start-up."""


class TlsConfig(_Strict):
    enabled: bool = False
    mutual: bool = True
    """Require client certificates on every hop (and from gateway clients). Internal tiers
    then allow callers by certificate identity: each tier serves and dials with its own
    <tier>.pem, clients use client.pem (the gateway only), `llmesh status` operator.pem."""
    certs_dir: str = ""
    """Where ca.pem, <tier>.pem, client.pem, operator.pem ... live (``llmesh certs``);
    empty means ${LLMESH_HOME}/certs."""


class TenantConfig(_Strict):
    name: str
    key_sha256: str
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    filter_mode: str = "off"


class OtelConfig(_Strict):
    exporter: str = ""
    """otlp, console or none; empty keeps the environment's OTEL_TRACES_EXPORTER."""
    endpoint: str = ""


class MeshConfig(_Strict):
    model: str = "smollm2-135m-instruct"
    served_model_name: str = ""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    tokenizer: TierConfig = Field(default_factory=TierConfig)
    postprocessor: TierConfig = Field(default_factory=TierConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    workers: list[WorkerConfig] = Field(default_factory=lambda: [WorkerConfig()])
    tls: TlsConfig = Field(default_factory=TlsConfig)
    tenants: list[TenantConfig] = Field(default_factory=list)
    otel: OtelConfig = Field(default_factory=OtelConfig)


def load_mesh_config(path: str | Path | None) -> MeshConfig:
    if path is None:
        return MeshConfig()
    data = yaml.safe_load(Path(path).read_text()) or {}
    return MeshConfig.model_validate(data)

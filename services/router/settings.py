"""Router settings: one frozen object, env prefix ``LLMESH_ROUTER_``, flags derived from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic_settings import SettingsConfigDict

from services.common.retry import RetryPolicy
from services.common.settings import ServerSettings


class WorkerSpec(BaseModel):
    """One statically configured worker."""

    model_config = {"frozen": True, "extra": "forbid"}

    address: str
    """host:port of the worker's WorkerService."""
    zone: str = ""
    """Zone label; empty takes the zone the worker reports in GetModelInfo."""
    device: str = ""
    """Device label (cuda, npu, cpu); empty takes the worker's own report."""
    models: list[str] = Field(default_factory=list)
    """Models served; empty takes the model the worker reports."""
    worker_id: str = ""
    """Stable id; empty takes the worker's reported id, else the address."""


class DnsTarget(BaseModel):
    """A DNS name (e.g. a Kubernetes headless service) re-resolved periodically."""

    model_config = {"frozen": True, "extra": "forbid"}

    name: str
    """host:port; every address the host resolves to becomes one worker."""
    zone: str = ""
    """Zone of every worker behind this name."""
    device: str = ""
    """Device of every worker behind this name."""
    models: list[str] = Field(default_factory=list)
    """Models served; empty takes the model each worker reports."""


class RouterSettings(ServerSettings):
    """Settings of ``llmesh router``."""

    model_config = SettingsConfigDict(
        env_prefix="LLMESH_ROUTER_",
        frozen=True,
        use_attribute_docstrings=True,
        extra="ignore",
        env_nested_delimiter="__",
    )

    port: int = 50053
    """gRPC port of the RouterService; 0 picks a free port."""
    workers: list[WorkerSpec] = Field(default_factory=list)
    """Static workers: JSON list of {address, zone, device, models, worker_id}."""
    workers_file: str = ""
    """YAML or JSON file with a list of workers (same shape as --workers), added to them."""
    dns_targets: list[DnsTarget] = Field(default_factory=list)
    """DNS names re-resolved every dns_interval_s: JSON list of {name: "host:port", zone, device}."""
    dns_interval_s: float = 5.0
    """Seconds between DNS re-resolutions of dns_targets."""
    zones: list[str] = Field(default_factory=lambda: ["zone-a", "zone-b", "kunpeng"])
    """Zone ladder, best first; a request goes to the first zone with a routable worker."""
    degraded_zones: list[str] = Field(default_factory=lambda: ["kunpeng"])
    """Zones whose service counts as degraded (served_by.degraded=true)."""
    default_model: str = ""
    """Model used when a request names none; empty takes the first model a worker reports."""
    model_checksums: dict[str, str] = Field(default_factory=dict)
    """Expected tokenizer checksum per model (JSON object model -> sha256:...)."""
    tokenizer_target: str = ""
    """Tokenizer tier address; its ListModels supplies expected tokenizer checksums."""
    tokenizer_models: list[str] = []
    """Without tokenizer_target: models (``name=dir``) whose tokenizer files give the
    expected checksums, read here (a mesh whose gateway tokenizes in its own process,
    tokenizer_transport local, has no tokenizer tier to ask)."""
    load_interval_ms: int = 150
    """Milliseconds between the load reports each worker streams (WatchLoad); after a
    session frame carried the load, or after a report of an idle worker, the next report
    waits load_timeout_ms less this (at least this), so steps a little longer than the
    interval need no report between them and an idle worker reports less often."""
    load_timeout_ms: int = 400
    """A worker whose latest load report is older than this is marked unreachable (a
    missed poll); another one is counted after every further load_timeout_ms of silence."""
    load_failures_to_eject: int = 1
    """Consecutive missed load polls (reports late by load_timeout_ms, or a broken
    WatchLoad stream) after which a worker stops receiving traffic."""
    unreachable_failover_polls: int = 2
    """Consecutive missed load polls after which requests running on a worker resume elsewhere."""
    worker_transport: Literal["calls", "session"] = "session"
    """How requests reach workers: ``session`` (one long-lived Session per worker: the
    window's submissions share one message and the worker answers with one frame per engine
    step for every request) or ``calls`` (a Generate or GenerateBatch call per batching
    window, one message per token per request; for workers that do not implement Session)."""
    breaker_failures: int = Field(default=3, ge=2)
    """Consecutive transport failures of requests that open the circuit of a worker that
    still answers its health watch and load polls (at least 2: one failure of an answering
    worker is not enough). A worker that stops answering leaves routing at once anyway."""
    breaker_base_backoff_s: float = 0.5
    """Open-circuit time after the first trip; doubles on every failed half-open trial."""
    breaker_max_backoff_s: float = 30.0
    """Upper bound of the open-circuit time."""
    worker_capacity: int = 0
    """Requests the router keeps in flight per worker; 0 uses the worker's max_num_seqs."""
    max_queue: int = Field(default=64, ge=0)
    """Requests that may wait for a worker slot, all priorities together; beyond it an
    arrival is refused with RESOURCE_EXHAUSTED, unless it outranks a waiter (then the
    newest lowest-priority waiter is refused instead). Higher ``priority`` is served first."""
    tenant_queue_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """Fraction of max_queue one tenant's waiting requests may take (at least 1), so one
    tenant cannot fill the queue; callers that send no tenant count as one tenant."""
    queue_timeout_s: float = Field(default=30.0, ge=0.0)
    """Longest wait for a worker slot: a queued request still waiting after it fails with
    RESOURCE_EXHAUSTED, and one whose expected wait (queue position / measured drain rate)
    exceeds it, or exceeds its remaining deadline less one service time, is refused at
    once with a RetryInfo of that expected wait. 0 leaves only the deadline."""
    queue_wait_margin: float = Field(default=0.2, ge=0.0)
    """Fraction added to a request's expected wait before it is held against its deadline,
    for the estimate's error (the drain rate lags when service slows down with load)."""
    drain_window: int = Field(default=32, ge=1)
    """Recent slot releases whose mean hold time gives the drain rate (held slots / mean)."""
    resume_mode: Literal["replay", "prefill"] = "replay"
    """How a stream resumes on another worker after tokens were delivered: ``replay``
    sends the original prompt plus the delivered tokens as forced decode steps (a greedy
    run then equals an undisturbed one exactly; costs one decode step per delivered
    token), ``prefill`` appends them to the prompt (faster; vLLM's prefill kernels may
    round differently, so a long greedy continuation can drift)."""
    max_retries: int = Field(default=3, ge=0)
    """Further attempts (other workers) after a failure, before or after the first token
    (retries and resumes together; services/common/retry.py)."""
    retry_base_backoff_ms: float = Field(default=20.0, ge=0.0)
    """Base of the exponential backoff between attempts (full jitter: the pause after the
    n-th failure is uniform between 0 and base x 2^(n-1)); a pause that would reach the
    request's deadline fails it with DEADLINE_EXCEEDED at once."""
    retry_max_backoff_ms: float = Field(default=500.0, ge=0.0)
    """Upper bound of the backoff between attempts."""
    failover_wait_ms: float = Field(default=3000.0, ge=0.0)
    """How long a request that must move (its worker failed) waits for a routable worker
    when none is left, within its deadline, before it fails UNAVAILABLE: a worker that
    missed a load poll while busy comes back, and the accepted request is not lost. A new
    request with no routable worker waits only until failover_wait_ms after a worker of its
    model fell silent (streams open, no reports); otherwise it fails at once."""
    batch_max_wait_ms: float = 5.0
    """Longest batching window under load; 0 turns batching windows off. A window only opens
    behind a dispatch to the same worker: a request that finds none within the last window
    goes at once."""
    batch_max_size: int = 16
    """Most requests in one GenerateBatch call."""
    affinity_prefix_tokens: int = 64
    """Prompt tokens hashed for prefix affinity (rendezvous hashing); 0 disables affinity."""
    affinity_balance_factor: float = 1.5
    """Affinity holds while the preferred worker's load <= factor x least load + slack."""
    affinity_balance_slack: float = 2.0
    """Absolute slack (requests) of the affinity balance bound."""
    kv_weight: float = 1.0
    """Weight of KV-cache usage (0..1) against relative request load when scoring workers."""

    def retry_policy(self) -> RetryPolicy:
        """The retry/resume policy these settings give (the same type as the gateway's)."""
        return RetryPolicy(
            max_failovers=self.max_retries,
            base_backoff_s=self.retry_base_backoff_ms / 1000.0,
            max_backoff_s=self.retry_max_backoff_ms / 1000.0,
            jitter=1.0,
        )

    def all_workers(self) -> list[WorkerSpec]:
        """``workers`` plus the contents of ``workers_file``."""
        specs = list(self.workers)
        if self.workers_file:
            specs += load_workers_file(self.workers_file)
        return specs


def load_workers_file(path: str) -> list[WorkerSpec]:
    """Read a YAML or JSON list of workers (or ``{workers: [...]}``)."""
    text = Path(path).expanduser().read_text()
    data: Any
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            import yaml

            data = yaml.safe_load(text)
    if isinstance(data, dict):
        data = data.get("workers", [])
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of workers")
    return [WorkerSpec.model_validate(item) for item in data]

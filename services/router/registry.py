"""What the router knows about each worker, and the expected tokenizer checksums."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from services.router.breaker import Circuit, CircuitBreaker

log = logging.getLogger(__name__)

# Health strings reported by ListWorkers.
SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
UNKNOWN = "UNKNOWN"
REFUSED = "REFUSED"
UNREACHABLE = "UNREACHABLE"


@dataclass
class Load:
    """A worker's last load report."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    in_flight: int = 0
    max_num_seqs: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """GetModelInfo of a worker."""

    model: str
    tokenizer_checksum: str
    device: str = ""
    zone: str = ""
    worker_id: str = ""
    pid: int = 0
    max_context_length: int = 0
    vocab_size: int = 0


@dataclass
class WorkerState:
    """One worker as the router sees it (mutated only on the event loop)."""

    address: str
    breaker: CircuitBreaker
    zone_label: str = ""
    device_label: str = ""
    models_label: list[str] = field(default_factory=list)
    worker_id_label: str = ""
    source: str = "static"
    info: WorkerInfo | None = None
    health: str = UNKNOWN
    """Last status of the readiness health Watch."""
    reachable: bool = False
    """Whether the last load poll answered in time."""
    load_failures: int = 0
    silent_since: float | None = None
    """Loop time since which a worker whose load stream is still open sent nothing (it
    left routing for that silence); None while it reports or once its stream broke."""
    refused: str = ""
    """Why this worker is refused (tokenizer mismatch); empty when accepted."""
    load: Load = field(default_factory=Load)
    in_flight: int = 0
    """Requests this router has dispatched to the worker and not yet finished."""
    default_capacity: int = 0

    @property
    def zone(self) -> str:
        return self.zone_label or (self.info.zone if self.info else "")

    @property
    def device(self) -> str:
        return self.device_label or (self.info.device if self.info else "")

    @property
    def models(self) -> list[str]:
        if self.models_label:
            return list(self.models_label)
        return [self.info.model] if self.info else []

    @property
    def worker_id(self) -> str:
        return self.worker_id_label or (self.info.worker_id if self.info else "") or self.address

    @property
    def pid(self) -> int:
        return self.info.pid if self.info else 0

    @property
    def capacity(self) -> int:
        """Requests the router keeps in flight here before queueing."""
        if self.default_capacity > 0:
            return self.default_capacity
        return self.load.max_num_seqs or 256

    @property
    def healthy(self) -> bool:
        return (
            not self.refused and self.info is not None and self.health == SERVING and self.reachable
        )

    @property
    def status(self) -> str:
        """The health string ListWorkers shows."""
        if self.refused:
            return REFUSED
        if self.health == SERVING and not self.reachable:
            return UNREACHABLE
        return self.health

    def serves(self, model: str) -> bool:
        return model in self.models

    def routable(self) -> bool:
        """Healthy and its circuit lets a request through."""
        return self.healthy and self.breaker.allows()

    def load_units(self) -> float:
        """Requests on the worker: the router's own in-flight count or the worker's report.

        The worker's report lags by one poll; the router's count misses other routers'
        traffic; the larger of the two is the better estimate.
        """
        reported = self.load.running + self.load.waiting
        return float(max(self.in_flight, reported, self.load.in_flight))

    def has_capacity(self) -> bool:
        return self.in_flight < self.capacity

    def pressure(self) -> float:
        """Load relative to capacity, 0..1+ (drives the batching window)."""
        return self.load_units() / max(1, self.capacity)

    @property
    def circuit(self) -> Circuit:
        return self.breaker.state


class ChecksumBook:
    """Expected tokenizer checksum per model, and where each came from."""

    def __init__(self, configured: dict[str, str] | None = None) -> None:
        self._expected: dict[str, tuple[str, str]] = {
            model: (checksum, "settings") for model, checksum in (configured or {}).items()
        }

    def learn(self, model: str, checksum: str, source: str) -> None:
        """Record an authoritative checksum (settings win over the tokenizer tier)."""
        current = self._expected.get(model)
        if current is not None and current[1] == "settings":
            return
        self._expected[model] = (checksum, source)

    def check(self, model: str, checksum: str, worker: str) -> str:
        """Empty if ``checksum`` is acceptable for ``model``, else the refusal reason.

        With no expectation yet, the first worker seen for a model sets it.
        """
        current = self._expected.get(model)
        if current is None:
            self._expected[model] = (checksum, f"first worker {worker}")
            return ""
        expected, source = current
        if checksum == expected:
            return ""
        return (
            f"tokenizer checksum {checksum} of model {model!r} differs from {expected} "
            f"(expected, from {source})"
        )

    def expected(self, model: str) -> str:
        current = self._expected.get(model)
        return current[0] if current else ""


class Registry:
    """The set of known workers keyed by address."""

    def __init__(self, make_breaker: Callable[[], CircuitBreaker], default_capacity: int = 0) -> None:
        self._make_breaker = make_breaker
        self._default_capacity = default_capacity
        self.workers: dict[str, WorkerState] = {}

    def add(
        self, address: str, *, zone: str = "", device: str = "", models: list[str] | None = None,
        worker_id: str = "", source: str = "static",
    ) -> WorkerState | None:
        """Add a worker; returns None when the address is already known."""
        if address in self.workers:
            return None
        state = WorkerState(
            address=address, breaker=self._make_breaker(), zone_label=zone, device_label=device,
            models_label=list(models or []), worker_id_label=worker_id, source=source,
            default_capacity=self._default_capacity,
        )
        self.workers[address] = state
        return state

    def remove(self, address: str) -> WorkerState | None:
        return self.workers.pop(address, None)

    def from_source(self, source: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.source == source]

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for worker in self.workers.values():
            if not worker.refused:
                for model in worker.models:
                    seen.setdefault(model, None)
        return list(seen)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self.workers.values()))

    def __len__(self) -> int:
        return len(self.workers)

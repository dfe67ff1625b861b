"""Worker choice: zone ladder first, then load, with prefix affinity by rendezvous hashing."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.router.registry import WorkerState


class ZoneLadder:
    """Ordered zones, best first; zones not on the ladder rank after every listed one."""

    def __init__(self, zones: Sequence[str], degraded: Iterable[str] = ()) -> None:
        self.zones = list(zones)
        self.degraded = set(degraded)
        self._rank = {zone: i for i, zone in enumerate(self.zones)}

    def rank(self, zone: str) -> int:
        return self._rank.get(zone, len(self.zones))

    def is_degraded(self, zone: str) -> bool:
        return zone in self.degraded


def prefix_key(prompt_token_ids: Sequence[int], n: int) -> bytes | None:
    """Hash of the first ``n`` prompt tokens: requests sharing it share a KV prefix."""
    if n <= 0 or not prompt_token_ids:
        return None
    head = list(prompt_token_ids[:n])
    return hashlib.blake2b(struct.pack(f"<{len(head)}I", *head), digest_size=16).digest()


def rendezvous_score(key: bytes, worker_id: str) -> int:
    digest = hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_pick(key: bytes, workers: Sequence[WorkerState]) -> WorkerState:
    """Highest-random-weight choice: stable, and moves only 1/n keys when a worker leaves."""
    return max(workers, key=lambda w: (rendezvous_score(key, w.worker_id), w.address))


@dataclass(frozen=True)
class Policy:
    """Tunables of :func:`choose`."""

    balance_factor: float = 1.5
    balance_slack: float = 2.0
    kv_weight: float = 1.0


def score(worker: WorkerState, kv_weight: float) -> float:
    """Lower is better: relative request load plus weighted KV-cache usage."""
    return worker.load_units() / max(1, worker.capacity) + kv_weight * worker.load.kv_cache_usage


@dataclass(frozen=True)
class Choice:
    worker: WorkerState | None
    """The chosen worker, or None when the best zone is full (wait) or nothing serves."""
    zone: str = ""
    routable: bool = False
    """Whether any routable worker serves the model (False means UNAVAILABLE)."""
    affinity: bool = False


def choose(
    workers: Iterable[WorkerState],
    model: str,
    ladder: ZoneLadder,
    key: bytes | None,
    policy: Policy = Policy(),
    exclude: frozenset[str] = frozenset(),
) -> Choice:
    """Pick a worker for one request.

    The best zone on the ladder holding a routable worker for the model wins; the
    router does not spill into a worse zone just because the best one is busy (it queues
    instead), so degraded CPU workers only serve when no accelerator zone can. Workers in
    ``exclude`` (failed earlier for this request) are used only if nothing else is left.
    """
    candidates = [w for w in workers if w.serves(model) and w.routable()]
    if not candidates:
        return Choice(None)
    preferred = [w for w in candidates if w.address not in exclude]
    pool = preferred or candidates
    best_rank = min(ladder.rank(w.zone) for w in pool)
    zone_workers = [w for w in pool if ladder.rank(w.zone) == best_rank]
    zone = zone_workers[0].zone
    free = [w for w in zone_workers if w.has_capacity()]
    if not free:
        return Choice(None, zone=zone, routable=True)
    least = min(free, key=lambda w: (score(w, policy.kv_weight), w.in_flight, w.address))
    if key is not None and len(zone_workers) > 1:
        # Affinity is computed over the whole zone so a key's home does not move when
        # its worker is momentarily full; it is only used while within the balance bound.
        home = rendezvous_pick(key, zone_workers)
        if home in free:
            bound = least.load_units() * policy.balance_factor + policy.balance_slack
            if home.load_units() <= bound:
                return Choice(home, zone=zone, routable=True, affinity=True)
    return Choice(least, zone=zone, routable=True)

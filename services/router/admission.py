"""Admission: one bounded queue in front of worker capacity, refusing early what it cannot serve.

A request takes a worker slot at once when a worker is free and nobody of the same or
higher priority is waiting. Otherwise it may wait, in one queue shared by every priority
(higher ``priority`` first, as ``llmesh.v1.GenerateRequest`` says; first come first
served within a priority), unless one of these refuses it at once with
RESOURCE_EXHAUSTED and a retry hint:

- ``tenant_share``: the caller's tenant already holds its share of the queue, so one
  tenant cannot fill it for everybody;
- ``expected_wait``: the expected wait for its place in the queue (plus ``wait_margin``
  of it, for the estimate's error) and one mean service time exceed what is left of its
  deadline, or the wait alone exceeds ``queue_timeout_s``: it would expire in the queue
  or on the worker, so it is told now, not then;
- ``queue_full``: the queue holds ``max_queue`` requests none of which has a lower
  priority (a higher-priority arrival displaces the newest lowest-priority waiter, which
  is refused with reason ``displaced``).

A waiter that is still queued after ``queue_timeout_s`` is refused (``queue_timeout``);
one whose deadline passes gets DEADLINE_EXCEEDED.

The expected wait comes from the measured drain rate. By Little's law a full set of
slots frees ``held / mean_hold`` slots per second, where ``held`` is the slots this router
holds now and ``mean_hold`` the mean time a slot was held over the last ``window``
releases (dispatch to release, so queueing time is not counted). The n-th place in the
queue then waits about ``n / rate``; the retry hint of a refusal is that wait, so it
tells the caller when the queue ahead of it will have drained. Until the first release
the rate is unknown and only the bounds and timeouts refuse.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from services.common.errors import DeadlineExceeded, ResourceExhausted, Unavailable

T = TypeVar("T")

RefusalReason = Literal["tenant_share", "expected_wait", "queue_full", "displaced", "queue_timeout"]

MIN_RETRY_S = 0.1
MAX_RETRY_S = 300.0
UNKNOWN_RETRY_S = 1.0
"""Retry hint before any slot was released (no drain rate measured yet)."""


class NoCapacity(Exception):
    """Raised by a pick function when workers exist but all are full."""


@dataclass(eq=False)
class _Waiter(Generic[T]):
    priority: int
    seq: int
    tenant: str
    pick: Callable[[], T]
    future: asyncio.Future[T]
    queued: bool = field(default=True)

    @property
    def order(self) -> tuple[int, int]:
        """Sort key: higher priority first, then arrival order."""
        return (-self.priority, self.seq)


class Admission(Generic[T]):
    def __init__(
        self,
        max_queue: int,
        *,
        tenant_share: float = 1.0,
        queue_timeout_s: float = 0.0,
        wait_margin: float = 0.2,
        window: int = 32,
        clock: Callable[[], float] = time.monotonic,
        on_depth: Callable[[int, int], None] | None = None,
        on_refuse: Callable[[RefusalReason], None] | None = None,
    ) -> None:
        self.max_queue = max(0, max_queue)
        self.tenant_limit = max(1, int(tenant_share * self.max_queue))
        """Most requests one tenant may have waiting."""
        self.queue_timeout_s = queue_timeout_s
        """Longest wait in the queue; 0 = bounded by the deadline only."""
        self.wait_margin = max(0.0, wait_margin)
        """Fraction added to an expected wait before it is held against the deadline."""
        self._clock = clock
        self._on_depth = on_depth
        """Called with (priority, depth) whenever a priority's queue depth changes."""
        self._on_refuse = on_refuse
        """Called with the reason of every refusal (for metrics)."""
        self._waiters: list[_Waiter[T]] = []
        """Queued waiters, kept sorted by ``order``."""
        self._depth: dict[int, int] = {}
        self._tenants: collections.Counter[str] = collections.Counter()
        self._seq = itertools.count()
        self._held = 0
        """Slots handed out by this admission and not yet released."""
        self._holds: collections.deque[float] = collections.deque(maxlen=max(1, window))
        """Seconds each of the last ``window`` released slots was held."""

    # ---- observation -----------------------------------------------------------------

    def depth(self, priority: int | None = None) -> int:
        if priority is None:
            return len(self._waiters)
        return self._depth.get(priority, 0)

    def depths(self) -> dict[int, int]:
        return {p: d for p, d in self._depth.items() if d}

    @property
    def held(self) -> int:
        return self._held

    def released(self, held_s: float) -> None:
        """A slot handed out by :meth:`acquire` came back after ``held_s`` seconds.

        Call it once per slot, also for failed attempts: they occupied the slot too.
        """
        self._held = max(0, self._held - 1)
        self._holds.append(max(0.0, held_s))

    def mean_hold_s(self) -> float | None:
        """Mean time a slot was held over the recent window; None before any release."""
        if not self._holds:
            return None
        return sum(self._holds) / len(self._holds)

    def drain_rate(self) -> float | None:
        """Slots freed per second with every held slot busy (Little's law); None if unknown."""
        mean = self.mean_hold_s()
        if mean is None:
            return None
        return max(1, self._held) / max(mean, 1e-3)

    def expected_wait_s(self, position: int) -> float | None:
        """Expected wait of the ``position``-th place in the queue (1 = next)."""
        rate = self.drain_rate()
        return None if rate is None else position / rate

    def retry_after_s(self, position: int) -> float:
        """Retry hint for a request refused at ``position``: when the queue ahead drains."""
        wait = self.expected_wait_s(position)
        if wait is None:
            return UNKNOWN_RETRY_S
        return min(MAX_RETRY_S, max(MIN_RETRY_S, wait))

    def _position(self, priority: int) -> int:
        """Place a new arrival of ``priority`` would take: after everyone of >= priority."""
        return sum(1 for w in self._waiters if w.priority >= priority) + 1

    # ---- admission -------------------------------------------------------------------

    async def acquire(
        self, pick: Callable[[], T], priority: int, deadline: float | None,
        release: Callable[[T], None], *, tenant: str = "",
    ) -> T:
        """Run ``pick`` now or when capacity frees; it raises NoCapacity or Unavailable.

        ``pick`` reserves what it returns; ``release`` gives it back if the waiter is
        cancelled or times out after a slot was already handed to it. ``deadline`` is on
        this admission's clock. Every slot returned must be reported to :meth:`released`.
        """
        position = self._position(priority)
        if position == 1:
            try:
                return self._take(pick)
            except NoCapacity:
                pass
        now = self._clock()
        if self.tenant_limit < self.max_queue and self._tenants[tenant] >= self.tenant_limit:
            self._refuse(
                "tenant_share", position,
                f"tenant {tenant or '(none)'} already has {self._tenants[tenant]} requests "
                f"waiting (its share of the router queue is {self.tenant_limit})",
            )
        wait = self.expected_wait_s(position)
        if wait is not None:
            mean_hold = self.mean_hold_s() or 0.0
            budget = None if deadline is None else deadline - now - mean_hold
            if self.queue_timeout_s > 0 and (budget is None or self.queue_timeout_s < budget):
                budget = self.queue_timeout_s
            if budget is not None and wait * (1.0 + self.wait_margin) > budget:
                self._refuse(
                    "expected_wait", position,
                    f"router overloaded: expected wait {wait:.2f}s at queue position {position} "
                    f"exceeds the request's remaining {max(0.0, budget):.2f}s",
                )
        if len(self._waiters) >= self.max_queue:
            victim = self._displaceable(priority)
            if victim is None:
                self._refuse(
                    "queue_full", position,
                    f"router queue is full ({self.max_queue} waiting at priority >= {priority})",
                )
            else:
                self._displace(victim)
        loop = asyncio.get_running_loop()
        waiter: _Waiter[T] = _Waiter(priority, next(self._seq), tenant, pick, loop.create_future())
        self._enqueue(waiter)
        returned = False
        try:
            limit = None if deadline is None else max(0.0, deadline - now)
            timed_out_by_queue = False
            if self.queue_timeout_s > 0 and (limit is None or self.queue_timeout_s < limit):
                limit = self.queue_timeout_s
                timed_out_by_queue = True
            try:
                result = await asyncio.wait_for(asyncio.shield(waiter.future), limit)
            except TimeoutError:
                if not timed_out_by_queue:
                    raise DeadlineExceeded("deadline passed while waiting for a worker") from None
                self._remove(waiter)
                self._refuse(
                    "queue_timeout", self._position(priority),
                    f"no worker slot within queue_timeout_s={self.queue_timeout_s:g}",
                )
            returned = True
            return result
        finally:
            self._remove(waiter)
            if not waiter.future.done():
                waiter.future.cancel()
            elif not returned and not waiter.future.cancelled() and waiter.future.exception() is None:
                release(waiter.future.result())

    def wake(self) -> None:
        """Capacity or health changed: hand slots to waiters, higher priority first."""
        for waiter in list(self._waiters):
            try:
                result = self._take(waiter.pick)
            except NoCapacity:
                continue
            except Unavailable as exc:
                self._remove(waiter)
                waiter.future.set_exception(exc)
                continue
            self._remove(waiter)
            waiter.future.set_result(result)

    # ---- internals -------------------------------------------------------------------

    def _take(self, pick: Callable[[], T]) -> T:
        result = pick()
        self._held += 1
        return result

    def _refuse(self, reason: RefusalReason, position: int, message: str) -> None:
        if self._on_refuse is not None:
            self._on_refuse(reason)
        raise ResourceExhausted(message, retry_after_s=self.retry_after_s(position))

    def _displaceable(self, priority: int) -> _Waiter[T] | None:
        """The newest waiter of the lowest priority, if that is below ``priority``."""
        if not self._waiters:
            return None
        last = self._waiters[-1]
        return last if last.priority < priority else None

    def _displace(self, victim: _Waiter[T]) -> None:
        position = self._position(victim.priority) - 1
        self._remove(victim)
        if self._on_refuse is not None:
            self._on_refuse("displaced")
        victim.future.set_exception(ResourceExhausted(
            "displaced from the full router queue by a higher-priority request",
            retry_after_s=self.retry_after_s(position),
        ))

    def _enqueue(self, waiter: _Waiter[T]) -> None:
        self._waiters.append(waiter)
        self._waiters.sort(key=lambda w: w.order)
        self._tenants[waiter.tenant] += 1
        self._count(waiter.priority, +1)

    def _remove(self, waiter: _Waiter[T]) -> None:
        if not waiter.queued:
            return
        waiter.queued = False
        self._waiters.remove(waiter)
        self._tenants[waiter.tenant] -= 1
        if self._tenants[waiter.tenant] <= 0:
            del self._tenants[waiter.tenant]
        self._count(waiter.priority, -1)

    def _count(self, priority: int, delta: int) -> None:
        self._depth[priority] = self._depth.get(priority, 0) + delta
        if self._on_depth is not None:
            self._on_depth(priority, self._depth[priority])

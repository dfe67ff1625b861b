"""Admission: bounded per-priority queues in front of worker capacity.

A request takes a worker slot at once when the best zone has a free worker and nobody
of the same or better priority is waiting. Otherwise it waits in its priority class
(lower value = served first, as in vLLM); a full class answers RESOURCE_EXHAUSTED with
a retry hint instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from services.common.errors import DeadlineExceeded, ResourceExhausted, Unavailable

T = TypeVar("T")


class NoCapacity(Exception):
    """Raised by a pick function when workers exist but all are full."""


@dataclass(order=True)
class _Waiter(Generic[T]):
    priority: int
    seq: int
    pick: Callable[[], T] = field(compare=False)
    future: asyncio.Future[T] = field(compare=False)


class Admission(Generic[T]):
    def __init__(
        self, max_queue: int, *, clock: Callable[[], float] = time.monotonic,
        on_depth: Callable[[int, int], None] | None = None,
    ) -> None:
        self.max_queue = max(0, max_queue)
        self._on_depth = on_depth
        """Called with (priority, depth) whenever a class's queue depth changes."""
        self._clock = clock
        self._heap: list[_Waiter[T]] = []
        self._depth: dict[int, int] = {}
        self._seq = itertools.count()
        self._service_s = 1.0
        """Smoothed duration of a request, for the retry hint."""
        self.capacity_hint = 1

    def depth(self, priority: int | None = None) -> int:
        if priority is None:
            return sum(self._depth.values())
        return self._depth.get(priority, 0)

    def depths(self) -> dict[int, int]:
        return {p: d for p, d in self._depth.items() if d}

    def observe_service_time(self, seconds: float) -> None:
        self._service_s += 0.2 * (seconds - self._service_s)

    def retry_after_s(self, priority: int) -> float:
        """Rough time for the queue ahead to drain, bounded to 0.1..10 s."""
        ahead = sum(d for p, d in self._depth.items() if p <= priority) + 1
        estimate = ahead * self._service_s / max(1, self.capacity_hint)
        return min(10.0, max(0.1, estimate))

    def _ahead(self, priority: int) -> bool:
        return any(w.priority <= priority and not w.future.done() for w in self._heap)

    async def acquire(
        self, pick: Callable[[], T], priority: int, deadline: float | None,
        release: Callable[[T], None],
    ) -> T:
        """Run ``pick`` now or when capacity frees; it raises NoCapacity or Unavailable.

        ``pick`` reserves what it returns; ``release`` gives it back if the waiter is
        cancelled or times out after a slot was already handed to it.
        """
        if not self._ahead(priority):
            try:
                return pick()
            except NoCapacity:
                pass
        if self._depth.get(priority, 0) >= self.max_queue:
            raise ResourceExhausted(
                f"router queue for priority {priority} is full ({self.max_queue} waiting)",
                retry_after_s=self.retry_after_s(priority),
            )
        loop = asyncio.get_running_loop()
        waiter: _Waiter[T] = _Waiter(priority, next(self._seq), pick, loop.create_future())
        heapq.heappush(self._heap, waiter)
        self._depth[priority] = self._depth.get(priority, 0) + 1
        if self._on_depth is not None:
            self._on_depth(priority, self._depth[priority])
        returned = False
        try:
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            try:
                result = await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
            except TimeoutError:
                raise DeadlineExceeded("deadline passed while waiting for a worker") from None
            returned = True
            return result
        finally:
            self._depth[priority] -= 1
            if self._on_depth is not None:
                self._on_depth(priority, self._depth[priority])
            if not waiter.future.done():
                waiter.future.cancel()
            elif not returned and not waiter.future.cancelled() and waiter.future.exception() is None:
                release(waiter.future.result())
            self._heap = [w for w in self._heap if w is not waiter]
            heapq.heapify(self._heap)

    def wake(self) -> None:
        """Capacity or health changed: hand slots to waiters in priority order."""
        for waiter in sorted(self._heap):
            if waiter.future.done():
                continue
            try:
                waiter.future.set_result(waiter.pick())
            except NoCapacity:
                continue
            except Unavailable as exc:
                waiter.future.set_exception(exc)

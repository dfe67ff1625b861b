"""Admission as a pure unit: priority order, one bound, tenant shares, timeouts, early refusal.

A fake clock drives the drain-rate arithmetic (deadlines are on it too); the waits
themselves are asyncio's, so the tests that need a waiter to time out use short real
timeouts and everything else waits on conditions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import pytest

from services.common.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from services.router.admission import UNKNOWN_RETRY_S, Admission, NoCapacity, RefusalReason
from tests.router.helpers import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Slots:
    """Worker slots as the router's pick/release pair sees them."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.unavailable = False
        self.adm: Admission[str] | None = None
        self.given = 0

    def pick(self) -> str:
        if self.unavailable:
            raise Unavailable("nothing")
        if self.free <= 0:
            raise NoCapacity()
        self.free -= 1
        self.given += 1
        return f"slot{self.given}"

    def release(self, _: str = "", held_s: float = 1.0) -> None:
        """Give a slot back (after ``held_s``) and let admission hand it on."""
        self.free += 1
        assert self.adm is not None
        self.adm.released(held_s)
        self.adm.wake()


def make(max_queue: int = 8, slots: int = 0, **kwargs) -> tuple[Admission[str], Slots, Clock, list[str]]:  # type: ignore[no-untyped-def]
    clock = Clock()
    refusals: list[RefusalReason] = []
    adm: Admission[str] = Admission(max_queue, clock=clock, on_refuse=refusals.append, **kwargs)
    pool = Slots(slots)
    pool.adm = adm
    return adm, pool, clock, refusals  # type: ignore[return-value]


def queue(adm: Admission[str], pool: Slots, priority: int = 0, *, tenant: str = "",
          deadline: float | None = None) -> asyncio.Future[str]:
    return asyncio.ensure_future(
        adm.acquire(pool.pick, priority, deadline, pool.release, tenant=tenant)
    )


async def refused(call: Awaitable[str]) -> ResourceExhausted:
    """The call fails with ResourceExhausted at once (no waiting in the queue)."""
    start = time.monotonic()
    with pytest.raises(ResourceExhausted) as err:
        await call
    assert time.monotonic() - start < 0.05
    return err.value


async def cancel_all(*tasks: asyncio.Future[str]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def measured(adm: Admission[str], pool: Slots, *, slots: int, hold_s: float) -> None:
    """Give admission a history: ``slots`` slots each held ``hold_s``, then all taken again."""
    pool.free = slots
    taken = [await adm.acquire(pool.pick, 0, None, pool.release) for _ in range(slots)]
    for _ in taken:
        pool.free += 1
        adm.released(hold_s)
    for _ in range(slots):
        await adm.acquire(pool.pick, 0, None, pool.release)
    assert adm.held == slots and pool.free == 0


async def test_higher_priority_first_then_arrival_order() -> None:
    adm, pool, _, _ = make(slots=1)
    assert await adm.acquire(pool.pick, 0, None, pool.release) == "slot1"
    order: list[str] = []

    async def waiter(name: str, priority: int) -> None:
        await adm.acquire(pool.pick, priority, None, pool.release)
        order.append(name)

    names = [("low-a", 0), ("low-b", 0), ("high", 5), ("mid", 2), ("negative", -3)]
    tasks = []
    for name, priority in names:
        tasks.append(asyncio.ensure_future(waiter(name, priority)))
        count = len(tasks)
        await wait_for(lambda count=count: adm.depth() == count)  # type: ignore[misc]
    assert adm.depths() == {0: 2, 5: 1, 2: 1, -3: 1}
    for i in range(len(names)):
        pool.release()
        await wait_for(lambda i=i: len(order) == i + 1)  # type: ignore[misc]
    assert order == ["high", "mid", "low-a", "low-b", "negative"]
    assert adm.depth() == 0
    # Nobody waiting and a slot free: taken at once, whatever the priority.
    pool.release()
    assert await adm.acquire(pool.pick, -10, None, pool.release)
    await asyncio.gather(*tasks)


async def test_a_waiting_higher_priority_is_not_overtaken_by_a_new_arrival() -> None:
    adm, pool, _, _ = make(slots=0)
    high = queue(adm, pool, 5)
    await wait_for(lambda: adm.depth() == 1)
    low = queue(adm, pool, 0)
    await wait_for(lambda: adm.depth() == 2)
    pool.release()
    assert await high == "slot1"
    assert not low.done()
    await cancel_all(low)


async def test_one_bound_across_priorities_and_displacement() -> None:
    adm, pool, _, refusals = make(max_queue=2)
    first = queue(adm, pool, 1)
    second = queue(adm, pool, 2)
    await wait_for(lambda: adm.depth() == 2)
    # Spreading over priorities does not multiply the bound.
    err = await refused(adm.acquire(pool.pick, 1, None, pool.release))
    assert "full" in err.message and err.retry_after_s == UNKNOWN_RETRY_S
    await refused(adm.acquire(pool.pick, 0, None, pool.release))
    assert adm.depth() == 2 and refusals == ["queue_full", "queue_full"]
    # A higher priority displaces the newest lowest-priority waiter.
    third = queue(adm, pool, 3)
    with pytest.raises(ResourceExhausted) as displaced:
        await first
    assert "displaced" in displaced.value.message
    assert adm.depth() == 2 and adm.depths() == {2: 1, 3: 1}
    assert refusals[-1] == "displaced"
    pool.release()
    assert await third == "slot1"
    await cancel_all(second)
    assert adm.depth() == 0


async def test_tenant_share_keeps_one_tenant_from_filling_the_queue() -> None:
    adm, pool, _, refusals = make(max_queue=4, tenant_share=0.5)
    assert adm.tenant_limit == 2
    busy = [queue(adm, pool, tenant="noisy") for _ in range(2)]
    await wait_for(lambda: adm.depth() == 2)
    err = await refused(adm.acquire(pool.pick, 0, None, pool.release, tenant="noisy"))
    assert "noisy" in err.message and refusals == ["tenant_share"]
    # Even a higher priority does not lift a tenant over its share.
    await refused(adm.acquire(pool.pick, 9, None, pool.release, tenant="noisy"))
    quiet = [queue(adm, pool, tenant="quiet") for _ in range(2)]
    await wait_for(lambda: adm.depth() == 4)
    # Once one of the noisy tenant's requests is served, it may queue one more.
    pool.release()
    assert await busy[0] == "slot1"
    again = queue(adm, pool, tenant="noisy")
    await wait_for(lambda: adm.depth() == 4)
    await cancel_all(busy[1], again, *quiet)
    # A share is never below one request.
    tiny = make(max_queue=1, tenant_share=0.1)[0]
    assert tiny.tenant_limit == 1


async def test_queue_timeout_refuses_a_waiter_and_the_deadline_still_wins_when_sooner() -> None:
    adm, pool, clock, refusals = make(queue_timeout_s=0.05)
    start = time.monotonic()
    with pytest.raises(ResourceExhausted) as err:
        await adm.acquire(pool.pick, 0, None, pool.release)
    assert time.monotonic() - start >= 0.05
    assert "queue_timeout_s" in err.value.message and refusals == ["queue_timeout"]
    assert adm.depth() == 0
    with pytest.raises(DeadlineExceeded):
        await adm.acquire(pool.pick, 0, clock() + 0.01, pool.release)
    assert refusals == ["queue_timeout"]


async def test_early_refusal_when_the_expected_wait_exceeds_the_remaining_deadline() -> None:
    adm, pool, clock, refusals = make()
    await measured(adm, pool, slots=2, hold_s=1.0)
    assert adm.drain_rate() == pytest.approx(2.0)  # 2 slots held, 1 s each
    queued = [queue(adm, pool) for _ in range(3)]
    await wait_for(lambda: adm.depth() == 3)
    # 4th in line: waits about 4 / 2 = 2 s (+20 % margin for the estimate's error), then
    # needs about 1 s of service: 3.4 s.
    assert adm.expected_wait_s(4) == pytest.approx(2.0) and adm.wait_margin == 0.2
    err = await refused(adm.acquire(pool.pick, 0, clock() + 3.3, pool.release))
    assert "expected wait" in err.message and refusals == ["expected_wait"]
    assert err.retry_after_s == pytest.approx(2.0)  # the wait itself, no margin
    fits = queue(adm, pool, deadline=clock() + 3.5)
    await wait_for(lambda: adm.depth() == 4)
    # A higher priority goes ahead of all of them, so its short deadline is enough.
    urgent = queue(adm, pool, 7, deadline=clock() + 1.7)
    await wait_for(lambda: adm.depth() == 5)
    pool.release()
    assert await urgent == "slot5"
    assert not any(task.done() for task in [fits, *queued])
    await cancel_all(fits, *queued)


async def test_early_refusal_by_queue_timeout_without_a_deadline() -> None:
    adm, pool, _, refusals = make(queue_timeout_s=1.0, wait_margin=0.0)
    await measured(adm, pool, slots=1, hold_s=0.25)  # drains 4 per second
    queued = [queue(adm, pool) for _ in range(4)]  # the 4th waits 1 s: still fits
    await wait_for(lambda: adm.depth() == 4)
    err = await refused(adm.acquire(pool.pick, 0, None, pool.release))  # 5th: 1.25 s > 1 s
    assert refusals == ["expected_wait"] and err.retry_after_s == pytest.approx(1.25)
    await cancel_all(*queued)


async def test_retry_hint_follows_the_measured_drain_rate() -> None:
    adm, pool, _, _ = make(window=4)
    assert adm.drain_rate() is None and adm.retry_after_s(10) == UNKNOWN_RETRY_S
    await measured(adm, pool, slots=4, hold_s=2.0)
    assert adm.drain_rate() == pytest.approx(2.0)
    assert adm.retry_after_s(10) == pytest.approx(5.0)
    # Faster service: the window forgets the old holds and the hint shrinks with the rate.
    for _ in range(4):
        adm.released(0.5)
    assert adm.held == 0 and adm.drain_rate() == pytest.approx(2.0)  # 1 slot (minimum) / 0.5 s
    await measured(adm, pool, slots=4, hold_s=0.5)
    assert adm.drain_rate() == pytest.approx(8.0)
    assert adm.retry_after_s(10) == pytest.approx(1.25)
    assert adm.retry_after_s(0) == pytest.approx(0.1)  # bounded below
    assert adm.retry_after_s(10**6) == 300.0  # and above


async def test_deadline_and_unavailable_while_waiting() -> None:
    adm, pool, clock, _ = make(queue_timeout_s=30)
    with pytest.raises(DeadlineExceeded):
        await adm.acquire(pool.pick, 0, clock() + 0.05, pool.release)
    task = queue(adm, pool)
    await wait_for(lambda: adm.depth() == 1)
    pool.unavailable = True
    adm.wake()
    with pytest.raises(Unavailable):
        await task
    assert adm.depth() == 0


async def test_releases_a_slot_handed_to_a_cancelled_waiter() -> None:
    adm, pool, _, _ = make()
    released: list[str] = []
    task = asyncio.ensure_future(
        adm.acquire(pool.pick, 0, None, lambda slot: released.append(slot))
    )
    await wait_for(lambda: adm.depth() == 1)
    pool.free = 1
    adm.wake()  # the slot is reserved for the waiter...
    assert adm.depth() == 0 and adm.held == 1
    task.cancel()  # ...which is cancelled before it runs
    await asyncio.gather(task, return_exceptions=True)
    assert released == ["slot1"]


def test_settings_refuse_admission_values_that_make_no_sense() -> None:
    from services.router.settings import RouterSettings

    for field, value in (("tenant_queue_share", 0.0), ("tenant_queue_share", 1.5),
                         ("queue_wait_margin", -0.1), ("drain_window", 0), ("max_queue", -1),
                         ("queue_timeout_s", -1.0)):
        with pytest.raises(ValueError, match=field):
            RouterSettings(**{field: value})
    settings = RouterSettings()
    assert (settings.max_queue, settings.tenant_queue_share, settings.queue_timeout_s) == (64, 0.5, 30.0)

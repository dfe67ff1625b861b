"""Active health of one worker: readiness Watch, load polls, model info and checksum check.

A worker is routable only while its readiness health is SERVING *and* its WatchLoad
stream delivered a report within ``load_timeout``: a stopped (SIGSTOP) or partitioned
worker keeps its TCP connection, so only a late report (or the channel's keepalive)
shows it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from services.router.registry import NOT_SERVING, SERVING, UNKNOWN, Load, WorkerInfo, WorkerState
from services.router.workerapi import WorkerCallError, WorkerClient

log = logging.getLogger(__name__)

READINESS_SERVICE = "llmesh.worker.v1.WorkerService"
_WATCHDOG_SLACK_S = 0.005
"""The watchdog looks this long after a report would be late (timer granularity)."""


def _ring(rung: asyncio.Future[None] | None) -> None:
    if rung is not None and not rung.done():
        rung.set_result(None)


class WorkerMonitor:
    """Background tasks that keep one :class:`WorkerState` current."""

    def __init__(
        self,
        state: WorkerState,
        client: WorkerClient,
        *,
        check_info: Callable[[WorkerState, WorkerInfo], None],
        on_change: Callable[[WorkerState], None],
        interval_s: float = 0.15,
        timeout_s: float = 0.4,
        failures_to_eject: int = 1,
        heard_at: Callable[[], float] | None = None,
    ) -> None:
        self.state = state
        self.client = client
        self._check_info = check_info
        self._on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures_to_eject = max(1, failures_to_eject)
        self._tasks: list[asyncio.Task[None]] = []
        self._last_report = float("-inf")
        self._heard_at = heard_at
        """Loop time of the worker's latest output on the data plane: a worker whose
        frames keep arriving is answering, whatever became of its load reports."""
        self.watcher = uuid.uuid4().hex
        """Names the load watch to the worker; the sessions give the same name, and the
        load their frames carry stands for the watch's reports (:meth:`frame_load`)."""
        self._reviving: asyncio.Task[None] | None = None
        self._frame_load_at = float("-inf")
        """Loop time of the latest load a session frame carried."""
        self._alarm: asyncio.TimerHandle | None = None
        """When the watchdog wakes next, while it waits for a report to be late (moved
        later by every report: see :meth:`_take_report`)."""
        self._alarm_rung: asyncio.Future[None] | None = None
        """What the watchdog awaits: done when the alarm goes off."""

    def _last_sign(self) -> float:
        """Loop time of the latest sign of life: a load report or a data frame."""
        if self._heard_at is None:
            return self._last_report
        return max(self._last_report, self._heard_at())

    def frame_load(self, load: Load) -> None:
        """The worker's load on a session frame: a report, as if the watch had sent it (the
        worker sends the watch none while its frames carry the load). A worker out of
        routing comes back as after a report: once its model info is read again."""
        changed = self._take_report(load)
        self._frame_load_at = self._last_report
        if not self.state.reachable and (self._reviving is None or self._reviving.done()):
            self._reviving = asyncio.ensure_future(self._revive())
        if changed:
            self._on_change(self.state)

    @property
    def frame_silence_s(self) -> float:
        """How long the worker may stay quiet after a frame carried its load: the limit on
        silence less an interval (at least an interval), so that an engine whose steps take
        a little longer than the interval is not asked for a report between every two
        steps, and a report still comes an interval before the watchdog would count a miss."""
        return max(self.interval_s, self.timeout_s - self.interval_s)

    def _frames_carry_load(self) -> bool:
        """Whether the sessions' frames carry the worker's load now (one came within two
        intervals): the named watch is silent by design then, and its connection is not
        pinged (the watchdog still counts the worker's silence, frames included)."""
        return asyncio.get_running_loop().time() - self._frame_load_at <= 2 * self.interval_s

    def _take_report(self, load: Load) -> bool:
        """A load report (from the watch or a frame); whether it changed the worker's state."""
        state = self.state
        loop = asyncio.get_running_loop()
        self._last_report = now = loop.time()
        alarm = self._alarm
        if alarm is not None and alarm.when() - now < self.timeout_s / 2:
            # Reports are flowing: the watchdog would wake only to find this one and sleep
            # again (three times a second under load), so its wake moves to when this
            # report would be late, the time it would compute itself.
            alarm.cancel()
            self._alarm = loop.call_at(now + self.timeout_s + _WATCHDOG_SLACK_S, _ring, self._alarm_rung)
        changed = load != state.load or state.load_failures > 0
        state.load = load
        state.load_failures = 0
        state.silent_since = None
        return changed

    async def _revive(self) -> None:
        state = self.state
        if not state.reachable and await self._refresh_info() and not state.reachable:
            state.reachable = True
            log.info("worker %s at %s reachable", state.worker_id, state.address)
            self._on_change(state)

    def start(self) -> None:
        self._tasks = [
            asyncio.ensure_future(self._load_loop()),
            asyncio.ensure_future(self._watchdog()),
            asyncio.ensure_future(self._health_loop()),
        ]

    async def stop(self) -> None:
        if self._reviving is not None:
            self._tasks.append(self._reviving)
            self._reviving = None
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # asyncio.wait does not swallow a cancellation of the caller (the DNS loop
            # removing this worker may itself be cancelled at shutdown).
            await asyncio.wait(self._tasks)
        for task in self._tasks:
            if not task.cancelled() and task.exception() is not None:
                log.error("monitor of %s failed: %r", self.state.address, task.exception())
        self._tasks = []

    async def _refresh_info(self) -> bool:
        try:
            info = await self.client.get_model_info(max(self.timeout_s, 1.0))
        except WorkerCallError as exc:
            log.debug("GetModelInfo of %s failed: %s", self.state.address, exc)
            return False
        previous = self.state.info
        self.state.info = info
        if previous is None or previous.pid != info.pid or previous.worker_id != info.worker_id:
            log.info(
                "worker %s at %s: model=%s zone=%s device=%s pid=%d",
                self.state.worker_id, self.state.address, info.model, self.state.zone,
                self.state.device, info.pid,
            )
        self._check_info(self.state, info)
        return True

    async def _load_loop(self) -> None:
        """Follow the worker's WatchLoad stream, reconnecting after a break.

        A report arrives every ``interval_s``; the watchdog beside this loop counts a
        missed poll for every ``timeout_s`` in which none arrived. One
        stream instead of a unary GetLoad per interval: the calls cost both processes
        about 10 ms of CPU per second each on an idle mesh, the stream a fraction of it.
        """
        state = self.state
        while True:
            try:
                connected = True
                async for load in self.client.watch_load(self.interval_s, watcher=self.watcher,
                                                         silence_s=self.frame_silence_s,
                                                         elsewhere=self._frames_carry_load):
                    changed = self._take_report(load)
                    # A new stream, or reports again after a silence: the process may have
                    # been replaced, so re-read its model info (pid, checksum) before
                    # taking traffic again.
                    if (connected or not state.reachable) and await self._refresh_info():
                        connected = False
                        if not state.reachable:
                            state.reachable = True
                            changed = True
                            log.info("worker %s at %s reachable", state.worker_id, state.address)
                    if changed:
                        # An idle worker's unchanged reports wake nothing else.
                        self._on_change(state)
            except WorkerCallError as exc:
                log.debug("load watch of %s ended: %s", state.address, exc)
                # The watchdog counts the miss at its next tick, as it would a late report.
                self._last_report = float("-inf")
            await asyncio.sleep(self.interval_s)

    async def _watchdog(self) -> None:
        """A missed poll for every ``timeout_s`` without a report (a stopped or
        partitioned worker keeps its stream open but sends nothing).

        The first miss comes ``timeout_s`` after the latest report; each further one
        after another full ``timeout_s`` of silence, as a unary poll with that deadline
        would time out again. A frontend starved of CPU for a little over ``timeout_s``
        then leaves routing for a moment but its running requests stay where they are:
        they move only after ``unreachable_failover_polls`` such windows.
        """
        loop = asyncio.get_running_loop()
        counted_at = float("-inf")
        """When the latest miss was counted: the next needs ``timeout_s`` more silence."""
        while True:
            # While reports arrive, wake when the latest one would be too old, not every
            # interval; once silent, when the next window of silence is complete.
            since = max(self._last_sign(), counted_at)
            due = since + self.timeout_s - loop.time()
            await self._sleep(due + _WATCHDOG_SLACK_S if due > 0 else self.interval_s)
            now = loop.time()
            if now - self._last_sign() <= self.timeout_s:
                continue
            if now - counted_at < self.timeout_s:
                continue
            # A report that reached this process while its event loop was busy is read by
            # a callback already queued behind this one: let those run before judging.
            await asyncio.sleep(0.02)
            silent = loop.time() - self._last_sign()
            if silent <= self.timeout_s + 0.02:
                continue
            counted_at = loop.time()
            state = self.state
            state.load_failures += 1
            broken = self._last_report == float("-inf")
            if state.reachable and state.load_failures >= self.failures_to_eject:
                reason = "load watch broken" if broken else f"silent for {silent:.2f} s"
                log.warning("worker %s at %s unreachable: %s", state.worker_id, state.address, reason)
                state.reachable = False
                # Silent with its streams open (busy or stopped, not gone): a request that
                # finds no other worker may wait a moment for it (failover_wait_ms).
                state.silent_since = None if broken else counted_at - silent
            elif broken:
                state.silent_since = None
            self._on_change(state)  # every miss counts: requests move after a few of them

    async def _sleep(self, delay: float) -> None:
        """The watchdog's sleep, on an alarm that reports may move later."""
        loop = asyncio.get_running_loop()
        self._alarm_rung = rung = loop.create_future()
        self._alarm = loop.call_later(delay, _ring, rung)
        try:
            await rung
        finally:
            if self._alarm is not None:
                self._alarm.cancel()
            self._alarm = self._alarm_rung = None

    async def _health_loop(self) -> None:
        state = self.state
        backoff = 0.1
        while True:
            try:
                async for status in self.client.watch_health(READINESS_SERVICE):
                    backoff = 0.1
                    if status != state.health:
                        log.info("worker %s at %s health %s", state.worker_id, state.address, status)
                        state.health = status if status in (SERVING, NOT_SERVING) else UNKNOWN
                        self._on_change(state)
            except WorkerCallError as exc:
                log.debug("health watch of %s ended: %s", state.address, exc)
            if state.health != UNKNOWN:
                state.health = UNKNOWN
                self._on_change(state)
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)

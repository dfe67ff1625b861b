"""When this worker last told one router its load, so that a busy worker's load reports
travel on the frames it sends anyway (no grpc).

A router names its load watch (``WatchLoadRequest.watcher``) and gives the same name in
the first message of its sessions with the worker. The worker then puts its load on a
frame of those sessions at most every half interval, and the watch sends a report only
when no frame carried the load for a whole interval. At a real engine's step rate a
frame leaves every step, so the watch sleeps: each report was a wakeup of the worker and
of the router (about 0.3 ms of CPU each on the measured machines, against frames they
handle anyway). An idle worker reports as before: its frames are what stops.

After a frame carried the load the next report waits the watch's ``silence`` (at least
the interval; the router asks for its silent-worker limit less an interval): a CPU engine
whose steps take a little longer than the interval (32 streams of SmolLM2 on two cores:
about 170 ms against the router's 150) otherwise made the watch report between every two
steps, a wake-up of both processes per step for a load the next frame carries anyway.

A frame that comes too soon after a report to carry the load (within half an interval)
also moves the next report to the silence after that report: frames flow, and the next
one carries the load. Without it, steps a little longer than the interval locked in step
with the reports: each report fired just before a step, its frame came too soon to carry
the load, and the next report was due an interval later, again just before the next step
(a report, two wake-ups, per step, until the phase drifted out; every longer step, such
as a prefill, started it again).

An idle worker's load (nothing in flight, nothing running or waiting in the engine) does
not change until a request comes, so after a report of it the next one also waits the
silence: on an idle mesh each report was a wake-up of the worker and of the router (about
0.35 ms of CPU each on the measured machines, 6.7 a second at the router's 150 ms). The
router hears often enough to tell a live worker from a stopped one, as after a frame; a
request arriving (:meth:`LoadClocks.busy`) brings the next report back to an interval after
the last, so no watcher waits longer than before for a load that did change.
"""

from __future__ import annotations

import asyncio


class LoadClock:
    """One router's watch: when its load went last, and its next report."""

    def __init__(self, interval_s: float, silence_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self.silence_s = max(interval_s, silence_s)
        """How long after a frame carried the load the next report waits."""
        self.sent_at = float("-inf")
        self._due = asyncio.Event()
        self._due.set()  # a new watch reports at once
        self._timer: asyncio.TimerHandle | None = None
        self._waits_silence = False
        """Whether the next report waits the silence (not the interval) after ``sent_at``."""
        self._idle = False
        """Whether the last report was of an idle worker (and so waits the silence)."""

    def frame_due(self, now: float) -> bool:
        """Whether a frame sent at ``now`` should carry the load. One that should not (the
        load went less than half an interval ago, on a report) moves the next report to
        the silence after that report."""
        if now - self.sent_at >= self.interval_s / 2:
            return True
        if not self._waits_silence and self.silence_s > self.interval_s:
            self._arm(self.sent_at + self.silence_s, waits_silence=True)
        return False

    def sent(self, now: float, *, on_frame: bool = False, idle: bool = False) -> None:
        """The load went to the router at loop time ``now``, on a report or (``on_frame``)
        on a frame: the next report is due an interval later (after a frame, or a report
        of an ``idle`` worker, the silence), unless a frame carries the load first."""
        self.sent_at = now
        self._due.clear()
        quiet = on_frame or idle
        self._idle = idle and not on_frame
        self._arm(now + (self.silence_s if quiet else self.interval_s), waits_silence=quiet)

    def busy(self) -> None:
        """A request arrived: if the last report was of an idle worker, the next one is due
        an interval after it (at once if that passed), not the silence."""
        if self._idle and self._waits_silence and not self._due.is_set():
            self._idle = False
            self._arm(self.sent_at + self.interval_s, waits_silence=False)

    def _arm(self, at: float, *, waits_silence: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(at, self._due.set)
        self._waits_silence = waits_silence

    async def wait_report(self) -> None:
        """Until a report is due (no load went for an interval)."""
        await self._due.wait()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class LoadClocks:
    """The clocks of the watches open on this worker, by watcher name."""

    def __init__(self) -> None:
        self._clocks: dict[str, LoadClock] = {}

    def open(self, watcher: str, interval_s: float, silence_s: float = 0.0) -> LoadClock:
        clock = LoadClock(interval_s, silence_s)
        previous = self._clocks.get(watcher)
        if previous is not None:
            previous.close()  # the router's new watch replaces its old one
        self._clocks[watcher] = clock
        return clock

    def close(self, watcher: str, clock: LoadClock) -> None:
        clock.close()
        if self._clocks.get(watcher) is clock:
            del self._clocks[watcher]

    def get(self, watcher: str) -> LoadClock | None:
        return self._clocks.get(watcher) if watcher else None

    def busy(self) -> None:
        """A request arrived at an idle worker: see :meth:`LoadClock.busy`."""
        for clock in self._clocks.values():
            clock.busy()

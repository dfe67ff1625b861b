"""Pure unit tests: circuit breaker, batching window adaptation, routing, worker frames
(admission: test_admission.py)."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest

from llmesh.common.v1 import common_pb2
from llmesh.worker.v1 import worker_pb2
from services.common.generation import Delta, Final, FinishReason, TokenRequest
from services.router import health
from services.router.batching import AdaptiveWindow, BatchDispatcher
from services.router.breaker import Circuit, CircuitBreaker
from services.router.health import WorkerMonitor
from services.router.registry import SERVING, ChecksumBook, Load, WorkerInfo, WorkerState
from services.router.routing import Policy, ZoneLadder, choose, prefix_key
from services.router.settings import RouterSettings
from services.router.workerapi import WorkerCallError
from services.router.workerclient import frame_events
from tests.router.helpers import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- circuit breaker ---------------------------------------------------------------


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=2, base_backoff_s=1.0, max_backoff_s=8.0, clock=clock)
    assert breaker.state is Circuit.CLOSED and breaker.allows()
    breaker.record_failure()
    assert breaker.state is Circuit.CLOSED
    breaker.record_failure()
    assert breaker.state is Circuit.OPEN and not breaker.allows()
    clock.now += 0.99
    assert breaker.state is Circuit.OPEN
    clock.now += 0.02
    assert breaker.state is Circuit.HALF_OPEN and breaker.allows()
    breaker.on_dispatch()  # the one trial
    assert not breaker.allows()
    breaker.record_success()
    assert breaker.state is Circuit.CLOSED and breaker.allows()


def test_breaker_tells_when_it_half_opens_and_which_calls_changed_it() -> None:
    """What the router's readiness waits for instead of polling: the time until an open
    circuit half-opens, the dispatch that claims its one trial, the success that closes it."""
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, base_backoff_s=1.0, clock=clock)
    assert breaker.reopens_in() is None
    breaker.record_failure()
    assert breaker.reopens_in() == pytest.approx(1.0)
    clock.now += 0.75
    assert breaker.reopens_in() == pytest.approx(0.25)
    clock.now += 0.5
    assert breaker.reopens_in() == 0.0  # due: the next reading of its state half-opens it
    assert breaker.state is Circuit.HALF_OPEN and breaker.reopens_in() is None
    assert breaker.on_dispatch() is True  # claimed the trial
    assert breaker.on_dispatch() is False  # nothing more to claim
    assert breaker.record_success() is True  # closed it
    assert breaker.record_success() is False
    assert breaker.on_dispatch() is False  # a closed circuit has no trial


def test_breaker_backoff_doubles_on_failed_trials_and_is_capped() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=1, base_backoff_s=1.0, max_backoff_s=3.0, clock=clock)
    breaker.record_failure()
    assert breaker.backoff_s == 1.0
    for expected in (2.0, 3.0, 3.0):
        clock.now += breaker.backoff_s
        assert breaker.state is Circuit.HALF_OPEN
        breaker.on_dispatch()
        breaker.record_failure()
        assert breaker.state is Circuit.OPEN
        assert breaker.backoff_s == expected
    breaker.reset()
    assert breaker.state is Circuit.CLOSED and breaker.backoff_s == 0.0


def test_breaker_success_resets_failure_count() -> None:
    breaker = CircuitBreaker(failure_threshold=2, clock=Clock())
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is Circuit.CLOSED


def test_breaker_needs_several_failures_of_an_answering_worker_but_one_of_a_silent_one() -> None:
    answering = CircuitBreaker(clock=Clock())
    assert answering.failure_threshold == 3
    answering.record_failure()
    answering.record_failure()
    assert answering.state is Circuit.CLOSED and answering.failures == 2
    answering.record_failure()
    assert answering.state is Circuit.OPEN
    silent = CircuitBreaker(clock=Clock())
    silent.record_failure(answering=False)
    assert silent.state is Circuit.OPEN


def test_breaker_threshold_below_two_is_refused_in_settings() -> None:
    with pytest.raises(ValueError, match="breaker_failures"):
        RouterSettings(breaker_failures=1)


# ---- batching window -----------------------------------------------------------------


def test_window_idle_sends_immediately() -> None:
    window = AdaptiveWindow(max_wait_ms=10, max_size=16)
    window.observe(0.05)
    plan = window.plan()
    assert plan.wait_ms == 0 and plan.max_size == 1


def test_window_grows_under_load_and_shrinks_back() -> None:
    window = AdaptiveWindow(max_wait_ms=10, max_size=16)
    waits, sizes = [], []
    for _ in range(20):
        window.observe(1.0)
        plan = window.plan()
        waits.append(plan.wait_ms)
        sizes.append(plan.max_size)
    assert waits == sorted(waits) and sizes == sorted(sizes)  # monotone growth
    assert waits[-1] > 9.0 and sizes[-1] == 16
    assert waits[-1] <= 10.0
    for _ in range(20):
        window.observe(0.0)
    assert window.plan().wait_ms == 0 and window.plan().max_size == 1


def test_window_moderate_load_gives_moderate_window() -> None:
    window = AdaptiveWindow(max_wait_ms=10, max_size=16)
    for _ in range(50):
        window.observe(0.6)
    plan = window.plan()
    assert 0 < plan.wait_ms < 10 and 2 <= plan.max_size < 16


class _RecordingLink:
    """A worker session link that records each message's submissions."""

    def __init__(self) -> None:
        self.messages: list[list[str]] = []
        self._closed = asyncio.Event()

    def send(self, submits, aborts) -> None:  # type: ignore[no-untyped-def]
        self.messages.append([s.request.request_id for s in submits])

    async def events(self):  # type: ignore[no-untyped-def]
        await self._closed.wait()
        return
        yield

    async def close(self) -> None:
        self._closed.set()


class _SessionClient:
    address = "fake:1"

    def __init__(self) -> None:
        self.link = _RecordingLink()

    def open_session(self, awaiting=None, *, watcher="", on_load=None) -> _RecordingLink:  # type: ignore[no-untyped-def]
        self.awaiting = awaiting
        return self.link


async def test_a_lone_request_is_not_held_for_a_window_under_pressure() -> None:
    """Issue #17: a request that finds nothing sent to its worker for a whole window goes
    at the end of the loop iteration (with what arrived in the same one), even when the
    smoothed pressure says "window"; one that follows a dispatch within a window waits for
    company as before. A minute-long window: an old-style wait would not end in this test."""
    client = _SessionClient()
    window = AdaptiveWindow(max_wait_ms=60_000, max_size=8)
    window.level = 1.0  # pressure left high, e.g. by a burst that is over
    dispatcher = BatchDispatcher(client, window, lambda: 1.0, session=True)  # type: ignore[arg-type]
    try:
        assert window.plan().wait_ms > 0
        dispatcher.submit(TokenRequest(request_id="a"), None)
        dispatcher.submit(TokenRequest(request_id="b"), None)
        assert client.link.messages == []  # not synchronously: same-iteration arrivals join
        await asyncio.sleep(0)  # one loop iteration, not a timed wait
        assert client.link.messages == [["a", "b"]]

        dispatcher.submit(TokenRequest(request_id="c"), None)  # right behind a dispatch
        await asyncio.sleep(0)
        assert client.link.messages == [["a", "b"]] and dispatcher.queued == 1
    finally:
        await dispatcher.close()


class _ScriptedLink(_RecordingLink):
    """A session link whose worker output the test pushes."""

    def __init__(self) -> None:
        super().__init__()
        self.output: asyncio.Queue[tuple[int, object] | None] = asyncio.Queue()

    async def events(self):  # type: ignore[no-untyped-def]
        while (item := await self.output.get()) is not None:
            yield [item]  # one frame per item

    async def close(self) -> None:
        self.output.put_nowait(None)


async def test_the_worker_session_awaits_only_while_a_request_waits_for_output() -> None:
    """The router's worker Session is quiet while idle (no pings, silence not counted:
    services/common/sessionwire.py): the dispatcher tells the link whether any request on
    it still waits, from submission until its final."""
    client = _SessionClient()
    client.link = _ScriptedLink()
    dispatcher = BatchDispatcher(client, AdaptiveWindow(max_wait_ms=0, max_size=8), lambda: 0.0,  # type: ignore[arg-type]
                                 session=True)
    try:
        first = dispatcher.submit(TokenRequest(request_id="a"), None)
        second = dispatcher.submit(TokenRequest(request_id="b"), None)
        await asyncio.sleep(0)
        assert client.link.messages == [["a"], ["b"]]  # no window: each goes at once
        awaiting = client.awaiting
        assert awaiting is not None and awaiting()
        client.link.output.put_nowait((first.handle, Delta([7])))
        client.link.output.put_nowait((first.handle, Final(FinishReason.LENGTH, completion_tokens=1)))
        await wait_for(lambda: first.done, timeout=5)
        assert awaiting(), "b still waits for output"
        client.link.output.put_nowait((second.handle, Final(FinishReason.LENGTH)))
        await wait_for(lambda: second.done, timeout=5)
        assert not awaiting()
        dispatcher.submit(TokenRequest(request_id="c"), None)
        await asyncio.sleep(0)
        assert awaiting() and client.link.messages[-1] == ["c"]
    finally:
        await dispatcher.close()


def test_window_off_when_max_wait_zero() -> None:
    window = AdaptiveWindow(max_wait_ms=0, max_size=16)
    for _ in range(10):
        window.observe(1.0)
    assert window.plan().wait_ms == 0 and window.plan().max_size == 1


# ---- routing ---------------------------------------------------------------------------


def worker(address: str, zone: str, *, in_flight: int = 0, capacity: int = 8, kv: float = 0.0,
           model: str = "m", healthy: bool = True) -> WorkerState:
    state = WorkerState(address=address, breaker=CircuitBreaker(clock=Clock()), zone_label=zone,
                        default_capacity=capacity)
    state.info = WorkerInfo(model=model, tokenizer_checksum="c", worker_id=address)
    state.health = SERVING if healthy else "NOT_SERVING"
    state.reachable = True
    state.in_flight = in_flight
    state.load = Load(kv_cache_usage=kv)
    return state


LADDER = ZoneLadder(["zone-a", "zone-b", "kunpeng"], ["kunpeng"])


def test_zone_ladder_prefers_best_zone_and_falls_back() -> None:
    a = worker("a", "zone-a", in_flight=5)
    b = worker("b", "zone-b")
    k = worker("k", "kunpeng")
    assert choose([k, b, a], "m", LADDER, None).worker is a  # busier, but the better zone
    a.health = "NOT_SERVING"
    assert choose([k, b, a], "m", LADDER, None).worker is b
    b.breaker.record_failure(answering=False)  # a worker that stopped answering: circuit opens
    choice = choose([k, b, a], "m", LADDER, None)
    assert choice.worker is k and LADDER.is_degraded(choice.zone)
    k.reachable = False
    choice = choose([k, b, a], "m", LADDER, None)
    assert choice.worker is None and not choice.routable


def test_full_best_zone_waits_instead_of_spilling() -> None:
    a = worker("a", "zone-a", in_flight=2, capacity=2)
    k = worker("k", "kunpeng")
    choice = choose([a, k], "m", LADDER, None)
    assert choice.worker is None and choice.routable and choice.zone == "zone-a"


def test_unknown_zone_ranks_last_and_model_filter() -> None:
    x = worker("x", "elsewhere")
    k = worker("k", "kunpeng", model="other")
    assert choose([x, k], "m", LADDER, None).worker is x
    assert choose([x, k], "other", LADDER, None).worker is k
    assert choose([x, k], "missing", LADDER, None).worker is None


def test_least_loaded_wins_without_affinity() -> None:
    ws = [worker("a", "zone-a", in_flight=3), worker("b", "zone-a", in_flight=1),
          worker("c", "zone-a", in_flight=2)]
    assert choose(ws, "m", LADDER, None).worker is ws[1]
    ws[1].load.kv_cache_usage = 0.9  # KV pressure counts too
    assert choose(ws, "m", LADDER, None).worker is ws[2]


def test_prefix_affinity_is_stable_and_spreads_keys() -> None:
    ws = [worker(f"w{i}", "zone-a") for i in range(4)]
    homes = Counter()
    for p in range(200):
        key = prefix_key([p, 1, 2, 3], 64)
        first = choose(ws, "m", LADDER, key)
        again = choose(ws, "m", LADDER, key)
        assert first.affinity and first.worker is again.worker
        assert first.worker is not None
        homes[first.worker.address] += 1
    assert len(homes) == 4 and min(homes.values()) > 20
    # Only the first N tokens matter.
    assert prefix_key([1, 2, 3, 4], 2) == prefix_key([1, 2, 9, 9], 2)
    assert prefix_key([], 64) is None and prefix_key([1], 0) is None


def test_prefix_affinity_yields_to_balance_bound() -> None:
    ws = [worker(f"w{i}", "zone-a", capacity=100) for i in range(3)]
    key = prefix_key([42, 43], 64)
    home = choose(ws, "m", LADDER, key).worker
    assert home is not None
    policy = Policy(balance_factor=1.5, balance_slack=2.0)
    home.in_flight = 2  # within slack of the idle others
    assert choose(ws, "m", LADDER, key, policy).worker is home
    home.in_flight = 3  # beyond 1.5 x 0 + 2
    choice = choose(ws, "m", LADDER, key, policy)
    assert choice.worker is not home and not choice.affinity


def test_excluded_workers_are_a_last_resort() -> None:
    a, b = worker("a", "zone-a"), worker("b", "zone-b")
    assert choose([a, b], "m", LADDER, None, exclude=frozenset({"a"})).worker is b
    assert choose([a], "m", LADDER, None, exclude=frozenset({"a"})).worker is a


def test_checksum_book() -> None:
    book = ChecksumBook({"m": "sha256:good"})
    assert book.check("m", "sha256:good", "w1") == ""
    assert "differs" in book.check("m", "sha256:bad", "w2")
    book.learn("m", "sha256:other", "tokenizer tier")  # settings win
    assert book.expected("m") == "sha256:good"
    assert book.check("n", "sha256:first", "w3") == ""  # first worker sets it
    assert book.check("n", "sha256:second", "w4")


# ---- load watchdog ---------------------------------------------------------------


class _SilentAfterOneReport:
    """A worker client whose WatchLoad stream sends one report and then nothing (SIGSTOP)."""

    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.reported_at = 0.0
        self.silence_s: float | None = None

    async def watch_load(self, interval_s: float, *, watcher: str = "", silence_s: float = 0.0,  # type: ignore[no-untyped-def]
                         elsewhere=None):
        self.silence_s = silence_s
        self.reported_at = asyncio.get_running_loop().time()
        yield Load(running=1)
        await asyncio.Event().wait()

    async def get_model_info(self, timeout: float) -> WorkerInfo:
        return WorkerInfo(model="m", tokenizer_checksum="sha256:x", worker_id="w", pid=1)

    async def watch_health(self, service: str):  # type: ignore[no-untyped-def]
        yield SERVING
        await asyncio.Event().wait()


async def test_each_further_missed_poll_needs_another_full_timeout_of_silence() -> None:
    """A frontend starved for a little over ``load_timeout`` leaves routing, but its
    requests move (``unreachable_failover_polls`` = 2) only after a second full timeout."""
    state = WorkerState("127.0.0.1:1", CircuitBreaker())
    client = _SilentAfterOneReport()
    loop = asyncio.get_running_loop()
    misses: list[tuple[float, int, bool]] = []  # (when, missed polls, reachable)

    def on_change(s: WorkerState) -> None:
        if s.load_failures:
            misses.append((loop.time(), s.load_failures, s.reachable))

    monitor = WorkerMonitor(state, client,  # type: ignore[arg-type]
                            check_info=lambda s, i: None, on_change=on_change,
                            interval_s=0.02, timeout_s=0.3)
    monitor.start()
    try:
        await asyncio.sleep(1.2)
    finally:
        await monitor.stop()
    # Reports were due every 20 ms; a miss was counted per 300 ms of silence, not per 20 ms.
    assert [n for _, n, _ in misses] == list(range(1, len(misses) + 1)) and 2 <= len(misses) <= 4
    assert misses[0][0] - client.reported_at >= 0.3 and not misses[0][2]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(misses)]
    assert all(gap >= 0.3 for gap in gaps), gaps


async def test_frames_on_the_data_plane_keep_a_worker_with_late_load_reports_routable() -> None:
    """Load reports stop but the worker's frames keep arriving (its WatchLoad writer is
    starved, its engine is not): no miss is counted. When the frames stop too, the
    silence is counted from the last frame, and the worker is marked silent (streams
    open), which lets new requests wait for it for a moment."""
    state = WorkerState("127.0.0.1:1", CircuitBreaker())
    client = _SilentAfterOneReport()
    loop = asyncio.get_running_loop()
    heard = {"at": float("-inf")}
    monitor = WorkerMonitor(state, client,  # type: ignore[arg-type]
                            check_info=lambda s, i: None, on_change=lambda s: None,
                            interval_s=0.02, timeout_s=0.2, heard_at=lambda: heard["at"])
    monitor.start()
    try:
        for _ in range(30):  # 0.6 s of frames every 20 ms, three timeouts' worth
            heard["at"] = loop.time()
            await asyncio.sleep(0.02)
        assert state.load_failures == 0 and state.reachable and state.silent_since is None
        last_frame = heard["at"]
        await asyncio.sleep(0.35)
        assert state.load_failures == 1 and not state.reachable
        assert state.silent_since is not None and abs(state.silent_since - last_frame) < 0.05
    finally:
        await monitor.stop()


class _SteadyReports(_SilentAfterOneReport):
    """A worker whose WatchLoad stream reports every 20 ms."""

    async def watch_load(self, interval_s: float, *, watcher: str = "", silence_s: float = 0.0,  # type: ignore[no-untyped-def]
                         elsewhere=None):
        while True:
            self.reported_at = asyncio.get_running_loop().time()
            yield Load(running=1)
            await asyncio.sleep(0.02)


async def test_the_watchdog_sleeps_while_reports_flow_and_wakes_when_one_is_late(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every report moves the watchdog's wake to when that report would be late, so a
    watched worker that reports on time wakes the router only for its reports (the
    watchdog woke about three times a second for nothing); a report that is late is still
    counted a timeout after the previous one."""
    wakes: list[float] = []
    plain_ring = health._ring

    def counting_ring(rung: asyncio.Future[None] | None) -> None:
        wakes.append(asyncio.get_running_loop().time())
        plain_ring(rung)

    monkeypatch.setattr(health, "_ring", counting_ring)
    state = WorkerState("127.0.0.1:1", CircuitBreaker())
    client = _SteadyReports()
    monitor = WorkerMonitor(state, client,  # type: ignore[arg-type]
                            check_info=lambda s, i: None, on_change=lambda s: None,
                            interval_s=0.02, timeout_s=0.2)
    monitor.start()
    try:
        await wait_for(lambda: state.reachable, timeout=2.0, interval=0.01)
        await asyncio.sleep(1.0)  # five timeouts' worth of reports every 20 ms
        assert wakes == [] and state.load_failures == 0
        [loop_task] = [t for t in monitor._tasks if "_load_loop" in repr(t.get_coro())]
        loop_task.cancel()  # the reports stop
        await asyncio.sleep(0.3)
        # At most one early look (a report that found the alarm more than half a timeout
        # away left it there), then the one that counts the miss.
        assert 1 <= len(wakes) <= 2 and wakes[-1] - client.reported_at >= 0.2, wakes
        assert state.load_failures == 1 and not state.reachable
    finally:
        await monitor.stop()


async def test_the_watch_asks_for_the_silence_limit_less_an_interval_after_a_frame() -> None:
    """After a frame carried the load, the worker may stay quiet for the watchdog's limit
    less an interval (never less than an interval): steps a little longer than the interval
    need no report between them, and a report still comes an interval before a miss."""
    for interval, timeout, silence in ((0.15, 0.4, 0.25), (0.3, 0.4, 0.3), (0.02, 0.2, 0.18)):
        client = _SilentAfterOneReport()
        monitor = WorkerMonitor(WorkerState("127.0.0.1:1", CircuitBreaker()), client,  # type: ignore[arg-type]
                                check_info=lambda s, i: None, on_change=lambda s: None,
                                interval_s=interval, timeout_s=timeout)
        monitor.start()
        try:
            await wait_for(lambda: client.silence_s is not None, timeout=2.0, interval=0.01)  # noqa: B023
        finally:
            await monitor.stop()
        assert client.silence_s == pytest.approx(silence), (interval, timeout)


async def test_load_on_a_frame_is_a_report_and_brings_an_unreachable_worker_back() -> None:
    """The worker's load on a session frame (it sends the named watch no report while its
    frames carry the load) does what a report does: fresh load, no missed polls, and a
    worker that had left routing back in it once its model info is read again."""
    state = WorkerState("127.0.0.1:1", CircuitBreaker())
    client = _SilentAfterOneReport()
    loop = asyncio.get_running_loop()
    monitor = WorkerMonitor(state, client,  # type: ignore[arg-type]
                            check_info=lambda s, i: None, on_change=lambda s: None,
                            interval_s=0.02, timeout_s=0.2)
    assert len(monitor.watcher) == 32  # a name of its own, given to the watch and the sessions
    monitor.start()
    try:
        await wait_for(lambda: state.reachable, timeout=2.0, interval=0.01)
        # Frames every 20 ms carry the load, the watch sends nothing: no miss counted.
        for n in range(20):
            monitor.frame_load(Load(running=n))
            await asyncio.sleep(0.02)
        assert state.load_failures == 0 and state.reachable and state.load.running == 19
        await asyncio.sleep(0.3)  # frames and reports both stop: the silence counts
        assert state.load_failures >= 1 and not state.reachable
        monitor.frame_load(Load(running=7))  # frames again
        assert state.load_failures == 0 and state.load.running == 7
        await wait_for(lambda: state.reachable, timeout=2.0, interval=0.01)
        assert loop.time() - monitor._last_sign() < 0.2
    finally:
        await monitor.stop()


class _BrokenWatch(_SilentAfterOneReport):
    """A worker whose WatchLoad stream breaks after one report (the process is gone)."""

    connects = 0

    async def watch_load(self, interval_s: float, *, watcher: str = "", silence_s: float = 0.0,  # type: ignore[no-untyped-def]
                         elsewhere=None):
        self.connects += 1
        if self.connects == 1:
            yield Load(running=1)
        raise WorkerCallError("transport", "UNAVAILABLE", "connection refused")


async def test_a_worker_whose_load_stream_broke_is_not_called_silent() -> None:
    state = WorkerState("127.0.0.1:1", CircuitBreaker())
    monitor = WorkerMonitor(state, _BrokenWatch(),  # type: ignore[arg-type]
                            check_info=lambda s, i: None, on_change=lambda s: None,
                            interval_s=0.05, timeout_s=0.1)
    monitor.start()
    try:
        await wait_for(lambda: state.reachable, timeout=2.0, interval=0.01)
        await asyncio.sleep(0.3)
        assert state.load_failures >= 1 and not state.reachable and state.silent_since is None
    finally:
        await monitor.stop()


# ---- worker session frames -------------------------------------------------------------


def _logprobs(handle: int, *token_ids: int) -> worker_pb2.SessionLogprobs:
    return worker_pb2.SessionLogprobs(handle=handle, logprobs=[
        common_pb2.TokenLogprob(token_id=t, logprob=-0.25) for t in token_ids])


def test_a_worker_frame_pairs_each_requests_tokens_with_their_own_logprobs() -> None:
    """A frame that names a request once per engine step (as workers did when a frame
    covered several steps) carries a logprobs entry per naming: each delta gets its own,
    in order, not the last one for every naming. A request without logprobs gets its
    plain token ids (a list, no Delta)."""
    frame = worker_pb2.SessionResponse(
        handles=[7, 9, 7, 7], token_counts=[1, 2, 1, 2], token_ids=[1214, 5, 6, 60, 1248, 1038],
        logprobs=[_logprobs(7, 1214), _logprobs(7, 60), _logprobs(7, 1248, 1038)],
    )
    events = list(frame_events(frame))
    assert [handle for handle, _ in events] == [7, 9, 7, 7]
    deltas = [event for handle, event in events if handle == 7]
    assert all(isinstance(d, Delta) for d in deltas)
    assert [d.token_ids for d in deltas] == [[1214], [60], [1248, 1038]]  # type: ignore[union-attr]
    got = [[lp.token_id for lp in d.logprobs or []] for d in deltas]  # type: ignore[union-attr]
    assert got == [[1214], [60], [1248, 1038]]
    assert events[1] == (9, [5, 6])
    plain = worker_pb2.SessionResponse(handles=[3, 4], token_counts=[2, 1], token_ids=[8, 9, 10])
    assert list(frame_events(plain)) == [(3, [8, 9]), (4, [10])]


async def test_an_attempt_streams_plain_token_ids_where_its_consumer_takes_them() -> None:
    """A worker session's plain token ids go to ``on_tokens`` (no Delta built), else to
    ``on_delta`` or the queue as a Delta; a consumer that raises fails that request
    alone (its events() raise it) and nothing more is taken for it."""
    from services.router.batching import AttemptStream

    def stream() -> AttemptStream:
        return AttemptStream("r", dispatcher=None)  # type: ignore[arg-type]  # not used here

    direct = stream()
    plain: list[list[int]] = []
    deltas: list[Delta] = []
    direct.on_delta, direct.on_tokens = deltas.append, plain.append
    direct.push_tokens([1, 2])
    assert plain == [[1, 2]] and deltas == [] and direct.queue.empty()

    via_delta = stream()
    via_delta.on_delta = deltas.append
    via_delta.push_tokens([3])
    assert deltas == [Delta([3])] and via_delta.queue.empty()

    queued = stream()
    queued.push_tokens([4])
    assert queued.queue.get_nowait() == Delta([4])

    failing = stream()

    def broken(token_ids: list[int]) -> None:
        raise RuntimeError("consumer bug")

    failing.on_delta, failing.on_tokens = deltas.append, broken
    failing.push_tokens([5])
    failing.push_tokens([6])
    assert failing.done and failing.queue.qsize() == 1
    with pytest.raises(RuntimeError, match="consumer bug"):
        async for _ in failing.events():
            pass

    cancelled = stream()
    cancelled.on_delta, cancelled.on_tokens = deltas.append, plain.append
    cancelled.cancelled = True
    cancelled.push_tokens([7])
    assert plain == [[1, 2]]

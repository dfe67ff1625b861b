"""A busy worker's load travels on its session frames: a named load watch gets a report
only when no frame of the same router's sessions carried the load for an interval."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from llmesh.worker.v1 import worker_pb2
from services.worker.loadclock import LoadClock

from .conftest import RunningWorker, start_running_worker, token_request


async def test_the_clock_reports_at_once_then_only_after_an_interval_without_load() -> None:
    loop = asyncio.get_running_loop()
    clock = LoadClock(0.1)
    await asyncio.wait_for(clock.wait_report(), 1)  # a new watch reports at once
    start = loop.time()
    clock.sent(start)
    assert not clock.frame_due(start + 0.04) and clock.frame_due(start + 0.051)
    await asyncio.sleep(0.06)
    clock.sent(loop.time())  # a frame carried the load: the report moves back
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(clock.wait_report(), 0.08)
    await asyncio.wait_for(clock.wait_report(), 1)
    assert loop.time() - start >= 0.16
    clock.close()


async def test_after_a_frame_the_report_waits_the_silence_and_after_a_report_the_interval() -> None:
    loop = asyncio.get_running_loop()
    clock = LoadClock(0.05, 0.2)
    await asyncio.wait_for(clock.wait_report(), 1)
    start = loop.time()
    clock.sent(start, on_frame=True)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(clock.wait_report(), 0.15)
    await asyncio.wait_for(clock.wait_report(), 1)
    assert loop.time() - start >= 0.2
    start = loop.time()
    clock.sent(start)  # a report: the next one an interval later
    await asyncio.wait_for(clock.wait_report(), 1)
    assert 0.05 <= loop.time() - start < 0.15
    clock.close()
    # A silence shorter than the interval is the interval.
    assert LoadClock(0.1, 0.02).silence_s == 0.1


async def test_a_frame_too_soon_after_a_report_moves_the_next_report_to_the_silence() -> None:
    """Steps a little longer than the interval: the frame after a report comes too soon
    to carry the load. The next report then waits the silence after that report (the next
    frame carries the load), not the interval, which put a report before every step."""
    loop = asyncio.get_running_loop()
    clock = LoadClock(0.1, 0.3)
    await asyncio.wait_for(clock.wait_report(), 1)
    start = loop.time()
    clock.sent(start)  # a report
    assert not clock.frame_due(start + 0.01)  # a step's frame right after it
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(clock.wait_report(), 0.2)  # was due at 0.1
    assert clock.frame_due(loop.time())  # the next step's frame carries the load
    await asyncio.wait_for(clock.wait_report(), 1)  # no frame: the report comes at the silence
    assert loop.time() - start >= 0.3
    clock.close()
    # Without a silence longer than the interval, a report an interval after the last.
    clock = LoadClock(0.1)
    clock.sent(start := loop.time())
    assert not clock.frame_due(start + 0.01)
    await asyncio.wait_for(clock.wait_report(), 1)
    assert loop.time() - start < 0.25
    clock.close()


async def test_an_idle_workers_report_waits_the_silence_until_a_request_comes() -> None:
    loop = asyncio.get_running_loop()
    clock = LoadClock(0.05, 0.2)
    await asyncio.wait_for(clock.wait_report(), 1)
    start = loop.time()
    clock.sent(start, idle=True)  # nothing in flight: the load stays as it is
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(clock.wait_report(), 0.15)
    await asyncio.wait_for(clock.wait_report(), 1)
    assert loop.time() - start >= 0.2
    # A request comes 20 ms after an idle report: the next report an interval after it.
    start = loop.time()
    clock.sent(start, idle=True)
    await asyncio.sleep(0.02)
    clock.busy()
    await asyncio.wait_for(clock.wait_report(), 1)
    assert 0.05 <= loop.time() - start < 0.15
    # Once an interval passed since the report, a request makes it due at once.
    clock.sent(loop.time(), idle=True)
    await asyncio.sleep(0.08)
    clock.busy()
    await asyncio.wait_for(clock.wait_report(), 0.01)
    # After a busy report, or after a frame, a request changes nothing.
    start = loop.time()
    clock.sent(start)
    clock.busy()
    await asyncio.wait_for(clock.wait_report(), 1)
    assert loop.time() - start >= 0.05
    start = loop.time()
    clock.sent(start, on_frame=True)
    clock.busy()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(clock.wait_report(), 0.15)
    clock.close()
    # Without a silence longer than the interval (an unnamed watch), idle changes nothing.
    clock = LoadClock(0.05)
    clock.sent(start := loop.time(), idle=True)
    await asyncio.wait_for(clock.wait_report(), 1)
    assert loop.time() - start < 0.15
    clock.close()


async def _reports(call: object, at: list[float], first: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    async for _ in call:  # type: ignore[attr-defined]
        at.append(loop.time())
        first.set()


async def test_frames_carry_the_load_while_they_flow_and_the_watch_reports_again_after(
    stepped_worker: RunningWorker,
) -> None:
    loop = asyncio.get_running_loop()
    stub = stepped_worker.stub
    reports: list[float] = []
    watch = stub.WatchLoad(worker_pb2.WatchLoadRequest(interval_ms=100, watcher="router-a"))
    reported = asyncio.Event()
    reader = asyncio.ensure_future(_reports(watch, reports, reported))
    try:
        await asyncio.wait_for(reported.wait(), 10)
        # 120 tokens at 5 ms a step: about 0.6 s of frames.
        first = worker_pb2.SessionRequest(
            watcher="router-a",
            submit=[worker_pb2.SessionSubmit(handle=1, request=token_request(
                "lf-1", [5, 6], max_tokens=120, ignore_eos=True))])
        loaded: list[worker_pb2.Load] = []
        frames_at: list[float] = []
        async for frame in stub.Session(iter([first]), timeout=30):
            frames_at.append(loop.time())
            if frame.HasField("load"):
                loaded.append(frame.load)
        streaming = [t for t in reports if frames_at[0] + 0.1 < t < frames_at[-1]]
        # Every half interval or so a frame carried the load; the watch stayed quiet.
        span = frames_at[-1] - frames_at[0]
        assert len(loaded) >= span / 0.1, (len(loaded), span)
        assert any(load.running >= 1 and load.in_flight >= 1 for load in loaded)
        assert len(streaming) <= 1, streaming
        # The frames stopped: the watch reports every interval again.
        ended = loop.time()
        await asyncio.sleep(0.45)
        assert len([t for t in reports if t > ended]) >= 3
    finally:
        reader.cancel()
        watch.cancel()


async def test_frames_of_another_router_or_an_unnamed_session_carry_no_load(
    stepped_worker: RunningWorker,
) -> None:
    stub = stepped_worker.stub
    watch = stub.WatchLoad(worker_pb2.WatchLoadRequest(interval_ms=100, watcher="router-a"))
    await watch.read()
    try:
        for name in ("router-b", ""):
            request = token_request(f"lf-{name or 'none'}", [5, 6], max_tokens=30, ignore_eos=True)
            first = worker_pb2.SessionRequest(
                watcher=name, submit=[worker_pb2.SessionSubmit(handle=1, request=request)])
            frames = [frame async for frame in stub.Session(iter([first]), timeout=30)]
            assert frames and not any(frame.HasField("load") for frame in frames), name
    finally:
        watch.cancel()


async def _reports_during_frames(worker: RunningWorker, name: str, silence_ms: int) -> tuple[int, int]:
    """(reports while the frames of a 10-step request flowed, from its first frame on,
    frames that carried the load) for a watch of ``interval_ms`` 100 named ``name``."""
    loop = asyncio.get_running_loop()
    reports: list[float] = []
    watch = worker.stub.WatchLoad(worker_pb2.WatchLoadRequest(interval_ms=100, watcher=name,
                                                              silence_ms=silence_ms))
    reported = asyncio.Event()
    reader = asyncio.ensure_future(_reports(watch, reports, reported))
    try:
        await asyncio.wait_for(reported.wait(), 10)
        first = worker_pb2.SessionRequest(watcher=name, submit=[worker_pb2.SessionSubmit(
            handle=1, request=token_request(f"slow-{name}", [5, 6], max_tokens=10, ignore_eos=True))])
        frames_at: list[float] = []
        loaded = 0
        async for frame in worker.stub.Session(iter([first]), timeout=30):
            frames_at.append(loop.time())
            loaded += frame.HasField("load")
        return len([t for t in reports if frames_at[0] < t < frames_at[-1]]), loaded
    finally:
        reader.cancel()
        watch.cancel()


async def test_steps_longer_than_the_interval_send_no_reports_between_them_within_the_silence(
    tiny_deepseek_dir: Path,
) -> None:
    """A CPU engine's steps can take longer than the router's interval (about 170 ms at 32
    streams on two cores, against 150): without a silence the watch reported between every
    two steps; with one longer than a step, the frames alone carry the load."""
    worker = await start_running_worker(tiny_deepseek_dir, fake_token_delay_ms=140,
                                        canary_interval_s=30.0, canary_timeout_s=5.0)
    try:
        between, loaded = await _reports_during_frames(worker, "router-old", 0)
        assert between >= 4, between  # 7 gaps of 140 ms, each longer than the 100 ms interval
        between, loaded = await _reports_during_frames(worker, "router-new", 250)
        assert between == 0, between
        assert loaded >= 8, loaded  # every step's frame carried the load instead
    finally:
        await worker.close()


async def test_an_idle_worker_reports_at_the_silence_and_at_the_interval_once_a_request_comes(
    stepped_worker: RunningWorker,
) -> None:
    """An idle mesh's reports were a wake-up of worker and router 6.7 times a second at the
    router's 150 ms interval; idle, the load cannot change until a request comes."""
    loop = asyncio.get_running_loop()
    reports: list[tuple[float, worker_pb2.Load]] = []
    watch = stepped_worker.stub.WatchLoad(
        worker_pb2.WatchLoadRequest(interval_ms=100, watcher="router-a", silence_ms=250))
    try:
        async for report in watch:
            reports.append((loop.time(), report.load))
            if len(reports) == 4:
                break
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(reports)]
        assert all(gap >= 0.24 for gap in gaps), gaps
        assert all(load.in_flight == 0 and load.running == 0 for _, load in reports)
        # Another router's request (its frames carry no load for router-a) comes 30 ms
        # after a report: router-a hears an interval after that report, not the silence.
        await asyncio.sleep(0.03)
        first = worker_pb2.SessionRequest(watcher="router-b", submit=[worker_pb2.SessionSubmit(
            handle=1, request=token_request("idle-then-busy", [5, 6], max_tokens=60, ignore_eos=True))])
        session = stepped_worker.stub.Session(iter([first]), timeout=30)
        busy: list[tuple[float, worker_pb2.Load]] = []
        async for report in watch:
            busy.append((loop.time(), report.load))
            if len(busy) == 3:
                break
        assert busy[0][0] - reports[-1][0] < 0.2, busy[0][0] - reports[-1][0]
        assert any(load.in_flight >= 1 for _, load in busy)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(busy)]
        assert all(gap < 0.2 for gap in gaps), gaps  # busy: every interval
        frames = [frame async for frame in session]
        assert frames
    finally:
        watch.cancel()

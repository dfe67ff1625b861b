"""FramedSession's handle bookkeeping, with a minimal tier session (no grpc)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.framing import FramedSession
from services.common.metrics import RPC_REQUESTS


class Session(FramedSession[list[tuple[int, object]]]):
    """A frame is a list of (handle, event or error); each request waits on its event."""

    request_metric = ("test", "Generate")

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[int, asyncio.Event] = {}

    def _new_frame(self) -> list[tuple[int, object]]:
        return []

    def _add_error(self, frame: list[tuple[int, object]], handle: int, error: Exception) -> None:
        frame.append((handle, error))

    def submit(self, handle: int, name: str) -> None:
        if self._taken(handle):
            return
        gate = self.gates[handle] = asyncio.Event()

        async def work() -> None:
            await gate.wait()
            self._frame.append((handle, name))
            self._schedule()

        self._start(handle, name, work)


def count(code: str) -> float:
    return RPC_REQUESTS.labels("test", "Generate", code, "session")._value.get()


async def collect(session: Session) -> list[tuple[int, object]]:
    out: list[tuple[int, object]] = []
    async for frame in session.frames():
        out.extend(frame)
    return out


async def test_a_cancelled_handle_is_free_in_the_same_tick() -> None:
    """Submit, abort and submit again under one handle before any task ran: the second
    request runs, the first sends nothing, and the session ends when both are done."""
    session = Session()
    cancelled_before = count("CANCELLED")
    ok_before = count("OK")
    session.submit(1, "first")
    session._cancel(1)
    session.submit(1, "second")
    session.input_done()
    frames = asyncio.ensure_future(collect(session))
    await asyncio.sleep(0)
    session.gates[1].set()
    events = await asyncio.wait_for(frames, 5)
    assert events == [(1, "second")]
    assert session.running == 0
    assert count("CANCELLED") == cancelled_before + 1
    assert count("OK") == ok_before + 1


async def test_a_taken_handle_is_refused_and_close_waits_for_cancelled_tasks() -> None:
    session = Session()
    session.submit(7, "running")
    session.submit(7, "again")  # refused: the first still runs
    await asyncio.sleep(0)
    assert session.running == 1
    frame = session._frame
    assert len(frame) == 1 and frame[0][0] == 7
    assert "handle 7 is already running" in str(frame[0][1])
    task = session._tasks[7]
    session._cancel(7)
    assert session.running == 0
    await session.close()
    assert task.done() and task.cancelled()


@pytest.mark.parametrize("abort_twice", [False, True])
async def test_cancelling_an_unknown_or_ended_handle_is_ignored(abort_twice: bool) -> None:
    session = Session()
    session._cancel(3)
    session.submit(3, "x")
    session.gates[3].set()
    session.input_done()
    events = await asyncio.wait_for(collect(session), 5)
    assert events == [(3, "x")]
    if abort_twice:
        session._cancel(3)
    assert session.running == 0


async def test_taskless_requests_hold_their_handle_until_ended_and_are_counted() -> None:
    """A request fed by callbacks (no task): its handle is taken from _open to _ended,
    the frames go on until it ended, and it is counted with the code it ended with."""
    session = Session()
    ok_before, deadline_before = count("OK"), count("DEADLINE_EXCEEDED")
    session._open(5, "callbacks")
    session.submit(5, "again")  # refused: the task-less request holds the handle
    assert session.running == 1
    session.input_done()
    frames = asyncio.ensure_future(collect(session))
    await asyncio.sleep(0)
    session._frame.append((5, "token"))
    session._schedule()
    session._open(6, "late")
    session._ended(6, "DEADLINE_EXCEEDED")
    session._ended(6, "OK")  # once only
    assert not frames.done()
    session._frame.append((5, "final"))
    session._ended(5, "OK")
    events = await asyncio.wait_for(frames, 5)
    assert [e for h, e in events if h == 5][1:] == ["token", "final"]
    assert "handle 5 is already running" in str(events[0][1])
    assert session.running == 0
    assert count("OK") == ok_before + 1 and count("DEADLINE_EXCEEDED") == deadline_before + 1


async def test_frames_go_out_directly_and_what_the_writer_refuses_comes_in_order() -> None:
    """With ``direct`` set, each loop turn's frame is written from the flush callback
    (frames() yields nothing). A frame the writer refuses (a backed-up connection) or
    fails on goes through frames(), and so do the frames after it until frames() has
    yielded it: the caller gets every event once, in order. At the end frames() returns
    and the writer is dropped."""
    session = Session()
    written: list[list[tuple[int, object]]] = []
    refuse = {"next": 0}

    def direct(frame: list[tuple[int, object]]) -> bool:
        if refuse["next"]:
            refuse["next"] -= 1
            return False
        if any(name == "boom" for _, name in frame):
            raise RuntimeError("conversion failed")
        written.append(frame)
        return True

    session.direct = direct
    yielded: list[list[tuple[int, object]]] = []

    async def consume() -> None:
        async for frame in session.frames():
            yielded.append(frame)

    consumer = asyncio.ensure_future(consume())
    for handle, name in [(1, "a"), (2, "b"), (3, "boom"), (4, "c"), (5, "d")]:
        session.submit(handle, name)
    await asyncio.sleep(0)
    session.gates[1].set()
    await asyncio.sleep(0.01)
    assert written == [[(1, "a")]] and yielded == []

    refuse["next"] = 1
    session.gates[2].set()
    await asyncio.sleep(0.01)
    assert yielded == [[(2, "b")]]  # refused: through frames()

    session.gates[3].set()
    await asyncio.sleep(0.01)
    assert yielded == [[(2, "b")], [(3, "boom")]]  # failed: through frames() as well

    session.gates[4].set()
    await asyncio.sleep(0.01)
    assert written == [[(1, "a")], [(4, "c")]]  # direct again once nothing is held
    session.input_done()
    session.gates[5].set()
    await asyncio.wait_for(consumer, 2)
    assert written[-1] == [(5, "d")]
    events = [e for frame in written + yielded for e in frame]
    assert sorted(h for h, _ in events) == [1, 2, 3, 4, 5]
    assert session.direct is None and session.frames_sent == 5


async def test_a_held_frame_keeps_later_frames_behind_it() -> None:
    """While frames() has not yielded a held frame (its task has not run yet), a later
    frame is not written ahead of it."""
    session = Session()
    written: list[object] = []
    answers = iter([False, True, True])
    session.direct = lambda frame: next(answers) and not written.append(frame)  # type: ignore[func-returns-value]
    order: list[object] = []
    for handle in (1, 2):
        session.submit(handle, f"r{handle}")
    await asyncio.sleep(0)
    session.gates[1].set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # r1 refused: held; frames() is not being iterated yet
    session.gates[2].set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert written == []  # r2 went behind r1, not ahead of it
    session.input_done()
    async for frame in session.frames():
        order.extend(frame)
    assert [name for _, name in order] == ["r1", "r2"]

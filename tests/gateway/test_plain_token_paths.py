"""The gateway's steady-state paths for plain tokens and text, without a connection.

A router session frame's token ids of a request without logprobs go to the request's
``step_tokens`` as a list (no RouterDelta per request and frame); a request that asked
for logprobs, or has no ``step_tokens``, gets RouterDeltas. A postprocessor frame's text
goes to the request's ``on_text`` as a string (no PostDelta); without a listener it is
queued as a PostDelta, and after the request's final nothing is taken.
"""

from __future__ import annotations

import types
from typing import Any

from gateway.core import _RouterSink
from gateway.postsession import SessionPost
from gateway.routersession import RequestEvents, RouterSessionLink
from gateway.types import PostDelta, PostFinal, RouterDelta
from llmesh.common.v1 import common_pb2
from llmesh.router.v1 import router_pb2


def _link(requests: dict[int, RequestEvents]) -> Any:
    finished: list[tuple[int, object]] = []
    return types.SimpleNamespace(requests=requests, finished=finished,
                                 _finish=lambda handle, item: finished.append((handle, item)))


def test_a_router_frame_hands_plain_token_ids_to_step_tokens() -> None:
    plain: list[list[int]] = []
    deltas: list[RouterDelta] = []
    direct, with_logprobs, without_step = RequestEvents(), RequestEvents(), RequestEvents()
    sink = _RouterSink(deltas.append, plain.append)
    for queue in (direct, with_logprobs):
        queue.on_delta, queue.step_tokens = sink, sink.step_tokens
    without_step.on_delta = deltas.append
    link = _link({1: direct, 2: with_logprobs, 3: without_step})
    frame = router_pb2.SessionResponse(
        handles=[1, 2, 3, 9], token_counts=[2, 1, 1, 1], token_ids=[10, 11, 20, 30, 90],
        logprobs=[router_pb2.SessionLogprobs(handle=2, logprobs=[
            common_pb2.TokenLogprob(token_id=20, logprob=-0.5)])],
    )
    RouterSessionLink._dispatch(link, frame)
    assert plain == [[10, 11]]
    assert [(d.token_ids, [lp.token_id for lp in d.logprobs]) for d in deltas] == [([20], [20]), ([30], [])]
    assert all(q.empty() for q in (direct, with_logprobs, without_step))
    assert link.finished == []


def _post() -> SessionPost:
    link: Any = types.SimpleNamespace(frames_received=1)
    return SessionPost(link, handle=1, deadline=None, open_call=None)  # type: ignore[arg-type]


def test_a_postprocessor_frames_text_goes_to_the_listener_as_a_string() -> None:
    listened = _post()
    texts: list[str] = []
    listened.listen(texts.append)
    listened.deliver_text("Hel")
    listened.deliver_text("lo")
    assert texts == ["Hel", "lo"] and listened.items.empty()

    queued = _post()
    queued.deliver_text("x")
    assert queued.items.get_nowait() == PostDelta(text="x")

    listened.deliver(PostFinal(finish_reason="stop"))
    listened.deliver_text("late")
    assert texts == ["Hel", "lo"]
    assert isinstance(listened.items.get_nowait(), PostFinal) and listened.items.empty()

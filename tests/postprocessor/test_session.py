"""PostprocessService.Session over a real aio channel: many requests multiplexed in one
stream give exactly what one Process stream per request gives, one frame per message."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from llmesh.postprocess.v1 import postprocess_pb2 as pb
from llmesh.postprocess.v1 import postprocess_pb2_grpc
from services.postprocessor import session as session_module
from tests.postprocessor.conftest import SMOL, TINY

CARD = "5500 0055 5555 5559"
SENTENCE = "The bank opened a new branch in Shanghai 上海 today. "


@pytest.fixture
def stub(postprocessor_server):
    _, _, channel = postprocessor_server
    return postprocess_pb2_grpc.PostprocessServiceStub(channel)


def _encode(tokenizers, model, text):
    return tokenizers[model].tokenizer.encode(text, add_special_tokens=False).ids


@dataclass
class Case:
    model: str
    text: str
    config: dict[str, Any] = field(default_factory=dict)
    chunk: int = 1
    """Tokens per message."""
    end: int = pb.UPSTREAM_FINISH_REASON_STOP


CASES = [
    # A stop string spanning several tokens, sent one token at a time.
    Case(SMOL, "Sure. Answer: Paris\n\nUser: next question", {"stop": ["\n\nUser:"]}),
    Case(SMOL, "one two STOP three", {"stop": ["STOP"], "include_stop_str_in_output": True}, chunk=2),
    # Sensitive data split over token boundaries.
    Case(SMOL, f"Use card {CARD} to pay, then continue.", {"filter_mode": pb.FILTER_MODE_REDACT}),
    Case(SMOL, f"Use card {CARD} to pay, then continue.", {"filter_mode": pb.FILTER_MODE_BLOCK}),
    Case(SMOL, "Write to jane.doe@example.com today", {"filter_mode": pb.FILTER_MODE_REDACT}, chunk=3),
    # Multi-byte characters whose bytes span tokens.
    Case(TINY, "你好！The answer is 42 😀.", {"filter_mode": pb.FILTER_MODE_OFF},
         end=pb.UPSTREAM_FINISH_REASON_LENGTH),
    Case(TINY, "表情 🤖🎉 and ünïcödé", {"filter_mode": pb.FILTER_MODE_OFF}, chunk=2),
    # A replay into a new replica: the characters already delivered are skipped.
    Case(TINY, "Hello 世界, replayed stream.", {"skip_chars": 9}),
    # Several slices of work in one message (longer than the session's slice).
    Case(TINY, SENTENCE * 30 + "FIN and more", {"stop": ["FIN"]}, chunk=400),
    Case(SMOL, "", {}),
]


async def _process(stub, config: dict[str, Any], chunks: list[list[int]], end: int):
    async def gen():
        yield pb.ProcessRequest(config=pb.ProcessConfig(**config))
        for chunk in chunks:
            yield pb.ProcessRequest(tokens=pb.ProcessTokens(token_ids=chunk))
        yield pb.ProcessRequest(end=pb.ProcessEnd(finish_reason=end))

    text, finals = [], []
    async for reply in stub.Process(gen(), timeout=20):
        if reply.HasField("delta"):
            text.append(reply.delta.text)
        else:
            finals.append(reply.final)
    assert len(finals) == 1
    return "".join(text), finals[0]


def _columns(entries: list[tuple[int, list[int]]]) -> dict[str, list[int]]:
    return {
        "handles": [h for h, _ in entries],
        "token_counts": [len(ids) for _, ids in entries],
        "token_ids": [i for _, ids in entries for i in ids],
    }


@dataclass
class Outcome:
    text: list[str] = field(default_factory=list)
    final: pb.ProcessFinal | None = None
    error: Any = None


def _absorb(frame: pb.SessionResponse, outcomes: dict[int, Outcome]) -> None:
    assert len(frame.handles) == len(frame.texts) == len(set(frame.handles))
    for handle, text in zip(frame.handles, frame.texts, strict=True):
        outcome = outcomes.setdefault(handle, Outcome())
        assert outcome.final is None and outcome.error is None, "text after the end"
        outcome.text.append(text)
    for final in frame.finals:
        outcome = outcomes.setdefault(final.handle, Outcome())
        assert outcome.final is None and outcome.error is None
        outcome.final = final.final
    for error in frame.errors:
        outcome = outcomes.setdefault(error.handle, Outcome())
        assert outcome.final is None and outcome.error is None
        outcome.error = error.error


async def _run_session(stub, messages: list[pb.SessionRequest]) -> tuple[dict[int, Outcome], int]:
    """Send every message, half-close, and read every frame to the end of the call."""
    call = stub.Session(timeout=20)
    for message in messages:
        await call.write(message)
    await call.done_writing()
    outcomes: dict[int, Outcome] = {}
    frames = 0
    async for frame in call:
        frames += 1
        _absorb(frame, outcomes)
    assert await call.code() is grpc.StatusCode.OK
    return outcomes, frames


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


async def test_interleaved_handles_give_what_one_process_stream_each_gives(stub, tokenizers):
    handles = {100 + i: case for i, case in enumerate(CASES)}
    chunks = {h: _chunks(_encode(tokenizers, c.model, c.text), c.chunk) for h, c in handles.items()}
    expected = {
        h: await _process(stub, {"model": c.model, **c.config}, chunks[h], c.end) for h, c in handles.items()
    }
    # Round r carries chunk r of every request still sending; a request's end goes in the
    # message with its last chunk. Requests that stopped early keep sending (ignored).
    rounds = max(len(c) for c in chunks.values()) + 1
    messages = []
    for r in range(rounds):
        message = pb.SessionRequest(**_columns([(h, chunks[h][r]) for h in handles if r < len(chunks[h])]))
        if r == 0:
            message.opens.extend(pb.SessionOpen(handle=h, config=pb.ProcessConfig(model=c.model, **c.config))
                                 for h, c in handles.items())
        message.ends.extend(pb.SessionEnd(handle=h, finish_reason=c.end)
                            for h, c in handles.items() if r == max(len(chunks[h]) - 1, 0))
        messages.append(message)
    outcomes, frames = await _run_session(stub, messages)
    assert frames <= len(messages)
    assert set(outcomes) == set(handles)
    for h, (text, final) in expected.items():
        outcome = outcomes[h]
        assert outcome.error is None, (h, outcome.error)
        assert "".join(outcome.text) == text, handles[h]
        assert outcome.final == final, handles[h]
    # The cases do what they are named for.
    assert expected[100][1].matched_stop == "\n\nUser:" and expected[100][0] == "Sure. Answer: Paris"
    assert expected[102][0] == "Use card [REDACTED:card] to pay, then continue."
    assert expected[103][1].finish_reason == pb.OUTPUT_FINISH_REASON_CONTENT_FILTER
    assert expected[105][0] == "你好！The answer is 42 😀."
    assert expected[107][0] == "Hello 世界, replayed stream."[9:]
    assert expected[108][0] == SENTENCE * 30


async def test_a_frame_of_many_handles_is_answered_by_one_frame(stub, tokenizers):
    ids = _encode(tokenizers, SMOL, "Hello there, how are you today? Fine, thanks.")
    handles = list(range(1, 9))
    counted_before = _tokens_counted(SMOL)
    call = stub.Session(timeout=20)
    config = pb.ProcessConfig(model=SMOL, filter_mode=pb.FILTER_MODE_OFF)  # nothing held back
    opens = [pb.SessionOpen(handle=h, config=config) for h in handles]
    await call.write(pb.SessionRequest(opens=opens, **_columns([(h, ids[:4]) for h in handles])))
    first = await asyncio.wait_for(call.read(), 5)
    assert list(first.handles) == handles
    assert set(first.texts) == {tokenizers[SMOL].tokenizer.decode(ids[:4])}
    await call.write(pb.SessionRequest(
        **_columns([(h, ids[4:]) for h in handles]),
        ends=[pb.SessionEnd(handle=h, finish_reason=pb.UPSTREAM_FINISH_REASON_LENGTH) for h in handles],
    ))
    second = await asyncio.wait_for(call.read(), 5)
    assert list(second.handles) == handles
    assert [f.handle for f in second.finals] == handles
    assert all(f.final.completion_tokens == len(ids) for f in second.finals)
    assert all(f.final.finish_reason == pb.OUTPUT_FINISH_REASON_LENGTH for f in second.finals)
    # Nothing more: the call ends when the caller closes its side.
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
    # Every token detokenized is counted once (one increment per message, not per handle).
    assert _tokens_counted(SMOL) - counted_before == len(handles) * len(ids)


def _tokens_counted(model: str) -> float:
    return REGISTRY.get_sample_value("llmesh_postprocessor_tokens_total", {"model": model}) or 0.0


async def test_one_handles_bad_input_is_its_error_alone(stub, tokenizers):
    ids = _encode(tokenizers, TINY, "All good here.")
    messages = [
        pb.SessionRequest(
            opens=[
                pb.SessionOpen(handle=1, config=pb.ProcessConfig(model=TINY)),
                pb.SessionOpen(handle=2, config=pb.ProcessConfig(stop=["a", "b", "c", "d", "e"])),
                pb.SessionOpen(handle=3, config=pb.ProcessConfig(model="gpt-17")),
                pb.SessionOpen(handle=4, config=pb.ProcessConfig(stop=["x" * 33])),
                pb.SessionOpen(handle=5, config=pb.ProcessConfig(filter_mode=99)),  # type: ignore[arg-type]
                pb.SessionOpen(handle=6, config=pb.ProcessConfig(model=TINY)),
                pb.SessionOpen(handle=1, config=pb.ProcessConfig(model=TINY)),  # already open
            ],
            **_columns([(1, ids[:2]), (6, [5, 4096]), (77, [5])]),
        ),
        pb.SessionRequest(**_columns([(1, ids[2:]), (6, [5])]),
                          ends=[pb.SessionEnd(handle=1), pb.SessionEnd(handle=88)]),
    ]
    outcomes, _ = await _run_session(stub, messages)
    assert set(outcomes) == {1, 2, 3, 4, 5, 6, 77, 88}

    def violation(handle: int) -> tuple[int, list[str]]:
        error = outcomes[handle].error
        assert error is not None and outcomes[handle].final is None
        return error.code, [v.field for v in error.field_violations]

    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert violation(2) == (invalid, ["config.stop"])
    assert violation(4) == (invalid, ["config.stop[0]"])
    assert violation(5) == (invalid, ["config.filter_mode"])
    assert violation(6) == (invalid, ["tokens.token_ids[1]"])  # ids out of the vocabulary
    assert violation(77) == (invalid, ["handles"])  # tokens for a handle never opened
    assert violation(88) == (invalid, ["ends.handle"])
    assert outcomes[3].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "config.model" in outcomes[3].error.message
    # Handle 1 was opened twice: the second open is its error, and it ends there.
    assert violation(1) == (invalid, ["opens.handle"])

    # The others' errors never touched a good request.
    messages = [pb.SessionRequest(
        opens=[pb.SessionOpen(handle=1, config=pb.ProcessConfig(model=TINY)),
               pb.SessionOpen(handle=2, config=pb.ProcessConfig(model="gpt-17"))],
        **_columns([(1, ids), (2, ids), (3, ids)]),
        ends=[pb.SessionEnd(handle=1), pb.SessionEnd(handle=2)],
    )]
    outcomes, frames = await _run_session(stub, messages)
    assert frames == 1
    assert "".join(outcomes[1].text) == "All good here."
    assert outcomes[1].final.completion_tokens == len(ids)
    assert outcomes[2].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert outcomes[3].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


async def test_token_columns_that_do_not_line_up_fail_only_their_handles(stub, tokenizers):
    ids = _encode(tokenizers, TINY, "fine")
    opens = [pb.SessionOpen(handle=h, config=pb.ProcessConfig(model=TINY)) for h in (1, 2)]
    messages = [
        pb.SessionRequest(opens=opens, handles=[2], token_counts=[3], token_ids=[5]),
        pb.SessionRequest(**_columns([(1, ids)]), ends=[pb.SessionEnd(handle=1)]),
    ]
    outcomes, _ = await _run_session(stub, messages)
    assert [v.field for v in outcomes[2].error.field_violations] == ["token_counts"]
    assert "".join(outcomes[1].text) == "fine" and outcomes[1].final is not None


async def test_closed_handle_gets_nothing_more_and_its_handle_is_free(stub, tokenizers):
    ids = _encode(tokenizers, SMOL, "first part, second part")
    call = stub.Session(timeout=20)
    opens = [pb.SessionOpen(handle=h, config=pb.ProcessConfig(model=SMOL)) for h in (1, 2)]
    await call.write(pb.SessionRequest(opens=opens, **_columns([(1, ids[:3]), (2, ids[:3])])))
    outcomes: dict[int, Outcome] = {}
    _absorb(await asyncio.wait_for(call.read(), 5), outcomes)
    # Close 1 (a close of a handle never opened is no error), then everything else.
    await call.write(pb.SessionRequest(closes=[1, 55]))
    await call.write(pb.SessionRequest(**_columns([(1, ids[3:]), (2, ids[3:])]),
                                       ends=[pb.SessionEnd(handle=1), pb.SessionEnd(handle=2)]))
    # The handle is free again: a new request under it.
    await call.write(pb.SessionRequest(opens=[pb.SessionOpen(handle=1, config=pb.ProcessConfig(model=SMOL))],
                                       **_columns([(1, ids)]), ends=[pb.SessionEnd(handle=1)]))
    await call.done_writing()
    frames = []
    while (frame := await asyncio.wait_for(call.read(), 5)) is not grpc.aio.EOF:
        frames.append(frame)
    assert len(frames) == 2
    assert list(frames[0].handles) == [2] and [f.handle for f in frames[0].finals] == [2]
    assert not frames[0].errors
    _absorb(frames[0], outcomes)
    assert "".join(outcomes[2].text) == "first part, second part"
    assert list(frames[1].handles) == [1] and frames[1].texts[0] == "first part, second part"
    assert frames[1].finals[0].final.completion_tokens == len(ids)


async def test_each_request_has_a_span_under_its_traceparent_and_session_end_frees_handles(
    stub, tokenizers, monkeypatch: pytest.MonkeyPatch,
):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(session_module, "tracer", lambda: provider.get_tracer("test"))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ids = _encode(tokenizers, SMOL, "traced text")
    call = stub.Session(timeout=20)
    await call.write(pb.SessionRequest(
        opens=[pb.SessionOpen(handle=1, config=pb.ProcessConfig(model=SMOL), traceparent=parent),
               pb.SessionOpen(handle=2, config=pb.ProcessConfig(model=SMOL))],
        **_columns([(1, ids), (2, ids)]), ends=[pb.SessionEnd(handle=1)],
    ))
    frame = await asyncio.wait_for(call.read(), 5)
    assert [f.handle for f in frame.finals] == [1]
    call.cancel()  # handle 2 is still open: the session's end drops it

    def spans() -> dict[int, Any]:
        return {s.attributes["llmesh.handle"]: s for s in exporter.get_finished_spans()
                if s.name == "llmesh.postprocessor/Session.process"}

    for _ in range(200):
        if len(spans()) == 2:
            break
        await asyncio.sleep(0.01)
    traced, dropped = spans()[1], spans()[2]
    assert traced.kind is trace.SpanKind.SERVER
    assert f"{traced.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert traced.parent is not None and f"{traced.parent.span_id:016x}" == "b7ad6b7169203331"
    assert traced.attributes["llmesh.finish_reason"] == "stop"
    assert traced.attributes["llmesh.completion_tokens"] == len(ids)
    assert dropped.parent is None
    assert dropped.attributes["llmesh.dropped"] == "session ended"

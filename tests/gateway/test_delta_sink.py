"""Released text handed straight to a sink (the HTTP surface's writer) instead of through
the stream's iterator: what it takes, what it leaves to the iterator, and that the client
sees the text once and in order either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from gateway.core import Deadline, GatewayCore, sha256_text
from gateway.http import _WRITE_LIMIT, _SseWriter
from gateway.tenants import Tenant
from gateway.types import (
    Completion,
    Final,
    FinishReason,
    GenerateCall,
    RouterDelta,
    RouterFinal,
    Sampling,
    TextDelta,
    TokenGeneration,
)
from tests.gateway.test_failover_units import FULL_TEXT, MAX_TOKENS, _core, _Router


class _BurstRouter(_Router):
    """Every token in one delta: the postprocessor's text for all of them arrives at once,
    before the stream's iterator gets a turn."""

    def __init__(self) -> None:
        super().__init__([None])

    async def generate(
        self, replica: int, request: TokenGeneration, *, resume_token_ids: list[int],
        resumed: int, timeout: float | None, on_delta: object = None,
    ) -> AsyncIterator[RouterDelta | RouterFinal]:
        yield RouterDelta(token_ids=[100 + n for n in range(MAX_TOKENS)])
        await asyncio.sleep(0.01)
        yield RouterFinal(Final(FinishReason.LENGTH, completion_tokens=MAX_TOKENS))


class _Sink:
    """Ready after ``refusals`` answers of not ready; logs what it takes into ``seen``."""

    def __init__(self, seen: list[tuple[str, str]], refusals: int = 0) -> None:
        self.seen, self.refusals = seen, refusals

    def ready(self) -> bool:
        if self.refusals > 0:
            self.refusals -= 1
            return False
        return True

    def send(self, delta: TextDelta) -> None:
        self.seen.append(("sink", delta.text))


class _Audit:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def write(self, entry: dict[str, Any], event: str = "request") -> None:
        self.entries.append(entry)


async def _stream(core: GatewayCore, sink: _Sink, seen: list[tuple[str, str]]) -> Completion:
    completion: Completion | None = None
    call = GenerateCall(prompt="x", sampling=Sampling(max_tokens=MAX_TOKENS))
    async for item in core.generate_stream(Tenant(name="t"), call, Deadline.after(10), sink=sink):
        if isinstance(item, TextDelta):
            seen.append(("iterator", item.text))
        else:
            completion = item
    assert completion is not None
    return completion


async def test_a_ready_sink_takes_every_delta_and_the_iterator_only_the_completion() -> None:
    core = _core(_Router([None]))
    audit = _Audit()
    core.audit = audit  # type: ignore[assignment]
    seen: list[tuple[str, str]] = []
    completion = await _stream(core, _Sink(seen), seen)
    assert [where for where, _ in seen] == ["sink"] * MAX_TOKENS  # one delta per token (interval 1)
    assert "".join(text for _, text in seen) == FULL_TEXT
    assert completion.completion_tokens == MAX_TOKENS
    # The audit entry hashes what the client got, whichever way it went.
    [entry] = audit.entries
    assert entry["output_sha256"] == sha256_text(FULL_TEXT)
    assert entry["output_chars"] == len(FULL_TEXT)


async def test_text_waits_in_the_iterator_until_the_sink_is_ready_and_never_overtakes() -> None:
    for router, refusals in [(r, n) for r in (_Router, _BurstRouter) for n in (1, 2, 4, MAX_TOKENS)]:
        # The steady router's first token comes after the postprocessor's open, as a
        # real one's does (its prefill takes longer than an open): no replayed burst.
        core = _core(router() if router is _BurstRouter else router([None], turns=5))
        seen: list[tuple[str, str]] = []
        await _stream(core, _Sink(seen, refusals=refusals), seen)
        # Logged in the order the client would write it: the text is whole and in order.
        assert "".join(text for _, text in seen) == FULL_TEXT, (router, refusals)
        assert seen[0][0] == "iterator" and seen[0][1].startswith("<100>")  # the first was refused
        if refusals < MAX_TOKENS and router is _Router:
            assert any(where == "sink" for where, _ in seen), refusals


class _Transport(asyncio.WriteTransport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


class _Started:
    """What _SseWriter.start reads of aiohttp's request and response."""

    def __init__(self, transport: asyncio.BaseTransport, chunked: bool) -> None:
        self.transport, self.chunked = transport, chunked


def test_the_http_writer_is_ready_only_for_an_open_connection_with_room() -> None:
    writer = _SseWriter()
    assert not writer.ready()  # before the headers and the first event went out
    transport = _Transport()
    started = _Started(transport, chunked=True)
    writer.start(started, started, b'data: {"t": ', b"}\n\n")  # type: ignore[arg-type]
    assert writer.ready()
    transport.buffered = _WRITE_LIMIT  # a slow client: the awaited write takes over
    assert not writer.ready()
    transport.buffered = 0
    transport.closing = True  # the client went away
    assert not writer.ready()


def test_the_http_writer_frames_each_event_as_one_chunk() -> None:
    transport = _Transport()
    writer = _SseWriter()
    started = _Started(transport, chunked=True)
    writer.start(started, started, b'data: {"t": ', b"}\n\n")  # type: ignore[arg-type]
    writer.send(TextDelta(text='caf\u00e9 "1"'))
    event = b'data: {"t": "caf\\u00e9 \\"1\\""}\n\n'
    assert transport.written == [b"%x\r\n" % len(event) + event + b"\r\n"]
    # An HTTP/1.0 client's response is not chunked: the event as it is.
    plain = _Transport()
    started = _Started(plain, chunked=False)
    writer.start(started, started, b'data: {"t": ', b"}\n\n")  # type: ignore[arg-type]
    writer.send(TextDelta(text="x"))
    assert plain.written == [b'data: {"t": "x"}\n\n']

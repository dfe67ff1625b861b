"""The framed Session transport (services/common/sessionwire.py), in process.

A Session handler of the shape every tier's servicer has (a request iterator in, frames
out) is served on a gRPC port and on a framed listener; callers reach it through a
:class:`SessionOpener`, as the router's worker link and the gateway's session links do.
Covered: the calls run over the listener, statuses keep their google.rpc details, the
handler is cancelled when the caller goes away, a silent peer is given up, pings keep an
idle session alive, a peer without a listener (or whose port refuses) is called over
gRPC, bad framing is refused, and the caller identity policy holds under mutual TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from llmesh.certs import write_dev_certs
from llmesh.common.v1 import session_transport_pb2, session_transport_pb2_grpc
from llmesh.worker.v1 import worker_pb2
from services.common import sessionwire
from services.common.authz import CallerAuthorizer
from services.common.errors import InvalidArgument, error_from_rpc
from services.common.sessionwire import (
    PREFACE,
    FramedCall,
    SessionListener,
    SessionMethod,
    SessionOpener,
    SessionTransportServicer,
    frame,
    target_host,
)
from services.common.settings import TlsSettings
from tests.router.helpers import wait_for

METHOD = "/llmesh.worker.v1.WorkerService/Session"


class EchoSessions:
    """A Session handler: each submission is answered by a frame naming its handle, a
    submission of handle 99 fails the call with a field violation, one of handle 7
    blocks until cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.blocking = asyncio.Event()
        self.calls = 0

    async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest], context: Any
                      ) -> AsyncIterator[worker_pb2.SessionResponse]:
        self.calls += 1
        try:
            async for message in requests:
                for sub in message.submit:
                    if sub.handle == 99:
                        raise InvalidArgument("submit.request.sampling.seed", "must fit in 63 bits")
                    if sub.handle == 7:
                        self.blocking.set()
                        await asyncio.Event().wait()
                    yield worker_pb2.SessionResponse(
                        handles=[sub.handle], token_counts=[1], token_ids=[sub.handle])
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


class Peer:
    """A gRPC port (with or without GetSessionEndpoint) and, maybe, a framed listener."""

    def __init__(self, handler: EchoSessions, *, listener: bool = True, tls: TlsSettings | None = None,
                 authorizer: CallerAuthorizer | None = None) -> None:
        self.handler = handler
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "llmesh.worker.v1.WorkerService",
            {"Session": grpc.stream_stream_rpc_method_handler(
                handler.Session, request_deserializer=worker_pb2.SessionRequest.FromString,
                response_serializer=worker_pb2.SessionResponse.SerializeToString)}),))
        self.listener: SessionListener | None = None
        if listener:
            self.listener = SessionListener(
                "worker", {METHOD: SessionMethod(handler.Session, worker_pb2.SessionRequest)},
                host="127.0.0.1", tls=tls, authorizer=authorizer)
            session_transport_pb2_grpc.add_SessionTransportServiceServicer_to_server(
                SessionTransportServicer(self.listener), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> Peer:
        await self.server.start()
        if self.listener is not None:
            await self.listener.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.listener is not None:
            await self.listener.stop(0)
        await self.server.stop(0)


def submit(*handles: int) -> worker_pb2.SessionRequest:
    return worker_pb2.SessionRequest(submit=[worker_pb2.SessionSubmit(handle=h) for h in handles])


async def messages(*items: worker_pb2.SessionRequest, hold: asyncio.Event | None = None
                   ) -> AsyncIterator[worker_pb2.SessionRequest]:
    for item in items:
        yield item
    if hold is not None:
        await hold.wait()


def open_call(opener: SessionOpener, requests: AsyncIterator[worker_pb2.SessionRequest]) -> FramedCall:
    session = opener.channel.stream_stream(
        METHOD, request_serializer=worker_pb2.SessionRequest.SerializeToString,
        response_deserializer=worker_pb2.SessionResponse.FromString)
    return opener.open(METHOD, session, requests, worker_pb2.SessionResponse)


@contextlib.asynccontextmanager
async def opener_for(peer: Peer, tls: TlsSettings | None = None) -> AsyncIterator[SessionOpener]:
    channel = grpc.aio.insecure_channel(peer.target)
    try:
        yield SessionOpener(channel, peer.target, tls=tls, server_name="localhost")
    finally:
        await channel.close()


async def collect_handles(call: FramedCall, into: list[int]) -> None:
    """Append the handles of every response to ``into`` as they come."""
    async for response in call:
        into.extend(response.handles)


async def handles_of(call: FramedCall) -> list[int]:
    return [h for response in [r async for r in call] for h in response.handles]


async def test_a_session_runs_over_the_listener() -> None:
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1, 2), submit(3)))
        assert await handles_of(call) == [1, 2, 3]
        assert call.framed
        assert (opener.framed_calls, opener.grpc_calls) == (1, 0)
        assert peer.listener is not None and peer.listener.accepted == 1
        # The endpoint is asked once per peer, not per call.
        again = open_call(opener, messages(submit(4)))
        assert await handles_of(again) == [4]
        assert opener.framed_calls == 2


async def test_a_message_written_at_once_keeps_its_place_after_the_queued_ones() -> None:
    """send_now writes without the sender task only when nothing is before it: while the
    call connects it refuses (the caller queues), over the listener it writes, and what
    it wrote arrives in order with what went through the queue."""
    queue: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()

    async def queued() -> AsyncIterator[worker_pb2.SessionRequest]:
        while (item := await queue.get()) is not None:
            yield item

    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        call = open_call(opener, queued())
        assert not call.send_now(submit(1))  # still connecting: the caller queues it
        queue.put_nowait(submit(1))
        answers: list[int] = []
        reader = asyncio.ensure_future(collect_handles(call, answers))
        await wait_for(lambda: answers == [1])
        assert call.framed
        assert call.send_now(submit(2, 3))
        queue.put_nowait(submit(4))
        await wait_for(lambda: answers == [1, 2, 3, 4])
        queue.put_nowait(None)
        await reader


async def test_a_call_over_grpc_never_writes_at_once() -> None:
    async with Peer(EchoSessions(), listener=False) as peer, opener_for(peer) as opener:
        hold = asyncio.Event()
        call = open_call(opener, messages(submit(5), hold=hold))
        answers: list[int] = []
        reader = asyncio.ensure_future(collect_handles(call, answers))
        await wait_for(lambda: answers == [5])
        assert not call.framed and not call.send_now(submit(6))
        hold.set()
        await reader
        assert answers == [5]


async def test_a_failed_call_keeps_its_field_violation() -> None:
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1), submit(99), hold=asyncio.Event()))
        seen: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                seen += list(response.handles)
        assert seen == [1]
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        error = error_from_rpc(info.value)
        assert isinstance(error, InvalidArgument)
        assert error.field == "submit.request.sampling.seed"
        assert "63 bits" in str(error)


@pytest.mark.parametrize("listener", [True, False], ids=["framed", "grpc"])
async def test_a_listening_caller_gets_each_response_as_it_is_read(listener: bool) -> None:
    """Over the listener a caller that listens gets every response from the callback
    that read it (no task runs it) and the iteration only ends; over gRPC nothing calls
    back and the responses are iterated, so one handler serves both."""
    async with Peer(EchoSessions(), listener=listener) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1, 2), submit(3)))
        heard: list[tuple[int, bool]] = []
        call.listen(lambda response: heard.extend(
            (h, asyncio.current_task() is None) for h in response.handles))
        iterated = await handles_of(call)
        assert call.framed is listener
        if listener:
            assert iterated == [] and heard == [(1, True), (2, True), (3, True)]
        else:
            assert iterated == [1, 2, 3] and heard == []


async def test_a_listened_call_still_fails_with_its_status_after_what_it_delivered() -> None:
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1), submit(99), hold=asyncio.Event()))
        heard: list[int] = []
        call.listen(lambda response: heard.extend(response.handles))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            assert [r async for r in call] == []
        assert heard == [1]
        error = error_from_rpc(info.value)
        assert isinstance(error, InvalidArgument) and error.field == "submit.request.sampling.seed"


async def test_a_listener_that_raises_ends_the_call_with_its_error() -> None:
    """The callback's error ends the call as the iteration's would have: the caller's
    iteration raises it, nothing more is delivered, and the peer's handler is cancelled."""
    handler = EchoSessions()
    async with Peer(handler) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1), submit(2), submit(7), hold=asyncio.Event()))
        heard: list[int] = []

        def on_response(response: worker_pb2.SessionResponse) -> None:
            heard.extend(response.handles)
            if 2 in response.handles:
                raise ValueError("a bug in the caller")

        call.listen(on_response)
        with pytest.raises(ValueError, match="a bug in the caller"):
            [r async for r in call]
        assert heard == [1, 2]
        await asyncio.wait_for(handler.cancelled.wait(), 5)


async def test_a_listener_that_cancels_the_call_hears_nothing_more() -> None:
    """Frames already read behind the one whose handling cancelled the call (a link
    closed from its own dispatch) are not delivered."""
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1, 2), submit(3), hold=asyncio.Event()))
        await wait_for(lambda: len(call._inbox) == 3)  # a response per submission
        heard: list[int] = []

        def on_response(response: worker_pb2.SessionResponse) -> None:
            heard.extend(response.handles)
            call.cancel()

        call.listen(on_response)
        iterated: list[int] = []
        with pytest.raises(asyncio.CancelledError):
            async for response in call:
                iterated.extend(response.handles)
        assert heard == [1] and iterated == []


async def test_what_was_read_before_the_caller_listened_reaches_it_first() -> None:
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        more = asyncio.Event()

        async def requests() -> AsyncIterator[worker_pb2.SessionRequest]:
            yield submit(1)
            yield submit(2)
            await more.wait()
            yield submit(3)

        call = open_call(opener, requests())
        await wait_for(lambda: len(call._inbox) == 2)
        heard: list[int] = []
        call.listen(lambda response: heard.extend(response.handles))
        assert heard == [1, 2]
        more.set()
        await wait_for(lambda: heard == [1, 2, 3])
        call.cancel()


async def test_an_unknown_method_is_unimplemented() -> None:
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        session = opener.channel.stream_stream("/llmesh.router.v1.RouterService/Session")
        call = opener.open("/llmesh.router.v1.RouterService/Session", session, messages(),
                           worker_pb2.SessionResponse)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in call]
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert call.framed


async def test_the_handler_is_cancelled_when_the_caller_goes_away() -> None:
    handler = EchoSessions()
    async with Peer(handler) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(7), hold=asyncio.Event()))
        reading = asyncio.ensure_future(handles_of(call))
        await asyncio.wait_for(handler.blocking.wait(), 5)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await asyncio.wait_for(handler.cancelled.wait(), 5)


async def test_a_connection_that_ends_without_end_of_input_cancels_the_handler() -> None:
    handler = EchoSessions()
    async with Peer(handler) as peer:
        assert peer.listener is not None
        _, writer = await asyncio.open_connection("127.0.0.1", peer.listener.port)
        writer.write(PREFACE + frame(sessionwire.HELLO, METHOD.encode())
                     + frame(sessionwire.MESSAGE, submit(7).SerializeToString()))
        await asyncio.wait_for(handler.blocking.wait(), 5)
        writer.transport.abort()
        await asyncio.wait_for(handler.cancelled.wait(), 5)


async def test_a_silent_peer_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that accepts and never answers (a stopped process, a cut link) fails the
    call with UNAVAILABLE after DEAD_AFTER_S, as gRPC's keepalive would."""
    monkeypatch.setattr(sessionwire, "PING_IDLE_S", 0.05)
    monkeypatch.setattr(sessionwire, "DEAD_AFTER_S", 0.3)
    held: list[asyncio.StreamWriter] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    mute_server = await asyncio.start_server(mute, "127.0.0.1", 0)
    mute_port = mute_server.sockets[0].getsockname()[1]
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        opener._port = mute_port  # the endpoint it named has stopped answering
        call = open_call(opener, messages(submit(1), hold=asyncio.Event()))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(handles_of(call), 5)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "no answer" in (info.value.details() or "")
    mute_server.close()


async def _mute_listener(received: bytearray) -> asyncio.Server:
    """A peer that takes whatever is sent to it (into ``received``) and never answers."""

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            received.extend(chunk)

    return await asyncio.start_server(mute, "127.0.0.1", 0)


async def test_a_call_with_nothing_awaited_is_quiet_until_it_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``awaiting`` saying no answer is owed, the call sends no pings and minds no
    silence (an idle gateway wakes none of its replicas); the next message starts the
    clock, and a peer silent from then on is given up after DEAD_AFTER_S."""
    monkeypatch.setattr(sessionwire, "PING_IDLE_S", 0.05)
    monkeypatch.setattr(sessionwire, "DEAD_AFTER_S", 0.3)
    received = bytearray()
    mute_server = await _mute_listener(received)
    owed = False
    more = asyncio.Event()

    async def requests() -> AsyncIterator[worker_pb2.SessionRequest]:
        yield submit(1)
        await more.wait()
        yield submit(2)
        await asyncio.Event().wait()

    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        opener._port = mute_server.sockets[0].getsockname()[1]  # a peer that never answers
        session = opener.channel.stream_stream(METHOD)
        call = opener.open(METHOD, session, requests(), worker_pb2.SessionResponse, awaiting=lambda: owed)
        reading = asyncio.ensure_future(handles_of(call))
        await asyncio.sleep(1.0)  # over three times DEAD_AFTER_S with nothing owed
        assert not reading.done()
        assert frame(sessionwire.PING) not in bytes(received)
        owed = True
        more.set()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(reading, 5)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert frame(sessionwire.PING) in bytes(received)  # asked, once an answer was owed
    mute_server.close()


async def test_a_call_heard_elsewhere_is_quiet_and_counts_silence_from_when_it_is_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``elsewhere`` saying the answers reach the caller another way (the router's
    named load watch while session frames carry the load), the call neither pings nor
    gives up a silent peer; once it says no, the peer's silence counts from then: pinged,
    then given up after DEAD_AFTER_S, not at once for the silence before."""
    monkeypatch.setattr(sessionwire, "PING_IDLE_S", 0.05)
    monkeypatch.setattr(sessionwire, "DEAD_AFTER_S", 0.3)
    received = bytearray()
    mute_server = await _mute_listener(received)
    heard_elsewhere = True
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        opener._port = mute_server.sockets[0].getsockname()[1]  # a peer that never answers
        session = opener.channel.stream_stream(METHOD)
        call = opener.open(METHOD, session, messages(submit(1), hold=asyncio.Event()),
                           worker_pb2.SessionResponse, elsewhere=lambda: heard_elsewhere)
        reading = asyncio.ensure_future(handles_of(call))
        await asyncio.sleep(1.0)  # over three times DEAD_AFTER_S of silence, heard elsewhere
        assert not reading.done()
        assert frame(sessionwire.PING) not in bytes(received)
        heard_elsewhere = False
        flipped = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(reading, 5)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert asyncio.get_running_loop().time() - flipped >= 0.3
        assert frame(sessionwire.PING) in bytes(received)
    mute_server.close()


async def test_pings_keep_an_idle_session_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessionwire, "PING_IDLE_S", 0.05)
    monkeypatch.setattr(sessionwire, "DEAD_AFTER_S", 0.3)
    hold = asyncio.Event()
    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1), hold=hold))
        reading = asyncio.ensure_future(handles_of(call))
        await asyncio.sleep(1.0)  # over three times DEAD_AFTER_S with nothing to send
        assert not reading.done()
        hold.set()
        assert await asyncio.wait_for(reading, 5) == [1]


async def test_frames_arriving_push_the_keepalive_back_so_it_never_fires(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While frames arrive more often than PING_IDLE_S, the keepalive timer is moved from
    the reader and never fires (it woke both ends of a busy session twice a second); once
    they stop it fires after PING_IDLE_S of silence, and the peer is pinged."""
    monkeypatch.setattr(sessionwire, "PING_IDLE_S", 0.1)
    monkeypatch.setattr(sessionwire, "DEAD_AFTER_S", 0.6)
    ticks: list[float] = []
    plain_tick = FramedCall._tick

    def counting_tick(self: FramedCall) -> None:
        ticks.append(asyncio.get_running_loop().time())
        plain_tick(self)

    monkeypatch.setattr(FramedCall, "_tick", counting_tick)
    stop = asyncio.Event()

    async def every_40_ms() -> AsyncIterator[worker_pb2.SessionRequest]:
        for handle in range(100, 125):  # a second of frames, one every 40 ms
            yield submit(handle)
            await asyncio.sleep(0.04)
        await stop.wait()

    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        loop = asyncio.get_running_loop()
        call = open_call(opener, every_40_ms())
        handles: list[int] = []
        last_frame = 0.0

        async def read() -> None:
            nonlocal last_frame
            async for response in call:
                handles.extend(response.handles)
                last_frame = loop.time()

        reading = asyncio.ensure_future(read())
        await wait_for(lambda: len(handles) == 25, interval=0.01)
        assert ticks == [], ticks
        await asyncio.sleep(0.25)  # silence: the timer fires a PING_IDLE_S after the last frame
        assert ticks and ticks[0] - last_frame >= 0.1 - 0.01, (ticks, last_frame)
        assert not reading.done()  # the peer answers the pings
        stop.set()
        reading.cancel()


async def test_a_peer_without_a_listener_is_called_over_grpc() -> None:
    handler = EchoSessions()
    async with Peer(handler, listener=False) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1, 2)))
        assert await handles_of(call) == [1, 2]
        assert not call.framed
        assert (opener.framed_calls, opener.grpc_calls) == (0, 1)
        assert handler.calls == 1


async def test_a_listener_port_that_refuses_falls_back_to_grpc() -> None:
    class Elsewhere(session_transport_pb2_grpc.SessionTransportServiceServicer):
        async def GetSessionEndpoint(self, request: Any, context: Any) -> Any:
            return session_transport_pb2.GetSessionEndpointResponse(
                port=closed_port, version=sessionwire.VERSION, methods=[METHOD])

    with contextlib.closing(__import__("socket").socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    peer = Peer(EchoSessions(), listener=False)
    session_transport_pb2_grpc.add_SessionTransportServiceServicer_to_server(Elsewhere(), peer.server)
    async with peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(5)))
        assert await handles_of(call) == [5]
        assert not call.framed and opener.grpc_calls == 1


async def test_a_listener_that_never_accepts_falls_back_to_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port a network policy drops silently: given up after CONNECT_TIMEOUT_S."""
    monkeypatch.setattr(sessionwire, "CONNECT_TIMEOUT_S", 0.2)

    async def dropped(*args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()

    async with Peer(EchoSessions()) as peer, opener_for(peer) as opener:
        monkeypatch.setattr(opener, "connect", dropped)
        call = open_call(opener, messages(submit(8)))
        assert await asyncio.wait_for(handles_of(call), 5) == [8]
        assert not call.framed and opener.grpc_calls == 1


async def test_a_connection_without_the_preface_is_dropped() -> None:
    handler = EchoSessions()
    async with Peer(handler) as peer:
        assert peer.listener is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", peer.listener.port)
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # a gRPC client on the wrong port
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert handler.calls == 0


async def test_an_oversized_or_undecodable_message_is_refused() -> None:
    async with Peer(EchoSessions()) as peer:
        assert peer.listener is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", peer.listener.port)
        hello = PREFACE + frame(sessionwire.HELLO, METHOD.encode())
        writer.write(hello + frame(sessionwire.MESSAGE, b"\xff\xff"))
        kind, payload = await asyncio.wait_for(sessionwire.read_frame(reader), 5)
        assert kind == sessionwire.STATUS
        status = sessionwire.status_pb2.Status.FromString(payload)
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "llmesh.worker.v1.SessionRequest" in status.message
        writer.close()
        # A frame header over the limit is refused before its payload is read.
        reader, writer = await asyncio.open_connection("127.0.0.1", peer.listener.port)
        header = struct.pack("!BI", sessionwire.MESSAGE, sessionwire.MAX_FRAME_BYTES + 1)
        writer.write(PREFACE + frame(sessionwire.HELLO, METHOD.encode()) + header)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # dropped, the handler cancelled
        writer.close()


def test_target_hosts() -> None:
    assert target_host("127.0.0.1:50051") == "127.0.0.1"
    assert target_host("dns:///router.llmesh.svc:50051") == "router.llmesh.svc"
    assert target_host("[::1]:50051") == "::1"
    assert target_host("ipv4:10.0.0.7:50051") == "10.0.0.7"
    assert target_host("worker-0:7000") == "worker-0"
    assert target_host("unix:/tmp/worker.sock") is None
    assert target_host("ipv4:10.0.0.7:1,10.0.0.8:1") is None
    assert target_host("localhost") is None


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sessionwire-certs")
    write_dev_certs(out)
    return out


def _tls(certs: Path, identity: str) -> TlsSettings:
    return TlsSettings(ca=str(certs / "ca.pem"), cert=str(certs / f"{identity}.pem"),
                       key=str(certs / f"{identity}-key.pem"))


@pytest.mark.parametrize(("identity", "allowed"), [("router", True), ("gateway", False), ("client", False)])
async def test_mutual_tls_holds_the_callers_identity_to_the_policy(
        certs: Path, identity: str, allowed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The policy is under test, not the connect timeout: a TLS handshake on a loaded
    # 2-core box (a vLLM engine of another test spinning) once took longer than its 3 s,
    # and the call went over gRPC.
    monkeypatch.setattr(sessionwire, "CONNECT_TIMEOUT_S", 60.0)
    server_tls = TlsSettings(ca=str(certs / "ca.pem"), cert=str(certs / "worker.pem"),
                             key=str(certs / "worker-key.pem"))
    handler = EchoSessions()
    async with Peer(handler, tls=server_tls, authorizer=CallerAuthorizer.build("worker")) as peer, \
            opener_for(peer, tls=_tls(certs, identity)) as opener:
        call = open_call(opener, messages(submit(3)))
        if allowed:
            assert await handles_of(call) == [3]
            assert call.framed
        else:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await handles_of(call)
            assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "not allowed" in (info.value.details() or "")
            assert handler.calls == 0


async def test_mutual_tls_refuses_a_caller_without_a_certificate(certs: Path) -> None:
    server_tls = TlsSettings(ca=str(certs / "ca.pem"), cert=str(certs / "worker.pem"),
                             key=str(certs / "worker-key.pem"))
    handler = EchoSessions()
    async with Peer(handler, tls=server_tls, authorizer=CallerAuthorizer.build("worker")) as peer, \
            opener_for(peer, tls=TlsSettings(ca=str(certs / "ca.pem"))) as opener:
        call = open_call(opener, messages(submit(3)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(handles_of(call), 10)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert handler.calls == 0


def test_a_tls_session_on_uvloop(certs: Path) -> None:
    """The tiers run uvloop, whose transports (TLS ones too) are not asyncio's classes."""
    import uvloop

    async def session() -> list[int]:
        server_tls = TlsSettings(ca=str(certs / "ca.pem"), cert=str(certs / "worker.pem"),
                                 key=str(certs / "worker-key.pem"))
        authorizer = CallerAuthorizer.build("worker")
        async with Peer(EchoSessions(), tls=server_tls, authorizer=authorizer) as peer, \
                opener_for(peer, tls=_tls(certs, "router")) as opener:
            call = open_call(opener, messages(submit(1), submit(2)))
            handles = await handles_of(call)
            assert call.framed
            return handles

    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(session()) == [1, 2]
    finally:
        loop.close()


class WriteNowSessions(EchoSessions):
    """Answers each submission with write_now when its context has it (the framed
    listener), else by yielding; records which way each went."""

    def __init__(self) -> None:
        super().__init__()
        self.direct: list[int] = []

    async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest], context: Any
                      ) -> AsyncIterator[worker_pb2.SessionResponse]:
        write_now = getattr(context, "write_now", None)
        async for message in requests:
            for sub in message.submit:
                response = worker_pb2.SessionResponse(handles=[sub.handle], token_counts=[1],
                                                      token_ids=[sub.handle])
                if write_now is not None and write_now(response):
                    self.direct.append(sub.handle)
                else:
                    yield response


@pytest.mark.parametrize("listener", [True, False])
async def test_a_handler_writes_responses_at_once_over_the_listener(listener: bool) -> None:
    """The framed listener's context writes a response from the handler at once, in
    order with yielded ones; gRPC's context has no write_now, so the handler yields."""
    handler = WriteNowSessions()
    async with Peer(handler, listener=listener) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(1, 2), submit(3)))
        assert await handles_of(call) == [1, 2, 3]
        assert call.framed is listener
        assert handler.direct == ([1, 2, 3] if listener else [])


async def test_nothing_is_written_at_once_after_the_handler_ended() -> None:
    """Once the handler's responses end (here with an error), its context writes
    nothing more: the status is the call's last frame."""
    contexts: list[Any] = []

    class Failing(EchoSessions):
        async def Session(self, requests: AsyncIterator[worker_pb2.SessionRequest], context: Any
                          ) -> AsyncIterator[worker_pb2.SessionResponse]:
            contexts.append(context)
            async for message in requests:
                yield worker_pb2.SessionResponse(handles=[message.submit[0].handle], token_counts=[0])
                raise InvalidArgument("submit.handle", "refused after one answer")

    async with Peer(Failing()) as peer, opener_for(peer) as opener:
        call = open_call(opener, messages(submit(5), hold=asyncio.Event()))
        got: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect_handles(call, got)
        assert got == [5] and info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        (context,) = contexts
        assert context.open is False
        assert context.write_now(worker_pb2.SessionResponse(handles=[6])) is False

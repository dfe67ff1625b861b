"""Session methods over length-prefixed protobuf frames on a connection of their own.

Every internal hop that carries tokens (worker -> router, router -> gateway, gateway <->
postprocessor) is one long-lived ``Session`` stream per peer, one message per engine
step, and so is the gateway's Encode of every request (gateway <-> tokenizer). A grpc.aio
message costs far more CPU than the frame it carries (about 250 µs a side on these boxes
against 60 for a plain asyncio stream, ``scripts/transport_cost.py``), so a tier that
serves Session also listens on a port of its own where the same Session messages travel
as plain frames; so does the worker's WatchLoad (its first frame is the request), a
report every load interval even on an idle mesh. gRPC stays for everything else: the
public API, health, model info, the other per-request calls, and all of these for a peer
without the listener.

The wire, after TCP (and TLS, with the same certificates as the gRPC port):

- the caller's preface :data:`PREFACE` (magic and version), then frames;
- a frame is a 5-byte header, kind (1 byte) and payload length (4 bytes, big-endian),
  then the payload;
- kinds: ``HELLO`` (the method's full name, first frame of the caller), ``MESSAGE`` (one
  serialized request or response), ``END`` (the caller's input is over, like gRPC's
  half-close), ``STATUS`` (the server's last frame: a ``google.rpc.Status``, OK or the
  error with every detail, as gRPC sends it in trailers), ``PING`` and ``PONG``.

What the gRPC port gives a Session call, the listener gives it too: the caller's
certificate identity checked against the tier's policy (services/common/authz.py),
exceptions mapped to a status with their ``google.rpc`` details
(:func:`services.common.errors.map_exception`), the RPC metrics, a message-size limit,
and the handler cancelled when the caller goes away (connection closed without ``END``).
A caller that hears nothing for :data:`PING_IDLE_S` pings, and gives the connection up as
broken (``UNAVAILABLE``) after :data:`DEAD_AFTER_S` of silence: a stopped or cut-off
peer shows within seconds, as gRPC's keepalive shows it. A caller that tells the call
when it awaits no answer (:class:`FramedCall`'s ``awaiting``), or that what the call
would hear reaches it another way for now (``elsewhere``), stays quiet meanwhile.

Callers find the listener by asking the peer's gRPC port
(``llmesh.common.v1.SessionTransportService/GetSessionEndpoint``, :class:`SessionOpener`);
a peer that does not answer it, answers port 0, or whose port refuses the connection
is called over gRPC. :class:`FramedCall` hides which: it is iterated, cancelled and
fails (``grpc.aio.AioRpcError``, trailers with the status details) as a grpc.aio
stream-stream call is, so the tiers' session links do not know which transport they run on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import struct
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import status_pb2

from llmesh.common.v1 import session_transport_pb2, session_transport_pb2_grpc
from services.common.authz import CallerAuthorizer, peer_identities_from_der
from services.common.errors import InvalidArgument, PermissionDenied, map_exception
from services.common.metrics import RPC_LATENCY, RPC_REQUESTS
from services.common.settings import TlsSettings

log = logging.getLogger(__name__)

VERSION = 1
PREFACE = b"LLMS" + bytes([VERSION])
"""What a caller writes first: the magic and the framing version."""

_HEADER = struct.Struct("!BI")
MESSAGE, HELLO, END, STATUS, PING, PONG = range(6)
KIND_NAMES = ("MESSAGE", "HELLO", "END", "STATUS", "PING", "PONG")

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest frame either side accepts (gRPC's limit on the internal hops)."""
HELLO_TIMEOUT_S = 5.0
"""How long a new connection may take to say which method it calls."""
PING_IDLE_S = 0.5
"""A caller that has heard nothing for this long pings."""
DEAD_AFTER_S = 2.0
"""A caller that has heard nothing (no frame, no pong) for this long gives up the connection."""
ENDPOINT_TIMEOUT_S = 5.0
"""Longest wait for a peer's answer to GetSessionEndpoint."""
CONNECT_TIMEOUT_S = 3.0
"""Longest wait for a connection (and TLS handshake) to the listener: a port a network
policy drops silently is given up for gRPC in this time, not in the kernel's minutes."""
NO_LISTENER_RECHECK_S = 60.0
"""How long a peer found without a listener is called over gRPC before it is asked again."""

SESSION_TRANSPORT_SERVICE = (
    session_transport_pb2.DESCRIPTOR.services_by_name["SessionTransportService"].full_name)


class ProtocolError(Exception):
    """The peer broke the framing (bad preface, unknown kind, oversized frame)."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    """One frame on the wire."""
    return _HEADER.pack(kind, len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The next frame; ``asyncio.IncompleteReadError`` at the end of the connection."""
    kind, size = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if kind >= len(KIND_NAMES):
        raise ProtocolError(f"unknown frame kind {kind}")
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"a {KIND_NAMES[kind]} frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return kind, (await reader.readexactly(size) if size else b"")


def status_frame(code: grpc.StatusCode, message: str, details: list[object] | None = None) -> bytes:
    proto = status_pb2.Status(code=code.value[0], message=message)
    for detail in details or ():
        proto.details.add().Pack(detail)
    return frame(STATUS, proto.SerializeToString())


# -- the server side ---------------------------------------------------------------------


@dataclass(frozen=True)
class SessionMethod:
    """A Session method a listener serves: the servicer's handler (the same one the gRPC
    port calls, with a request iterator and a context it does not use) and the type of
    its request messages."""

    handler: Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]
    request_type: type[Message]


def server_ssl_context(tls: TlsSettings) -> ssl.SSLContext:
    """TLS for the listener from the gRPC port's material: with ``tls.ca``, callers must
    present a certificate chaining to it (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        context.load_verify_locations(cafile=tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(tls: TlsSettings) -> ssl.SSLContext:
    """TLS for a caller: the peer verified against ``tls.ca``; ``tls.cert`` presented."""
    context = ssl.create_default_context(cafile=tls.ca or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert:
        context.load_cert_chain(tls.cert, tls.key or None)
    return context


class SessionListener:
    """The framed listener of one tier process: its Session methods on a port of their own."""

    def __init__(
        self, tier: str, methods: Mapping[str, SessionMethod], *, host: str, port: int = 0,
        tls: TlsSettings | None = None, authorizer: CallerAuthorizer | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.tier = tier
        self.methods = dict(methods)
        self.host = host
        self.port = port
        self.tls = tls
        self.authorizer = authorizer
        self.reuse_port = reuse_port
        self._server: asyncio.Server | None = None
        self.connections: set[_Connection] = set()
        self.accepted = 0
        """Connections accepted so far (tests, logs)."""

    async def bind(self) -> int:
        """Bind the port (not yet accepting); returns it (a free one when asked for 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.host, self.port,
            ssl=server_ssl_context(self.tls) if self.tls is not None else None,
            reuse_port=self.reuse_port or None, start_serving=False,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def start(self) -> None:
        if self._server is None:
            await self.bind()
        assert self._server is not None
        await self._server.start_serving()

    async def stop(self, grace_s: float | None) -> None:
        """Accept no new connection; let the open sessions run for ``grace_s``, then
        cancel them (their requests are aborted, as gRPC's ``server.stop`` does)."""
        if self._server is not None:
            self._server.close()
        calls = {c.task for c in self.connections if c.task is not None and not c.task.done()}
        if calls and grace_s:
            await asyncio.wait(calls, timeout=grace_s)
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.gather(*calls, return_exceptions=True)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()

    def endpoint(self) -> session_transport_pb2.GetSessionEndpointResponse:
        return session_transport_pb2.GetSessionEndpointResponse(
            port=self.port, version=VERSION, methods=sorted(self.methods))


class _FramedProtocol(asyncio.Protocol):
    """What both ends of a framed connection share: the transport, flow control (a
    writer awaits :meth:`_wait_writable` while the transport's buffer is full) and the
    split of the bytes read into frames."""

    went_away = "the peer went away"
    """Why a writer waiting for room fails once the connection is lost."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is no asyncio.Transport subclass, but has its methods.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError(self.went_away))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def _wait_writable(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError(self.went_away)
        if self._paused:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def _split_frames(self) -> None:
        """Hand every whole frame in the buffer to :meth:`_frame`, in order; a frame of
        an unknown kind or over the size limit goes to :meth:`_bad_frame` instead and
        ends the reading. Stops once :meth:`_stopped` says so."""
        buffer = self.buffer
        offset, header = 0, _HEADER.size
        while len(buffer) - offset >= header:
            kind, size = _HEADER.unpack_from(buffer, offset)
            if kind >= len(KIND_NAMES) or size > MAX_FRAME_BYTES:
                self._bad_frame(kind, size)
                return
            end = offset + header + size
            if len(buffer) < end:
                break
            self._frame(kind, bytes(buffer[offset + header:end]))
            offset = end
            if self._stopped():
                return
        if offset:
            del buffer[:offset]

    def _frame(self, kind: int, payload: bytes) -> None:
        raise NotImplementedError

    def _bad_frame(self, kind: int, size: int) -> None:
        raise NotImplementedError

    def _stopped(self) -> bool:
        raise NotImplementedError


_END_OF_INPUT = None


class _Connection(_FramedProtocol):
    """One caller's connection to the listener and the Session call on it. Frames are
    parsed as bytes arrive, whether or not the handler is reading its requests, so a
    caller that goes away cancels the call at once, and a ping is answered at once."""

    went_away = "the caller went away"

    def __init__(self, listener: SessionListener) -> None:
        super().__init__()
        self.listener = listener
        self.greeted = False
        self.method: str | None = None
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.input_ended = False
        self.task: asyncio.Task[None] | None = None
        self.lost = False
        """The caller went away before the call ended: the handler was cancelled."""
        self._hello_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.listener.connections.add(self)
        self.listener.accepted += 1
        self._hello_timer = asyncio.get_running_loop().call_later(
            HELLO_TIMEOUT_S, self._drop, "no HELLO in time")

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if not self.greeted:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self._drop("not an llmesh session connection")
                return
            if bytes(buffer[:len(PREFACE)]) != PREFACE:
                self._drop("not an llmesh session connection (or another framing version)")
                return
            del buffer[:len(PREFACE)]
            self.greeted = True
        self._split_frames()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.listener.connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self.task is not None and not self.task.done():
            self.lost = True
            self.task.cancel()

    def _bad_frame(self, kind: int, size: int) -> None:
        self._drop(f"a frame of kind {kind} and {size} bytes")

    def _stopped(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    # -- frames ----------------------------------------------------------------------
    def _frame(self, kind: int, payload: bytes) -> None:
        assert self.transport is not None
        if self.method is None:
            if kind != HELLO:
                self._drop(f"the first frame is {KIND_NAMES[kind]}, not HELLO")
                return
            if self._hello_timer is not None:
                self._hello_timer.cancel()
            self.method = payload.decode("utf-8", "replace")
            self.task = asyncio.ensure_future(self._run(self.method))
        elif kind == MESSAGE and not self.input_ended:
            self.inbox.put_nowait(payload)
        elif kind == END and not self.input_ended:
            self.input_ended = True
            self.inbox.put_nowait(_END_OF_INPUT)
        elif kind == PING:
            self.transport.write(frame(PONG))
        else:
            self._drop(f"a {KIND_NAMES[kind]} frame from the caller")

    def _drop(self, why: str) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        log.warning("%s session listener: dropped a connection from %s: %s", self.listener.tier,
                    self.transport.get_extra_info("peername"), why)
        self.transport.abort()


    # -- the call --------------------------------------------------------------------
    async def _run(self, method: str) -> None:
        transport = self.transport
        assert transport is not None
        try:
            entry = self.listener.methods.get(method)
            if entry is None:
                transport.write(status_frame(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}"))
                return
            authorizer = self.listener.authorizer
            if authorizer is not None:
                ssl_object = transport.get_extra_info("ssl_object")
                der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
                peer = peer_identities_from_der(der) if der else ()
                try:
                    authorizer.check(method, peer)
                except PermissionDenied as exc:
                    log.warning("refused %s to %s", method, ", ".join(peer) or "a peer without identity")
                    self._count("PERMISSION_DENIED", time.perf_counter())
                    transport.write(status_frame(grpc.StatusCode.PERMISSION_DENIED, exc.message))
                    return
            await self._respond(method, entry)
        except asyncio.CancelledError:
            if not self.lost:
                raise  # the listener is stopping
        except ConnectionError:
            pass  # the caller went away while a frame waited to be written
        finally:
            transport.close()  # after what was written

    async def _requests(self, request_type: type[Message]) -> AsyncIterator[Any]:
        inbox, parse = self.inbox, request_type.FromString
        while (payload := await inbox.get()) is not _END_OF_INPUT:
            try:
                message = parse(payload)
            except DecodeError:
                name = request_type.DESCRIPTOR.full_name
                raise InvalidArgument("request", f"could not decode a {name} message") from None
            yield message

    def writable(self) -> bool:
        """Whether a response may be written at once (see :class:`FramedContext`)."""
        transport = self.transport
        return transport is not None and not self._paused and not transport.is_closing()

    async def _respond(self, method: str, entry: SessionMethod) -> None:
        start = time.perf_counter()
        code = "OK"
        transport = self.transport
        assert transport is not None
        context = FramedContext(self)
        responses = entry.handler(self._requests(entry.request_type), context)
        try:
            try:
                async for response in responses:
                    transport.write(frame(MESSAGE, response.SerializeToString()))
                    if self._paused or transport.is_closing():
                        await self._wait_writable()
            finally:
                # Whatever still runs of the handler (its clean-up) writes nothing after
                # the status.
                context.open = False
            transport.write(status_frame(grpc.StatusCode.OK, ""))
        except (asyncio.CancelledError, ConnectionError):
            code = "CANCELLED"
            raise
        except Exception as exc:
            mapped = map_exception(exc)
            code = mapped.code.name
            if mapped.code is grpc.StatusCode.INTERNAL:
                log.exception("internal error in %s", method, exc_info=exc)
            transport.write(status_frame(mapped.code, mapped.message, mapped.details))
        finally:
            # Closed here, in this task (left to the garbage collector, its clean-up would
            # run later in another task).
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:
                await aclose()
            self._count(code, start)

    def _count(self, code: str, start: float) -> None:
        assert self.method is not None
        short = self.method.rsplit("/", 1)[-1]
        RPC_REQUESTS.labels(self.listener.tier, short, code, "call").inc()
        RPC_LATENCY.labels(self.listener.tier, short).observe(time.perf_counter() - start)


class FramedContext:
    """What a framed listener hands a Session handler in place of gRPC's context: a way
    to write a response at once, from a callback, instead of yielding it (one wake-up of
    the call's task and of the generators above it less per response). A handler that
    uses it keeps yielding what :meth:`write_now` refused, and the order is its own to
    keep (:attr:`services.common.framing.FramedSession.direct` does)."""

    __slots__ = ("_connection", "open")

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.open = True
        """False once the handler's responses ended: the call's status comes next."""

    def write_now(self, message: Message) -> bool:
        """Write ``message`` now if the call is still answering and the connection can
        take it (not backed up, not closing); False (nothing written) otherwise."""
        connection = self._connection
        if not self.open or not connection.writable():
            return False
        transport = connection.transport
        assert transport is not None
        transport.write(frame(MESSAGE, message.SerializeToString()))
        return True


class SessionTransportServicer(session_transport_pb2_grpc.SessionTransportServiceServicer):
    """``GetSessionEndpoint`` on the gRPC port: where the listener is."""

    def __init__(self, listener: SessionListener) -> None:
        self.listener = listener

    async def GetSessionEndpoint(
        self, request: session_transport_pb2.GetSessionEndpointRequest, context: grpc.aio.ServicerContext
    ) -> session_transport_pb2.GetSessionEndpointResponse:
        return self.listener.endpoint()


# -- the caller side ---------------------------------------------------------------------


def target_host(target: str) -> str | None:
    """The host of a gRPC target (``host:port``, ``dns:///host:port``, ``[v6]:port``,
    ``ipv4:addr:port``); None for targets without one host (``unix:``, several addresses)."""
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix):]
            break
    if "/" in target or "," in target or target.startswith("unix"):
        return None
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class SessionOpener:
    """How one peer is reached for Session calls: over its framed listener when it has
    one (asked once, on the peer's gRPC channel, and again after a connection to it
    failed), else over gRPC."""

    def __init__(self, channel: grpc.aio.Channel, target: str, *, tls: TlsSettings | None = None,
                 server_name: str = "") -> None:
        self.channel = channel
        self.target = target
        self.host = target_host(target)
        self.server_name = server_name or self.host or ""
        self._ssl = client_ssl_context(tls) if tls is not None else None
        self._port: int | None = None
        """The listener's port once known (0: the peer has none)."""
        self._recheck_at = 0.0
        self.framed_calls = 0
        self.grpc_calls = 0
        """Calls opened so far over each transport (tests, logs)."""

    def open(self, method: str, grpc_call: Callable[[AsyncIterator[Any]], Any],
             messages: AsyncIterator[Any], response_type: type[Message], *,
             awaiting: Callable[[], bool] | None = None,
             elsewhere: Callable[[], bool] | None = None) -> FramedCall:
        """A Session call that sends ``messages``: over the listener, or ``grpc_call(messages)``.
        With ``awaiting``, the caller pings only while it says an answer is awaited; with
        ``elsewhere``, only while it says the answers do not reach it another way (see
        :class:`FramedCall`)."""
        return FramedCall(self, method, grpc_call, messages, response_type, awaiting=awaiting,
                          elsewhere=elsewhere)

    async def port(self) -> int:
        """The peer's listener port (0: call it over gRPC)."""
        if self.host is None:
            return 0
        if self._port is not None and not (self._port == 0 and time.monotonic() >= self._recheck_at):
            return self._port
        stub = session_transport_pb2_grpc.SessionTransportServiceStub(self.channel)
        try:
            reply = await stub.GetSessionEndpoint(
                session_transport_pb2.GetSessionEndpointRequest(), timeout=ENDPOINT_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.UNIMPLEMENTED:
                self._no_listener()
                return 0
            return 0  # unreachable now: the gRPC call reports it; asked again next time
        if reply.version != VERSION or reply.port == 0:
            self._no_listener()
            return 0
        if self._port != reply.port:
            log.info("%s serves Session frames on port %d: Session calls go there", self.target, reply.port)
        self._port = reply.port
        return reply.port

    def _no_listener(self) -> None:
        if self._port != 0:
            log.info("%s has no framed Session listener: Session calls go over gRPC", self.target)
        self._port = 0
        self._recheck_at = time.monotonic() + NO_LISTENER_RECHECK_S

    def forget(self) -> None:
        """The listener refused a connection: ask again next time."""
        self._port = None

    async def connect(self, port: int, call: FramedCall) -> _CallConnection:
        """A connection to the listener for ``call``."""
        assert self.host is not None
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: _CallConnection(call), self.host, port, ssl=self._ssl,
            server_hostname=self.server_name if self._ssl else None)
        return connection


def _rpc_error(code: grpc.StatusCode, message: str, status: bytes = b"") -> grpc.aio.AioRpcError:
    """A failed call as grpc.aio reports one (the status with its details in the trailers)."""
    trailers = grpc.aio.Metadata(("grpc-status-details-bin", status)) if status else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, message)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class FramedCall:
    """A Session call as the tiers' links use a grpc.aio one: iterated for the responses
    (``grpc.aio.AioRpcError`` when it fails), ``cancel()``-ed; over the peer's listener,
    or over gRPC when it has none.

    A caller that listens (:meth:`listen`) gets each response of a framed call from the
    connection's ``data_received``, in the event-loop callback that read its bytes: no
    task wakes for it, and the iteration then only ends (or fails) with the call. Over
    gRPC the responses are iterated as ever, so such a caller handles both the same way.

    ``awaiting`` (the caller's "is an answer owed to me?") makes an idle call quiet: while
    it says no, the call neither pings nor counts the peer's silence, and its keepalive
    timer stops, so an idle session costs neither side a wake-up. The next message sent
    starts the clock again: a peer that then stays silent for :data:`DEAD_AFTER_S` is
    given up as before. Without it the call pings whenever it has heard nothing for
    :data:`PING_IDLE_S`, whatever it is waiting for.

    ``elsewhere`` (the caller's "does what this call would tell me reach me another way
    now?") is for a call whose answers stop by design while another connection carries
    them: the router's named load watch of a worker whose session frames carry its load.
    While it says yes the call neither pings nor counts the peer's silence, and looks
    again every :data:`DEAD_AFTER_S` (nothing is sent on such a call to restart the
    clock); once it says no, the silence counts from then.

    While frames arrive, the keepalive timer is pushed back from the reader (a frame that
    finds it due within half of :data:`PING_IDLE_S` moves it to a full one from now), so it
    fires only after a silence: at a real engine's step rate it woke both ends of every
    session twice a second for nothing (a CPU step apart, each wake-up costs a tier a few
    hundred microseconds of cold caches), against a timer moved a few times a second."""

    def __init__(self, opener: SessionOpener, method: str, grpc_call: Callable[[AsyncIterator[Any]], Any],
                 messages: AsyncIterator[Any], response_type: type[Message], *,
                 awaiting: Callable[[], bool] | None = None,
                 elsewhere: Callable[[], bool] | None = None) -> None:
        self._opener = opener
        self._method = method
        self._grpc_call = grpc_call
        self._messages = messages
        self._parse = response_type.FromString
        self._cancelled = False
        self._call: Any = None
        """The gRPC call, when the peer is called over gRPC."""
        self._connection: _CallConnection | None = None
        self._sender: asyncio.Task[None] | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self._last_heard = 0.0
        self._broken: str | None = None
        self._awaiting = awaiting
        self._elsewhere = elsewhere
        self._heard_elsewhere = False
        """Whether the latest tick found the answers arriving another way."""
        self._listener: Callable[[Any], None] | None = None
        self._inbox: collections.deque[bytes] = collections.deque()
        """Responses read and not yet iterated (a call nobody listens to)."""
        self._ended: BaseException | None = None
        """How the framed call ended, once it has: :data:`_ENDED_OK`, or the error."""
        self._wakeup: asyncio.Future[None] | None = None
        self._opening = asyncio.ensure_future(self._open())

    @property
    def framed(self) -> bool:
        """Whether the call runs over the listener (known once it is open)."""
        return self._connection is not None

    def listen(self, on_response: Callable[[Any], None]) -> None:
        """Hand every response of the framed call to ``on_response`` as it is read (see
        the class docstring); one it raises for ends the call with that error, as if the
        iteration had raised it. What was read before it listened goes to it first."""
        self._listener = on_response
        while self._inbox and not self._cancelled and (self._ended is None or self._ended is _ENDED_OK):
            payload = self._inbox.popleft()
            try:
                on_response(self._parse(payload))
            except Exception as exc:
                self._inbox.clear()
                self._end(exc)

    def cancel(self) -> bool:
        if self._cancelled:
            return False
        self._cancelled = True
        self._opening.cancel()
        if self._call is not None:
            self._call.cancel()
        self._stop()
        if self._connection is not None:
            self._connection.abort()
        return True

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    def send_or_queue(self, message: Message, queue: asyncio.Queue[Any]) -> None:
        """Write ``message`` at once (:meth:`send_now`) when ``queue``, the caller's queue
        that ``messages`` yields from, holds nothing before it; else put it in the queue
        for the sender, behind what is there: the order of messages holds either way."""
        if not (queue.empty() and self.send_now(message)):
            queue.put_nowait(message)

    def send_now(self, message: Message) -> bool:
        """Write ``message`` at once, without the sender task's wake-up (one event-loop
        iteration of the request's path, a task switch per message on every hop), when
        nothing is before it: the call runs over the listener, its connection takes
        writes (open, nothing buffered) and the caller has nothing queued for the sender
        (the caller's to check: its queue is what ``messages`` yields). False: the caller
        queues it, as always (over gRPC, still connecting, or writes backed up)."""
        connection = self._connection
        if connection is None or self._cancelled:
            return False
        transport = connection.transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size():
            return False
        transport.write(frame(MESSAGE, message.SerializeToString()))
        self._sent()
        return True

    # -- internals -------------------------------------------------------------------
    async def _open(self) -> _CallConnection | None:
        """Connect to the listener and start sending; None: over gRPC."""
        opener = self._opener
        port = await opener.port()
        if port:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    connection = await opener.connect(port, self)
            except (OSError, ssl.SSLError, TimeoutError) as exc:
                log.warning("session listener %s:%d of %s refused the connection (%s): over gRPC",
                            opener.host, port, opener.target, exc or type(exc).__name__)
                opener.forget()
            else:
                connection.write(PREFACE + frame(HELLO, self._method.encode()))
                self._connection = connection
                opener.framed_calls += 1
                loop = asyncio.get_running_loop()
                self._last_heard = loop.time()
                self._keepalive = loop.call_later(PING_IDLE_S, self._tick)
                self._sender = asyncio.ensure_future(self._send(connection))
                return connection
        opener.grpc_calls += 1
        self._call = self._grpc_call(self._messages)
        return None

    async def _send(self, connection: _CallConnection) -> None:
        try:
            async for message in self._messages:
                connection.write(frame(MESSAGE, message.SerializeToString()))
                self._sent()
                await connection.drain()
            connection.write(frame(END))
        except (ConnectionError, RuntimeError):
            pass  # the connection's end reaches the caller through the call's end

    def _sent(self) -> None:
        if self._keepalive is None and not self._cancelled:
            # Quiet while idle: an answer is owed from now on.
            loop = asyncio.get_running_loop()
            self._last_heard = loop.time()
            self._keepalive = loop.call_later(PING_IDLE_S, self._tick)

    def _tick(self) -> None:
        connection = self._connection
        if connection is None or self._cancelled:
            return
        if self._awaiting is not None and not self._awaiting():
            self._keepalive = None  # idle: quiet until the next message goes out
            return
        loop = asyncio.get_running_loop()
        if self._elsewhere is not None:
            if self._elsewhere():
                self._heard_elsewhere = True
                self._keepalive = loop.call_later(DEAD_AFTER_S, self._tick)
                return
            if self._heard_elsewhere:
                # This call is the one to hear from again: its silence counts from now.
                self._heard_elsewhere = False
                self._last_heard = loop.time()
        silent = loop.time() - self._last_heard
        if silent >= DEAD_AFTER_S:
            self._broken = f"Socket closed: no answer from the session listener for {silent:.1f} s"
            connection.abort()
            return
        if silent < PING_IDLE_S:
            # Heard from within the last interval: look again when that silence is one.
            self._keepalive = loop.call_at(self._last_heard + PING_IDLE_S, self._tick)
            return
        connection.write(frame(PING))
        self._keepalive = loop.call_later(PING_IDLE_S, self._tick)

    def _stop(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        if self._sender is not None:
            self._sender.cancel()

    # Called by the connection, from the event loop's read callbacks.
    def _frame(self, kind: int, payload: bytes) -> None:
        """One frame from the listener (:class:`_CallConnection`); none once the call
        ended or was cancelled (a listener that cancels hears no more)."""
        if self._ended is not None or self._cancelled:
            return
        loop = asyncio.get_running_loop()
        self._last_heard = now = loop.time()
        keepalive = self._keepalive
        if keepalive is not None and keepalive.when() - now < PING_IDLE_S / 2:
            # Frames are flowing: the silence the timer looks for cannot be over before a
            # full interval from now.
            keepalive.cancel()
            self._keepalive = loop.call_at(now + PING_IDLE_S, self._tick)
        if kind == MESSAGE:
            listener = self._listener
            if listener is None:
                self._inbox.append(payload)
                self._wake()
                return
            try:
                listener(self._parse(payload))
            except Exception as exc:
                self._end(exc)
        elif kind == STATUS:
            status = status_pb2.Status.FromString(payload)
            code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
            self._end(_ENDED_OK if code is grpc.StatusCode.OK else _rpc_error(code, status.message, payload))

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self._ended is not None:
            return
        if self._cancelled:
            self._end(asyncio.CancelledError())
            return
        why = self._broken or (
            f"Connection reset: the session listener closed the connection ({exc or 'end of stream'})")
        self._end(_rpc_error(grpc.StatusCode.UNAVAILABLE, why))

    def _end(self, how: BaseException) -> None:
        """The framed call is over (:data:`_ENDED_OK` or its error): the iteration ends
        once it has yielded what was read before, and nothing more is read."""
        self._ended = how
        connection = self._connection
        if how is not _ENDED_OK and connection is not None:
            connection.abort()
        self._wake()

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _responses(self) -> AsyncIterator[Any]:
        try:
            connection = await self._opening
        except asyncio.CancelledError:
            if self._cancelled:
                raise asyncio.CancelledError() from None
            raise
        if connection is None:
            async for response in self._call:
                yield response
            return
        parse, inbox, loop = self._parse, self._inbox, asyncio.get_running_loop()
        try:
            while True:
                if self._cancelled:
                    raise asyncio.CancelledError()
                if inbox:
                    yield parse(inbox.popleft())
                    continue
                ended = self._ended
                if ended is not None:
                    if ended is _ENDED_OK:
                        return
                    if isinstance(ended, asyncio.CancelledError):
                        raise asyncio.CancelledError() from None
                    raise ended
                self._wakeup = loop.create_future()
                await self._wakeup
        finally:
            self._wakeup = None
            self._stop()
            connection.close()


_ENDED_OK = Exception("the call ended with status OK")
"""What a framed call that ended with an OK status ended with (not raised)."""


class _CallConnection(_FramedProtocol):
    """The caller's side of a connection to a listener: frames are parsed as bytes arrive
    and handed to the :class:`FramedCall`, which writes through :meth:`write`; the
    connection's flow control is the caller's :meth:`drain`."""

    went_away = "the session listener went away"

    def __init__(self, call: FramedCall) -> None:
        super().__init__()
        self.call = call

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._split_frames()

    def _frame(self, kind: int, payload: bytes) -> None:
        self.call._frame(kind, payload)

    def _bad_frame(self, kind: int, size: int) -> None:
        self.call._end(_rpc_error(
            grpc.StatusCode.UNAVAILABLE,
            f"Connection reset: the session listener sent a frame of kind {kind} and {size} bytes"))

    def _stopped(self) -> bool:
        return self.call._ended is not None or self.call._cancelled

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.call._connection_lost(exc)

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        await self._wait_writable()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

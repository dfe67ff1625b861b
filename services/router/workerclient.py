"""WorkerClient over grpc.aio: the production implementation of ``workerapi.WorkerClient``."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.common.v1 import common_pb2
from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.channels import LOOKUP_IDLE_TIMEOUT_MS, broken_link, create_channel
from services.common.errors import LlmeshError, error_from_rpc, request_error_from_proto
from services.common.generation import Delta, TokenRequest
from services.common.generation_convert import (
    delta_from_proto,
    final_from_proto,
    logprobs_from_proto,
    request_to_proto,
)
from services.common.sessionwire import SessionOpener
from services.common.settings import TlsSettings
from services.router.registry import Load, WorkerInfo
from services.router.workerapi import SessionEvent, SessionSubmit, WorkerCallError, WorkerEvent

_TRANSPORT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED,
    # A worker that refuses this router's identity cannot serve any of its requests.
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.CANCELLED,  # a worker (not us) cancelled: it is shutting down
}
_REJECTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
}


def classify(code: grpc.StatusCode, message: str, error: LlmeshError | None = None) -> WorkerCallError:
    """What a failed worker call (or one request of a batch) means (WorkerCallError.kind)."""
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerCallError("overloaded", code.name, message)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return WorkerCallError("deadline", code.name, message)
    if code in _REJECTED:
        return WorkerCallError("rejected", code.name, message, error)
    if code in _TRANSPORT or broken_link(message):
        return WorkerCallError("transport", code.name, message)
    # INTERNAL / UNKNOWN from a worker that answered: this request failed there.
    return WorkerCallError("failed", code.name, message)


def call_error(err: grpc.aio.AioRpcError) -> WorkerCallError:
    """Classify a failed worker call, keeping the worker's error details."""
    code = err.code()
    return classify(code, err.details() or code.name, error_from_rpc(err))


def request_error(error: common_pb2.RequestError) -> WorkerCallError:
    """Classify the failure of one request of a batch (the rest of the batch goes on)."""
    code, mapped = request_error_from_proto(error)
    return classify(code, error.message or code.name, mapped)


def load_from_proto(load: worker_pb2.Load) -> Load:
    return Load(
        running=load.running, waiting=load.waiting, kv_cache_usage=load.kv_cache_usage,
        prefix_cache_hit_rate=load.prefix_cache_hit_rate, in_flight=load.in_flight,
        max_num_seqs=load.max_num_seqs,
    )


def info_from_proto(info: worker_pb2.GetModelInfoResponse) -> WorkerInfo:
    return WorkerInfo(
        model=info.model, tokenizer_checksum=info.tokenizer_checksum, device=info.device,
        zone=info.zone, worker_id=info.worker_id, pid=info.pid,
        max_context_length=info.max_context_length, vocab_size=info.vocab_size,
    )


def frame_events(frame: worker_pb2.SessionResponse) -> Iterator[tuple[int, SessionEvent]]:
    """A worker Session frame split into per-request events: each handle's deltas in
    order (a plain list of token ids for a request without logprobs in the frame, else a
    :class:`Delta`), then the finals and errors. A worker names each request once per
    frame; one that names a request once per engine step (a frame covering several
    steps) sends as many logprobs entries for it, which are taken in that order."""
    # One list of the frame's token ids, sliced per request: plain ints, no per-token
    # message objects.
    token_ids = list(frame.token_ids)
    logprobs: dict[int, collections.deque[Sequence[common_pb2.TokenLogprob]]] = {}
    for entry in frame.logprobs:
        logprobs.setdefault(entry.handle, collections.deque()).append(entry.logprobs)
    offset = 0
    for handle, count in zip(frame.handles, frame.token_counts, strict=True):
        end = offset + count
        entries = logprobs.get(handle) if logprobs else None
        if entries:
            yield handle, Delta(token_ids[offset:end], logprobs_from_proto(entries.popleft()))
        else:
            yield handle, token_ids[offset:end]
        offset = end
    for final in frame.finals:
        yield final.handle, final_from_proto(final.final)
    for error in frame.errors:
        yield error.handle, request_error(error.error)


SESSION_METHOD = "/llmesh.worker.v1.WorkerService/Session"
WATCH_LOAD_METHOD = "/llmesh.worker.v1.WorkerService/WatchLoad"
CONTROL_KEEPALIVE_MS = 30_000
"""Keepalive of a worker's control channel (health Watch, model info): see GrpcWorkerClient."""


def _session_call(opener: SessionOpener, messages: AsyncIterator[worker_pb2.SessionRequest],
                  awaiting: Callable[[], bool] | None = None) -> Any:
    """A worker Session call: over the worker's framed listener, or over gRPC."""
    stub = worker_pb2_grpc.WorkerServiceStub(opener.channel)
    return opener.open(SESSION_METHOD, stub.Session, messages, worker_pb2.SessionResponse,
                       awaiting=awaiting)


async def _one(request: worker_pb2.WatchLoadRequest) -> AsyncIterator[worker_pb2.WatchLoadRequest]:
    yield request


async def _nothing() -> AsyncIterator[worker_pb2.SessionRequest]:
    nothing: tuple[worker_pb2.SessionRequest, ...] = ()
    for message in nothing:
        yield message


class GrpcSessionLink:
    """A worker Session call (over the worker's framed listener when it has one,
    services/common/sessionwire.py): submissions and aborts go out through a queue (one
    writer), frames come back in column layout and are split into per-request events."""

    def __init__(self, opener: SessionOpener, awaiting: Callable[[], bool] | None = None, *,
                 watcher: str = "", on_load: Callable[[Load], None] | None = None) -> None:
        self._outbox: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()
        self._call = _session_call(opener, self._requests(), awaiting)
        self._watcher = watcher
        """Sent with the first message only."""
        self._on_load = on_load

    async def _requests(self) -> AsyncIterator[worker_pb2.SessionRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    def send(self, submits: Sequence[SessionSubmit], aborts: Sequence[int]) -> None:
        message = worker_pb2.SessionRequest(
            submit=[worker_pb2.SessionSubmit(handle=s.handle, request=request_to_proto(s.request),
                                             timeout_s=s.timeout_s or 0.0, traceparent=s.traceparent)
                    for s in submits],
            abort=list(aborts),
            watcher=self._watcher,
        )
        self._watcher = ""
        self._call.send_or_queue(message, self._outbox)

    def listen(self, on_events: Callable[[Iterable[tuple[int, SessionEvent]]], None]) -> None:
        """Each frame's events to ``on_events`` as the frame is read, in the event-loop
        callback that read it (over the worker's framed listener: no task wakes per
        frame; :meth:`events` then only ends or raises with the session). Over gRPC the
        frames still come out of :meth:`events`."""
        self._call.listen(lambda frame: on_events(self._events_of(frame)))

    def _events_of(self, frame: worker_pb2.SessionResponse) -> Iterable[tuple[int, SessionEvent]]:
        if self._on_load is not None and frame.HasField("load"):
            self._on_load(load_from_proto(frame.load))
        return frame_events(frame)

    async def events(self) -> AsyncIterator[Iterable[tuple[int, SessionEvent]]]:
        try:
            async for frame in self._call:
                yield self._events_of(frame)
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._call.cancel()


class GrpcWorkerClient:
    """Channels to a worker: traced generations, untraced control (load and health
    watches) and, apart, the Session (a stopped or partitioned worker shows by its missed
    load reports, load_timeout_ms)."""

    def __init__(self, address: str, *, tls: TlsSettings | None = None) -> None:
        self.address = address
        # Generations go over a traced channel; the load and health watches over an
        # untraced one, so traces show requests, not polling. The health Watch stays
        # open for as long as the worker is known: its channel pings every 30 s, not
        # 2 s, since the load reports notice a silent worker within load_timeout_ms
        # (each ping woke gRPC's threads in both processes, 1.5 ms of CPU per second).
        self.channel = create_channel(address, tls=tls)
        self.control = create_channel(address, tls=tls, interceptors=[],
                                      keepalive_time_ms=CONTROL_KEEPALIVE_MS)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.control_stub = worker_pb2_grpc.WorkerServiceStub(self.control)
        self.health = health_pb2_grpc.HealthStub(self.control)
        # Sessions get a connection of their own: a busy frame stream must not delay the
        # load reports that decide reachability. Untraced: each request carries its own
        # trace context inside the session.
        self.session_channel: grpc.aio.Channel | None = None
        self._sessions: SessionOpener | None = None
        self._tls = tls

    async def generate(
        self, request: TokenRequest, timeout: float | None
    ) -> AsyncIterator[tuple[str, WorkerEvent]]:
        message = worker_pb2.GenerateRequest(request=request_to_proto(request))
        call = self.stub.Generate(message, timeout=timeout)
        try:
            async for response in call:
                kind = response.WhichOneof("kind")
                if kind == "delta":
                    yield response.request_id or request.request_id, delta_from_proto(response.delta)
                elif kind == "final":
                    yield response.request_id or request.request_id, final_from_proto(response.final)
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None
        finally:
            # Leaving early (the caller was cancelled) cancels the call: the worker aborts.
            call.cancel()

    async def generate_batch(
        self, requests: Sequence[TokenRequest], timeout: float | None
    ) -> AsyncIterator[tuple[str, WorkerEvent]]:
        call = self.stub.GenerateBatch(
            worker_pb2.GenerateBatchRequest(requests=[request_to_proto(r) for r in requests]), timeout=timeout
        )
        try:
            async for response in call:
                kind = response.WhichOneof("kind")
                if kind == "delta":
                    yield response.request_id, delta_from_proto(response.delta)
                elif kind == "final":
                    yield response.request_id, final_from_proto(response.final)
                elif kind == "error":
                    yield response.request_id, request_error(response.error)
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None
        finally:
            call.cancel()

    def _opener(self) -> SessionOpener:
        if self._sessions is None:
            self.session_channel = create_channel(self.address, tls=self._tls, interceptors=[],
                                                  idle_timeout_ms=LOOKUP_IDLE_TIMEOUT_MS)
            self._sessions = SessionOpener(self.session_channel, self.address, tls=self._tls)
        return self._sessions

    def open_session(self, awaiting: Callable[[], bool] | None = None, *, watcher: str = "",
                     on_load: Callable[[Load], None] | None = None) -> GrpcSessionLink:
        return GrpcSessionLink(self._opener(), awaiting, watcher=watcher, on_load=on_load)

    async def has_session(self, timeout: float) -> bool:
        """Whether the worker serves Session: one call that sends nothing and ends its
        input at once. A worker with Session answers OK with no frames, one without it
        UNIMPLEMENTED. (A Session the worker ends early while the caller is still writing
        may surface as INTERNAL "Internal error from Core" instead: only a call that writes
        nothing tells the two apart.)"""
        call = _session_call(self._opener(), _nothing())
        try:
            async with asyncio.timeout(timeout):
                async for _ in call:
                    pass
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise call_error(err) from None
        except TimeoutError:
            raise call_error(grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                "no answer to a Session call in time")) from None
        finally:
            call.cancel()
        return True

    async def abort(self, request_id: str) -> None:
        try:
            await self.stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=2.0)
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None

    async def watch_load(self, interval_s: float, *, watcher: str = "", silence_s: float = 0.0,
                         elsewhere: Callable[[], bool] | None = None) -> AsyncIterator[Load]:
        # Over the worker's framed listener when it has one (a connection of its own, not
        # the Session's: busy frames must not delay the reports that decide reachability),
        # where a report costs both processes a fraction of a grpc.aio message. Named, the
        # watch is quiet while this router's session frames carry the load, and so is its
        # keepalive while ``elsewhere`` says so (no ping, no pong: no wake-up on either side).
        request = worker_pb2.WatchLoadRequest(interval_ms=max(10, round(interval_s * 1000)), watcher=watcher,
                                              silence_ms=max(0, round(silence_s * 1000)))
        call = self._opener().open(
            WATCH_LOAD_METHOD, lambda _messages: self.control_stub.WatchLoad(request),
            _one(request), worker_pb2.WatchLoadResponse, elsewhere=elsewhere)
        try:
            async for reply in call:
                yield load_from_proto(reply.load)
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None
        finally:
            call.cancel()

    async def get_model_info(self, timeout: float) -> WorkerInfo:
        try:
            reply = await self.control_stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None
        return info_from_proto(reply)

    async def watch_health(self, service: str) -> AsyncIterator[str]:
        call = self.health.Watch(health_pb2.HealthCheckRequest(service=service))
        try:
            async for reply in call:
                yield health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as err:
            raise call_error(err) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.channel.close()
        await self.control.close()
        if self.session_channel is not None:
            await self.session_channel.close()

"""The tokenizer tier over long-lived Session calls (``tokenizer_transport: session``).

Every request waits for its encoding before anything else of it can start. As a unary
``Encode`` that is a grpc.aio call of its own per request, on both sides; here one
``Session`` call per replica (on the replica's framed listener when it has one,
services/common/sessionwire.py) carries every request's encode under a handle of its own,
the encodes asked for in one event-loop iteration in one message (the machinery is
:mod:`gateway.sessionlink`'s).

To the gateway core this tier is the unary one (:class:`gateway.tiers.GrpcTokenizerTier`):
a request's error is the domain error ``Encode`` would have ended with (fields named as
the public request names them), and a broken session is :class:`TierUnavailable` for each
request on it, which moves to the next replica. A replica without Session (an older
release, during a rolling upgrade) gets ``Encode`` calls; so do a request that was on the
session it turned out not to have, and ``ListModels``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gateway.sessionlink import NoSession, ReplicaLinks, SessionLink
from gateway.tiers import TOKENIZER_FIELD_PREFIXES, GrpcTokenizerTier, request_error
from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import errors
from services.common.sessionwire import SessionOpener
from services.common.settings import TlsSettings
from services.common.tracing import current_traceparent

SESSION_METHOD = "/llmesh.tokenizer.v1.TokenizerService/Session"


class _Waiting:
    """One request on a link: its result, or its error, arrives in :attr:`answer`."""

    def __init__(self) -> None:
        self.answer: asyncio.Future[tokenizer_pb2.EncodeResult] = asyncio.get_running_loop().create_future()

    def deliver(self, item: Any) -> None:
        if self.answer.done():
            return
        if isinstance(item, BaseException):
            self.answer.set_exception(item)
        else:
            self.answer.set_result(item)


class TokenizerSessionLink(
    SessionLink[tokenizer_pb2.SessionRequest, tokenizer_pb2.SessionResponse, _Waiting],
):
    """One Session call to one tokenizer replica and the requests it carries."""

    tier = "tokenizer"
    field_prefixes = TOKENIZER_FIELD_PREFIXES
    ended_message = "tokenizer replica {replica}: session ended"
    closed_message = "tokenizer: session closed"

    def encode(self, encode_input: tokenizer_pb2.EncodeInput, traceparent: str) -> tuple[int, _Waiting]:
        """Ask for one encoding; it (or the request's error) arrives in the returned waiter."""
        handle = self._allocate()
        waiting = self.requests[handle] = _Waiting()
        self._pending.encodes.add(handle=handle, input=encode_input, traceparent=traceparent)
        self._schedule()
        return handle, waiting

    def forget(self, handle: int) -> None:
        """The caller stopped waiting (answered, cancelled, out of time); a late answer is dropped."""
        self.requests.pop(handle, None)

    def _open(self, opener: SessionOpener, messages: AsyncIterator[tokenizer_pb2.SessionRequest]) -> Any:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(opener.channel)
        return opener.open(SESSION_METHOD, stub.Session, messages, tokenizer_pb2.SessionResponse,
                           awaiting=self.awaiting)

    def _new_message(self) -> tokenizer_pb2.SessionRequest:
        return tokenizer_pb2.SessionRequest()

    def _dispatch(self, frame: tokenizer_pb2.SessionResponse) -> None:
        for answer in frame.results:
            self._finish(answer.handle, answer.result)
        for failure in frame.errors:
            self._finish(failure.handle,
                         request_error(failure.error, tier="tokenizer", strip=TOKENIZER_FIELD_PREFIXES))


class SessionTokenizerTier(GrpcTokenizerTier):
    """Tokenizer replicas reached through one Session call each for Encode (ListModels,
    and replicas without Session, stay on unary calls)."""

    def __init__(self, targets: Sequence[str], tls: TlsSettings | None = None, server_name: str = "") -> None:
        super().__init__(targets, tls, server_name)
        self.links = ReplicaLinks(TokenizerSessionLink, self.targets, tls, server_name)

    async def _attempt(self, replica: int, method: str, request: object, timeout: float | None) -> object:
        if method != "Encode" or self.links.uses_calls(replica):
            return await super()._attempt(replica, method, request, timeout)
        assert isinstance(request, tokenizer_pb2.EncodeRequest)
        try:
            result = await self._over_session(replica, request.input, timeout)
        except NoSession:
            # The session failed before any frame: nothing of this request was answered.
            return await super()._attempt(replica, method, request, timeout)
        return tokenizer_pb2.EncodeResponse(result=result)

    async def _over_session(self, replica: int, encode_input: tokenizer_pb2.EncodeInput,
                            timeout: float | None) -> tokenizer_pb2.EncodeResult:
        link = self.links.current(replica)
        # The gateway's span of this request's tokenize step.
        handle, waiting = link.encode(encode_input, current_traceparent())
        timer = None
        if timeout is not None and math.isfinite(timeout):
            timer = asyncio.get_running_loop().call_later(
                max(timeout, 0.0), waiting.deliver, errors.DeadlineExceeded("tokenizer: deadline passed"))
        try:
            return await waiting.answer
        finally:
            if timer is not None:
                timer.cancel()
            link.forget(handle)

    async def close(self) -> None:
        await self.links.close()
        await super().close()

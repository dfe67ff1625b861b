"""The interface the router core uses to talk to one worker (no grpc here).

``services.router.workerclient.GrpcWorkerClient`` is the production implementation;
tests may substitute an in-process double.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from llmesh.common.v1 import common_pb2
from services.router.registry import Load, WorkerInfo

WorkerEvent = common_pb2.TokenDelta | common_pb2.TokenFinal


class WorkerCallError(Exception):
    """A call to a worker failed.

    ``kind`` decides what the router does:
    - ``transport``: the worker or the link failed -> trip the breaker, retry/resume elsewhere;
    - ``overloaded``: the worker refused for load -> retry elsewhere, breaker untouched;
    - ``rejected``: the request itself is bad (invalid argument, unknown model) -> tell the caller;
    - ``deadline``: the caller's deadline passed -> tell the caller.
    """

    RETRYABLE = frozenset({"transport", "overloaded"})

    def __init__(self, kind: str, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.kind = kind
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.kind in self.RETRYABLE


class WorkerClient(Protocol):
    """One connection to a worker's WorkerService."""

    address: str

    def generate(
        self, request: common_pb2.TokenRequest, timeout: float | None
    ) -> AsyncIterator[tuple[str, WorkerEvent]]:
        """Stream (request_id, delta-or-final) of one request; raises WorkerCallError."""
        ...

    def generate_batch(
        self, requests: Sequence[common_pb2.TokenRequest], timeout: float | None
    ) -> AsyncIterator[tuple[str, WorkerEvent]]:
        """Stream (request_id, delta-or-final) of several requests in one call."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def get_load(self, timeout: float) -> Load: ...

    async def get_model_info(self, timeout: float) -> WorkerInfo: ...

    def watch_health(self, service: str) -> AsyncIterator[str]:
        """Health statuses (SERVING, NOT_SERVING, ...) as they change; raises WorkerCallError."""
        ...

    async def close(self) -> None: ...

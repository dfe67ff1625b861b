"""Readiness that follows the tier behind a server: watch its replicas' health.

A gateway is only worth routing to while some router can serve, so it watches each
router replica's readiness (``grpc.health.v1.Health/Watch``) and reports SERVING while at
least one of them does. Kubernetes then takes a gateway whose routers all lost their
workers out of its Service's endpoints instead of letting it answer every request with
UNAVAILABLE; liveness (the empty service name) stays SERVING, so nothing is restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import create_channel
from services.common.settings import TlsSettings

log = logging.getLogger(__name__)

SERVING = "SERVING"
UNREACHABLE = "UNREACHABLE"

READINESS_KEEPALIVE_MS = 10_000
"""Keepalive of the Watch channels: a replica that froze with its connections open shows
as UNREACHABLE about 12 s later (ping + 2 s timeout). Readiness is read by a probe every
5 s that acts after two failures, so a 2 s ping would buy little; it would cost both
processes about 1.5 ms of CPU per second for as long as the mesh runs. A frozen replica's
requests move sooner: the Sessions ping while a request awaits an answer."""


class UpstreamHealth:
    """The readiness of every replica of one upstream tier, kept current by Watch calls."""

    def __init__(
        self, targets: Sequence[str], service: str, *, tls: TlsSettings | None = None,
        server_name: str = "", on_change: Callable[[], None] | None = None,
        max_backoff_s: float = 1.0, keepalive_time_ms: int = READINESS_KEEPALIVE_MS,
    ) -> None:
        self.service = service
        self.status: dict[str, str] = dict.fromkeys(targets, "UNKNOWN")
        self.on_change = on_change
        self.max_backoff_s = max_backoff_s
        # Untraced channels: health watching is not a request and must not fill traces.
        self._channels = {
            t: create_channel(t, tls=tls, interceptors=[], server_name_override=server_name,
                              keepalive_time_ms=keepalive_time_ms)
            for t in targets
        }
        self._tasks: list[asyncio.Task[None]] = []

    def any_serving(self) -> bool:
        return any(status == SERVING for status in self.status.values())

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._watch(t)) for t in self._channels]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks = []
        for channel in self._channels.values():
            await channel.close()

    def _set(self, target: str, status: str) -> None:
        if self.status.get(target) == status:
            return
        log.info("upstream %s (%s): %s", target, self.service, status)
        self.status[target] = status
        if self.on_change is not None:
            self.on_change()

    async def _watch(self, target: str) -> None:
        stub = health_pb2_grpc.HealthStub(self._channels[target])
        backoff = 0.1
        while True:
            call = stub.Watch(health_pb2.HealthCheckRequest(service=self.service))
            try:
                async for reply in call:
                    backoff = 0.1
                    self._set(target, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.aio.AioRpcError as err:
                log.debug("health watch of %s ended: %s", target, err.code())
            finally:
                call.cancel()
            self._set(target, UNREACHABLE)
            await asyncio.sleep(backoff)
            backoff = min(self.max_backoff_s, backoff * 2)

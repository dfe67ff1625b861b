"""Router server factory and lifecycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from llmesh.router.v1 import router_pb2, router_pb2_grpc
from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.channels import create_channel
from services.common.server import ServerHandle, create_server, run_until_signal
from services.common.sessionwire import SessionMethod
from services.router.core import ChecksumSource, Router
from services.router.servicer import RouterServicer
from services.router.settings import RouterSettings
from services.router.workerapi import WorkerClient
from services.router.workerclient import GrpcWorkerClient

log = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name

READINESS_RECHECK_S = 2.0
"""Longest time between two readings of the router's readiness when nothing signals a
change (a safety net: every change of a worker signals one)."""


def tokenizer_checksums(settings: RouterSettings) -> ChecksumSource:
    """Expected checksums from the tokenizer tier's ListModels."""

    async def fetch() -> dict[str, str]:
        channel = create_channel(settings.tokenizer_target, tls=settings.client_tls)
        try:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            reply = await stub.ListModels(tokenizer_pb2.ListModelsRequest(), timeout=3.0)
        finally:
            await channel.close()
        return {m.model: m.tokenizer_checksum for m in reply.models}

    return fetch


def local_checksums(specs: list[str]) -> ChecksumSource:
    """Expected checksums of the tokenizers of ``specs`` (``name=dir``), computed once here."""
    from services.tokenizer.loader import load_models

    checksums = {name: model.checksum for name, model in load_models(specs).items()}

    async def fetch() -> dict[str, str]:
        return dict(checksums)

    return fetch


def checksum_source(settings: RouterSettings) -> ChecksumSource | None:
    """Where the workers' tokenizer checksums are checked against, if anywhere."""
    if settings.tokenizer_target:
        return tokenizer_checksums(settings)
    if settings.tokenizer_models:
        return local_checksums(list(settings.tokenizer_models))
    return None


@dataclass
class RouterServer:
    handle: ServerHandle
    router: Router

    @property
    def port(self) -> int:
        return self.handle.port


async def build_server(
    settings: RouterSettings,
    *,
    connect: Callable[[str], WorkerClient] | None = None,
) -> RouterServer:
    """Create (not start) the router server; ``settings.port=0`` binds a free port."""
    tls = settings.client_tls
    router = Router(
        settings,
        connect or (lambda address: GrpcWorkerClient(address, tls=tls)),
        checksum_source=checksum_source(settings),
    )
    servicer = RouterServicer(router)
    handle = await create_server(
        settings,
        tier="router",
        register=lambda server: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server),
        service_names=[SERVICE_NAME],
        sessions={f"/{SERVICE_NAME}/Session": SessionMethod(servicer.Session, router_pb2.SessionRequest)},
    )
    # Readiness tells the truth: the service is ready while some model can be served,
    # and "<service>/<model>" per model. Every change of a worker (health, reachability,
    # circuit, refusal) re-evaluates it at once; a circuit half-opening with time, when it
    # is due. An idle router re-reads it only every READINESS_RECHECK_S, not per load poll.
    handle.readiness = lambda: readiness_by_name(router.readiness())
    handle.readiness_due = router.readiness_due
    handle.readiness_interval_s = READINESS_RECHECK_S
    router.on_change = handle.readiness_changed.set
    return RouterServer(handle, router)


def readiness_by_name(models: dict[str, bool]) -> dict[str, bool]:
    """Health service names -> ready: the router's service, and one name per model."""
    return {SERVICE_NAME: any(models.values()),
            **{f"{SERVICE_NAME}/{model}": ready for model, ready in models.items()}}


async def serve(
    settings: RouterSettings,
    *,
    stop_event: asyncio.Event | None = None,
    on_started: Callable[[int], None] | None = None,
    on_built: Callable[[RouterServer], None] | None = None,
) -> None:
    """Run the router until SIGTERM/SIGINT (or ``stop_event``).

    Warm-up connects the workers and waits briefly for one to be healthy. From then on
    readiness follows the workers: NOT_SERVING while no worker can serve (requests would
    get UNAVAILABLE), SERVING again as soon as one can (see ``readiness_by_name``).
    ``on_built`` gets the server before it starts (the gateway's in-process router calls
    its core directly).
    """
    server = await build_server(settings)
    if on_built is not None:
        on_built(server)

    async def warmup() -> None:
        await server.router.start()
        if not await server.router.wait_ready(timeout=10.0):
            log.warning("no healthy worker yet; NOT_SERVING until one is")

    await run_until_signal(
        server.handle,
        tier="router",
        grace_seconds=settings.grace_seconds,
        warmup=warmup,
        close=[server.router.close],
        stop_event=stop_event,
        on_started=on_started,
        freeze_heap=True,
        latency_slice_us=settings.latency_slice_us,
        latency_nice=settings.latency_nice,
    )


async def start_in_process(
    settings: RouterSettings, *, connect: Callable[[str], WorkerClient] | None = None,
    wait_ready: float = 0.0,
) -> RouterServer:
    """Start a router in this event loop (tests): returns the server; stop with ``stop()``."""
    server = await build_server(settings, connect=connect)
    await server.router.start()
    await server.handle.server.start()
    await server.handle.set_live(True)
    await server.handle.set_ready(True)
    if wait_ready:
        await server.router.wait_ready(wait_ready)
    return server


async def stop_in_process(server: RouterServer) -> None:
    await server.handle.server.stop(0.5)
    await server.router.close()


__all__ = ["SERVICE_NAME", "RouterServer", "build_server", "grpc", "serve", "start_in_process",
           "stop_in_process"]

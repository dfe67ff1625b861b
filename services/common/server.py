"""Server factory and lifecycle shared by every tier.

``create_server`` binds, adds health, reflection and interceptors and returns
``(server, port, health)``. ``run_until_signal`` owns the lifecycle: start, warm up,
SERVING, wait for SIGTERM/SIGINT, NOT_SERVING, drain, close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llmesh.common.v1 import session_transport_pb2_grpc
from services.common.authz import CallerAuthorizer, caller_authz_interceptors
from services.common.channels import (
    SERVER_KEEPALIVE_OPTIONS,
    server_credentials,
    server_message_options,
)
from services.common.gcpause import freeze_startup_heap, watch_full_collections
from services.common.interceptors import ErrorMappingInterceptor
from services.common.processes import CPU_TIERS
from services.common.schedslice import apply_slice
from services.common.sessionwire import (
    SESSION_TRANSPORT_SERVICE,
    SessionListener,
    SessionMethod,
    SessionTransportServicer,
)
from services.common.settings import ServerSettings

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class ServerHandle:
    """A started (or startable) server with its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    events: list[str] = field(default_factory=list)
    """Lifecycle steps in the order they happened (tests assert the shutdown order)."""
    readiness: Callable[[], Mapping[str, bool]] | None = None
    """Readiness per health service name while serving, re-read whenever
    ``readiness_changed`` is set and every ``readiness_interval_s``; None: ready once
    warmed up. Names it stops returning turn NOT_SERVING."""
    readiness_changed: asyncio.Event = field(default_factory=asyncio.Event)
    readiness_interval_s: float = 2.0
    """A safety net only: whatever changes readiness sets ``readiness_changed`` (a
    shorter interval was a wakeup of an idle process twice a second)."""
    readiness_due: Callable[[], float | None] | None = None
    """Seconds until readiness may change with time alone (None: not before
    ``readiness_changed`` is set); a sooner re-read than ``readiness_interval_s``."""
    followed: dict[str, bool] = field(default_factory=dict)
    """What :meth:`follow_readiness` last set, per health service name."""
    sessions: SessionListener | None = None
    """The framed Session listener (services/common/sessionwire.py), if the tier has one."""

    async def follow_readiness(self) -> None:
        """Keep health in step with :attr:`readiness` until cancelled (the serving phase)."""
        assert self.readiness is not None
        while True:
            self.readiness_changed.clear()
            current = dict(self.readiness())
            for name in self.followed.keys() - current.keys():
                current[name] = False  # e.g. a model no worker serves any more
            for name, ready in current.items():
                if self.followed.get(name) != ready:
                    await self.health.set(name, SERVING if ready else NOT_SERVING)
                    log.info("readiness of %s: %s", name, "SERVING" if ready else "NOT_SERVING")
            self.followed = current
            wait = self.readiness_interval_s
            if self.readiness_due is not None and (due := self.readiness_due()) is not None:
                wait = min(wait, due + 0.005)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self.readiness_changed.wait()

    async def set_ready(self, ready: bool) -> None:
        status = SERVING if ready else NOT_SERVING
        for name in (*self.service_names, *self.followed):
            await self.health.set(name, status)
        self.events.append("ready" if ready else "not_ready")

    async def set_live(self, live: bool) -> None:
        await self.health.set("", SERVING if live else NOT_SERVING)


async def create_server(
    settings: ServerSettings,
    *,
    tier: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    extra_interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tracing: bool = True,
    max_receive_message_bytes: int = 0,
    sessions: Mapping[str, SessionMethod] | None = None,
) -> ServerHandle:
    """Build a grpc.aio server with health, reflection and the shared interceptors.

    Health starts NOT_SERVING for every service name (readiness) and for "" (liveness)
    until the caller says otherwise. An internal tier (router, worker, tokenizer,
    postprocessor) serving mutual TLS checks each caller's certificate identity against
    its policy (services/common/authz.py) unless ``settings.authorize_callers`` is off.
    ``max_receive_message_bytes`` > 0 caps request messages (the gateway's, sized from its
    request limits).

    ``sessions`` (full method name -> handler) are also served on a framed listener
    (services/common/sessionwire.py) bound here on ``settings.session_port`` (unless -1),
    with the same TLS and caller policy; ``GetSessionEndpoint`` on the gRPC port names it.
    """
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if tracing:
        from services.common.tracing import server_interceptors

        interceptors += server_interceptors()
    interceptors += list(extra_interceptors)
    # Error mapping is innermost so tracing and auth see the mapped status.
    interceptors.append(ErrorMappingInterceptor(tier))
    # Inside error mapping: a refusal is a PermissionDenied, mapped and counted like any
    # other status. Internal tiers with mutual TLS only (see authz.py).
    interceptors += caller_authz_interceptors(
        tier, mutual_tls=settings.mutual_tls, enabled=settings.authorize_callers,
        caller_identities=settings.caller_identities,
    )
    if settings.processes > 1 and tier not in CPU_TIERS:
        raise ValueError(f"{tier}: --processes must be 1 (only {', '.join(CPU_TIERS)} run several)")
    server = grpc.aio.server(
        interceptors=interceptors,
        # SO_REUSEPORT only when this is one of several processes sharing the port
        # (services/common/processes.py); otherwise a port already taken fails the bind.
        options=[*SERVER_KEEPALIVE_OPTIONS, *server_message_options(max_receive_message_bytes),
                 ("grpc.so_reuseport", 1 if settings.processes > 1 else 0)],
    )
    register(server)
    listener: SessionListener | None = None
    if sessions and settings.session_port >= 0:
        authorizer = (CallerAuthorizer.build(tier, settings.caller_identities)
                      if settings.mutual_tls and settings.authorize_callers else None)
        listener = SessionListener(
            tier, sessions, host=settings.host, port=settings.session_port, tls=settings.server_tls,
            authorizer=authorizer, reuse_port=settings.processes > 1,
        )
        await listener.bind()
        session_transport_pb2_grpc.add_SessionTransportServiceServicer_to_server(
            SessionTransportServicer(listener), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    framed = (SESSION_TRANSPORT_SERVICE,) if listener is not None else ()
    reflection.enable_server_reflection(
        (*names, *framed, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME),
        server,
    )
    address = f"{settings.host}:{settings.port}"
    tls = settings.server_tls
    if tls is not None:
        port = server.add_secure_port(address, server_credentials(tls))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"{tier}: could not bind {address}")
    for name in ("", *names):
        await health_servicer.set(name, NOT_SERVING)
    return ServerHandle(server=server, port=port, health=health_servicer, service_names=names,
                        sessions=listener)


async def run_until_signal(
    handle: ServerHandle,
    *,
    tier: str,
    grace_seconds: float,
    warmup: Callable[[], Awaitable[None]] | None = None,
    close: Sequence[Callable[[], Awaitable[None]]] = (),
    stop_event: asyncio.Event | None = None,
    drain_seconds: float = 0.0,
    on_started: Callable[[int], None] | None = None,
    freeze_heap: bool = False,
    latency_slice_us: int = 0,
    latency_nice: int = 0,
) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop_event``), then shut down in order.

    Order and why:
    1. start the server and report live, so liveness probes pass during a long warm-up;
    2. warm up, then report ready: callers only route here once it can answer;
    3. on a signal, report NOT_SERVING first and keep accepting calls for
       ``drain_seconds``, so routers and probes watching health stop sending new work
       before the port closes;
    4. ``server.stop(grace)`` lets in-flight streams finish, then cancels them;
    5. only then close engines and channels, which in-flight calls were still using.

    ``freeze_heap`` (a tier's own process, not a server inside a test): what the imports
    made is frozen out of the garbage collector before the server starts, what the warm-up
    made before ready, and full collections are timed from then on
    (services/common/gcpause.py). ``latency_slice_us`` and ``latency_nice`` (the tier's
    settings): the scheduler slice and nice value the process's threads ask for after the
    warm-up (services/common/schedslice.py).
    """
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests): rely on stop_event
    follower: asyncio.Task[None] | None = None
    if freeze_heap:
        # What the imports made, before anyone calls: the longest collection stalls nobody.
        freeze_startup_heap(tier, "imports")
    await handle.server.start()
    if handle.sessions is not None:
        await handle.sessions.start()
        log.info("%s serves Session frames on port %d", tier, handle.sessions.port)
    handle.events.append("started")
    await handle.set_live(True)
    if on_started is not None:
        on_started(handle.port)
    log.info("%s listening on port %d", tier, handle.port)
    try:
        if warmup is not None:
            warm = asyncio.ensure_future(warmup())
            waiter = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({warm, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if warm in done:
                waiter.cancel()
                warm.result()
                handle.events.append("warmed_up")
            else:
                warm.cancel()
        if not stop.is_set():
            if freeze_heap:
                # Before ready (no request waits): what the warm-up made (the engine's).
                freeze_startup_heap(tier, "warm-up")
                watch_full_collections(tier)
            # After the warm-up: a process it started (the worker's engine core) keeps the
            # kernel's slice and its nice, so the engine yields to this tier's wake-ups.
            apply_slice(latency_slice_us, tier=tier, nice=latency_nice)
            if handle.readiness is None:
                await handle.set_ready(True)
            else:  # ready while what it depends on can serve (see ServerHandle.readiness)
                follower = asyncio.ensure_future(handle.follow_readiness())
                handle.events.append("ready")
            log.info("%s ready", tier)
            await stop.wait()
    finally:
        if follower is not None:
            follower.cancel()
            await asyncio.wait({follower})
        for sig in installed:
            loop.remove_signal_handler(sig)
        log.info("%s stopping", tier)
        await handle.set_ready(False)
        if drain_seconds > 0:
            await asyncio.sleep(drain_seconds)
        await handle.set_live(False)
        if handle.sessions is not None:
            await asyncio.gather(handle.server.stop(grace_seconds), handle.sessions.stop(grace_seconds))
        else:
            await handle.server.stop(grace_seconds)
        handle.events.append("stopped")
        for closer in close:
            try:
                await closer()
            except Exception:
                log.exception("%s: error while closing", tier)
        handle.events.append("closed")

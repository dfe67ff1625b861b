"""Gateway server factory and lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.audit import AuditLog
from gateway.core import GatewayConfig, GatewayCore
from gateway.localpost import LocalPostprocessorTier
from gateway.localrouter import LocalRouterTier
from gateway.localtokenizer import LocalTokenizerTier
from gateway.postsession import SessionPostprocessorTier
from gateway.routersession import SessionRouterTier
from gateway.servicer import AuthGate, InferenceServicer
from gateway.settings import GatewaySettings, local_router_settings
from gateway.tenants import TenantRegistry, load_tenants
from gateway.tiers import GrpcPostprocessorTier, GrpcRouterTier, GrpcTokenizerTier
from gateway.tokenizersession import SessionTokenizerTier
from llmesh.router.v1 import router_pb2
from llmesh.v1 import inference_pb2, inference_pb2_grpc
from services.common.limits import RequestLimitSettings
from services.common.readiness import UpstreamHealth
from services.common.server import ServerHandle, create_server, run_until_signal
from services.common.settings import TlsSettings
from services.postprocessor.core import PostprocessCore
from services.postprocessor.server import build_core as build_postprocessor_core
from services.postprocessor.server import warm_up as warm_up_postprocessor
from services.postprocessor.settings import PostprocessorSettings
from services.router.core import Router
from services.router.settings import RouterSettings
from services.tokenizer.core import TokenizerCore
from services.tokenizer.server import build_core as build_tokenizer_core
from services.tokenizer.server import warm_up as warm_up_tokenizer
from services.tokenizer.settings import TokenizerSettings

if TYPE_CHECKING:
    from services.router.server import RouterServer

log = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name

TokenizerTiers = GrpcTokenizerTier | SessionTokenizerTier | LocalTokenizerTier
"""The tokenizer tier of any transport (settings.tokenizer_transport)."""
PostprocessorTiers = GrpcPostprocessorTier | SessionPostprocessorTier | LocalPostprocessorTier
"""The postprocessor tier of any transport (settings.postprocessor_transport)."""
RouterTiers = GrpcRouterTier | LocalRouterTier
"""The router tier of any transport (settings.router_transport; SessionRouterTier is a GrpcRouterTier)."""


@dataclass
class Gateway:
    handle: ServerHandle
    core: GatewayCore
    tiers: tuple[TokenizerTiers, RouterTiers, PostprocessorTiers]
    audit: AuditLog

    @property
    def port(self) -> int:
        return self.handle.port

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()
        self.audit.close()


def build_core(settings: GatewaySettings, *, local_router: Router | None = None
               ) -> tuple[GatewayCore, tuple[TokenizerTiers, RouterTiers, PostprocessorTiers], AuditLog]:
    tls = settings.client_tls
    tokenizer: TokenizerTiers
    if settings.tokenizer_transport == "local":
        tokenizer = LocalTokenizerTier(build_local_tokenizer(settings))
    elif settings.tokenizer_transport == "session":
        tokenizer = SessionTokenizerTier(settings.tokenizer_targets, tls)
    else:
        tokenizer = GrpcTokenizerTier(settings.tokenizer_targets, tls)
    router: RouterTiers
    if settings.router_transport == "local":
        if local_router is None:
            raise ValueError("router_transport local needs the in-process router (see with_local_router)")
        router = LocalRouterTier(local_router)
    elif settings.router_transport == "session":
        router = SessionRouterTier(settings.router_targets, router_tls(settings))
    else:
        router = GrpcRouterTier(settings.router_targets, router_tls(settings))
    post: PostprocessorTiers
    if settings.postprocessor_transport == "local":
        post = LocalPostprocessorTier(build_local_postprocessor(settings.local_models))
    elif settings.postprocessor_transport == "session":
        post = SessionPostprocessorTier(settings.postprocessor_targets, tls)
    else:
        post = GrpcPostprocessorTier(settings.postprocessor_targets, tls)
    tenants = load_tenants(settings.tenants_file) if settings.tenants_file else []
    audit = AuditLog(settings.audit_log or None)
    core = GatewayCore(
        tokenizer, router, post,
        tenants=TenantRegistry(tenants, default_filter_mode=settings.default_filter_mode),
        config=GatewayConfig(
            limits=settings.limits(),
            default_model=settings.default_model,
            default_max_tokens=settings.default_max_tokens,
            default_temperature=settings.default_temperature if settings.default_temperature >= 0 else None,
            failover=settings.failover_policy(),
            stream_interval=settings.stream_interval,
            stream_max_delay_ms=settings.stream_max_delay_ms,
        ),
        audit=audit,
    )
    return core, (tokenizer, router, post), audit


def build_local_tokenizer(settings: GatewaySettings) -> TokenizerCore:
    """The in-process tokenizer's core: the tier's own, with the gateway's request limits
    (the limits the two tiers share)."""
    limits = {name: getattr(settings, name) for name in RequestLimitSettings.model_fields}
    return build_tokenizer_core(TokenizerSettings(
        models=settings.local_models, encode_threads=settings.local_encode_threads, **limits))


def build_local_postprocessor(models: list[str]) -> PostprocessCore:
    """The in-process postprocessor's core: the tier's own, with its default limits (the
    filter mode comes with every request from the gateway)."""
    return build_postprocessor_core(PostprocessorSettings(models=models))


async def create_gateway(settings: GatewaySettings, *, local_router: Router | None = None) -> Gateway:
    """Build the gateway server (not started); ``settings.port=0`` picks a free port.
    ``local_router``: the in-process router's core (router_transport ``local``, see
    :func:`with_local_router`)."""
    core, tiers, audit = build_core(settings, local_router=local_router)
    servicer = InferenceServicer(core)
    handle = await create_server(
        settings, tier="gateway",
        register=lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, s),
        service_names=[SERVICE_NAME],
        # Keys are checked before a message is read, and no message beyond what the
        # request limits allow is accepted at all (see GatewaySettings.max_request_bytes).
        extra_interceptors=[AuthGate(core)],
        max_receive_message_bytes=settings.grpc_max_request_bytes(),
    )
    return Gateway(handle=handle, core=core, tiers=tiers, audit=audit)


def router_tls(settings: GatewaySettings) -> TlsSettings | None:
    """TLS to the routers: none to the in-process router (loopback, this process only)."""
    return None if settings.router_transport == "local" else settings.client_tls


class LocalRouter:
    """The router that router_transport ``local`` runs in the gateway's event loop: the
    router tier's own server (services/router/server.py), started before the gateway and
    stopped after it, so every stream the gateway drains still has its router."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.port = 0
        self.router: Router | None = None
        """The server's core, which the gateway calls directly (:class:`LocalRouterTier`)."""
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def target(self) -> str:
        return f"{self.settings.host}:{self.port}"

    async def start(self) -> None:
        from services.router.server import serve as router_serve

        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_started(port: int) -> None:
            if not started.done():
                started.set_result(port)

        # The router installs its SIGTERM/SIGINT handlers as it starts; the gateway's,
        # installed after, replace them: a signal stops the gateway, which then stops this.
        def on_built(server: RouterServer) -> None:
            self.router = server.router

        self._task = asyncio.create_task(router_serve(self.settings, stop_event=self._stop,
                                                      on_started=on_started, on_built=on_built))
        waits: set[asyncio.Future[Any]] = {self._task, started}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            self._task.result()  # raises why the router did not start
            raise RuntimeError("the in-process router stopped before it listened")
        self.port = started.result()
        assert self.router is not None  # built before it listens
        log.info("in-process router listening on %s", self.target)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


@dataclass(frozen=True)
class Served:
    """The settings the gateway runs with, and its in-process router's core (if any)."""

    settings: GatewaySettings
    router: Router | None = None


@contextlib.asynccontextmanager
async def with_local_router(settings: GatewaySettings) -> AsyncIterator[Served]:
    """``settings`` as the gateway runs them: with router_transport ``local``, the
    in-process router (:class:`LocalRouter`) runs for the block, is the one router target
    (readiness reaches its gRPC port) and its core is what the gateway calls;
    otherwise unchanged."""
    if settings.router_transport != "local":
        yield Served(settings)
        return
    router = LocalRouter(local_router_settings(settings))
    await router.start()
    try:
        yield Served(settings.model_copy(update={"router_targets": [router.target]}), router.router)
    finally:
        await router.stop()


async def serve(settings: GatewaySettings, stop_event: asyncio.Event | None = None) -> None:
    """Run the gateway until SIGTERM/SIGINT (or ``stop_event``); with router_transport
    ``local``, its router in the same event loop (:func:`with_local_router`)."""
    async with with_local_router(settings) as served:
        await _serve(served, stop_event)


async def _serve(served: Served, stop_event: asyncio.Event | None) -> None:
    settings = served.settings
    gateway = await create_gateway(settings, local_router=served.router)
    http_runner = None

    async def warmup() -> None:
        # The in-process tiers warm up as their own processes would.
        tokenizer, _, post = gateway.tiers
        if isinstance(tokenizer, LocalTokenizerTier):
            await warm_up_tokenizer(tokenizer.core)
        if isinstance(post, LocalPostprocessorTier):
            await warm_up_postprocessor(post.core)
        # Ready once the tokenizer tier answers: without it no request can be served.
        while True:
            try:
                models = await gateway.core.list_models()
                if models:
                    log.info("serving models: %s", ", ".join(m.id for m in models))
                    return
            except Exception as exc:  # keep waiting for the tier to come up
                log.info("waiting for the tokenizer tier: %s", exc)
            await asyncio.sleep(0.5)

    if settings.http_port >= 0:
        from gateway.http import start_http

        http_runner = await start_http(gateway.core, settings)

    async def close_http() -> None:
        if http_runner is not None:
            await http_runner.cleanup()

    # Readiness follows the routers: ready while at least one router replica can serve
    # (a router is NOT_SERVING while none of its workers can), see services/common/readiness.py.
    routers = UpstreamHealth(settings.router_targets, ROUTER_SERVICE, tls=router_tls(settings),
                             on_change=gateway.handle.readiness_changed.set)
    routers.start()
    gateway.handle.readiness = lambda: {SERVICE_NAME: routers.any_serving()}
    await run_until_signal(
        gateway.handle, tier="gateway", grace_seconds=settings.grace_seconds, warmup=warmup,
        close=[close_http, routers.close, gateway.close], stop_event=stop_event,
        drain_seconds=settings.drain_seconds, freeze_heap=True, latency_slice_us=settings.latency_slice_us,
        latency_nice=settings.latency_nice,
    )

"""Build and run the postprocessor server."""

from __future__ import annotations

import asyncio
import logging

from llmesh.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from services.common.server import ServerHandle, create_server, run_until_signal
from services.common.sessionwire import SessionMethod
from services.postprocessor import metrics
from services.postprocessor.core import Limits, PostprocessCore, SessionConfig, UpstreamFinish
from services.postprocessor.sensitive import FilterMode
from services.postprocessor.servicer import SERVICE_NAME, PostprocessServicer
from services.postprocessor.settings import PostprocessorSettings
from services.tokenizer.loader import load_models

log = logging.getLogger(__name__)


def build_core(settings: PostprocessorSettings) -> PostprocessCore:
    """Load every configured tokenizer (raises ModelLoadError naming the bad file)."""
    models = load_models(settings.model_specs())
    limits = Limits(
        max_stop_strings=settings.max_stop_strings,
        max_stop_chars=settings.max_stop_chars,
        max_tokens_per_stream=settings.max_tokens_per_stream,
    )
    return PostprocessCore(
        models, limits=limits, default_filter_mode=FilterMode(settings.default_filter_mode),
        on_redaction=lambda kind: metrics.REDACTIONS.labels(kind).inc(),
    )


async def build_server(settings: PostprocessorSettings) -> tuple[ServerHandle, PostprocessCore]:
    """The server (not started; health NOT_SERVING) and its core. ``handle.port`` is bound."""
    core = build_core(settings)
    servicer = PostprocessServicer(
        core, final_drain_seconds=settings.final_drain_seconds,
        error_drain_seconds=settings.error_drain_seconds,
    )
    handle = await create_server(
        settings,
        tier="postprocessor",
        register=lambda server: postprocess_pb2_grpc.add_PostprocessServiceServicer_to_server(
            servicer, server
        ),
        service_names=[SERVICE_NAME],
        sessions={
            f"/{SERVICE_NAME}/Session": SessionMethod(servicer.Session, postprocess_pb2.SessionRequest)},
    )
    for name, model in core.models.items():
        log.info("postprocessor model %s loaded from %s (checksum %s)", name, model.path, model.checksum)
    return handle, core


async def warm_up(core: PostprocessCore) -> None:
    """Run one short stream per model through the whole pipeline."""
    for name, model in core.models.items():
        session = core.open(SessionConfig(model=name, stop=("\n\n",), filter_mode=FilterMode.REDACT))
        session.feed(model.tokenizer.encode("warm up 4111 1111", add_special_tokens=False).ids)
        session.end(UpstreamFinish.STOP)


async def serve(settings: PostprocessorSettings, *, stop_event: asyncio.Event | None = None) -> None:
    handle, core = await build_server(settings)
    await run_until_signal(
        handle,
        tier="postprocessor",
        grace_seconds=settings.grace_seconds,
        drain_seconds=settings.drain_seconds,
        warmup=lambda: warm_up(core),
        stop_event=stop_event,
        freeze_heap=True,
        latency_slice_us=settings.latency_slice_us,
        latency_nice=settings.latency_nice,
    )

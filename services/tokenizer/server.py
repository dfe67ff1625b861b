"""Build and run the tokenizer server."""

from __future__ import annotations

import asyncio
import logging

from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.server import ServerHandle, create_server, run_until_signal
from services.common.sessionwire import SessionMethod
from services.tokenizer import metrics
from services.tokenizer.core import ChatMessage, EncodeInput, TokenizerCore
from services.tokenizer.loader import load_models
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from services.tokenizer.settings import TokenizerSettings

log = logging.getLogger(__name__)


def build_core(settings: TokenizerSettings) -> TokenizerCore:
    """Load every configured model (raises ModelLoadError naming the bad file)."""
    models = load_models(settings.model_specs())
    limits = settings.limits()  # the limits the gateway shares (services/common/limits.py)
    return TokenizerCore(
        models, limits=limits, threads=settings.encode_threads, max_batch=settings.max_encode_batch,
        on_batch=metrics.ENCODE_BATCH_SIZE.observe, inline_max_chars=settings.inline_encode_max_chars,
    )


async def build_server(settings: TokenizerSettings) -> tuple[ServerHandle, TokenizerCore]:
    """The server (not started; health NOT_SERVING) and its core. ``handle.port`` is bound."""
    core = build_core(settings)
    servicer = TokenizerServicer(core)
    handle = await create_server(
        settings,
        tier="tokenizer",
        register=lambda server: tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server),
        service_names=[SERVICE_NAME],
        sessions={f"/{SERVICE_NAME}/Session": SessionMethod(servicer.Session, tokenizer_pb2.SessionRequest)},
    )
    for name, model in core.models.items():
        log.info("tokenizer model %s loaded from %s (checksum %s, vocab %d)",
                 name, model.path, model.checksum, model.vocab_size)
    return handle, core


async def warm_up(core: TokenizerCore) -> None:
    """Render and encode once per model, so the first caller does not pay for it."""
    for name, model in core.models.items():
        await core.encode(EncodeInput(model=name, prompt="warm up"))
        if model.chat_template:
            await core.encode(EncodeInput(model=name, messages=(ChatMessage("user", "warm up"),)))


async def serve(settings: TokenizerSettings, *, stop_event: asyncio.Event | None = None) -> None:
    handle, core = await build_server(settings)

    async def close_core() -> None:
        core.close()

    await run_until_signal(
        handle,
        tier="tokenizer",
        grace_seconds=settings.grace_seconds,
        drain_seconds=settings.drain_seconds,
        warmup=lambda: warm_up(core),
        close=[close_core],
        stop_event=stop_event,
        freeze_heap=True,
        latency_slice_us=settings.latency_slice_us,
        latency_nice=settings.latency_nice,
    )

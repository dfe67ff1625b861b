"""The engine protocol the worker is typed against, and its domain types.

vLLM's ``AsyncLLM`` (through :mod:`services.worker.vllm_engine`) is the production
implementation; :mod:`services.worker.fake_engine` is a deterministic double with no
vLLM import. Nothing here imports grpc or vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from services.common.errors import InvalidArgument

# The generation types every internal tier shares, re-exported under the worker's names.
from services.common.generation import FinishReason as FinishReason
from services.common.generation import TokenLogprob as TokenLogprob

# The one sampling type every tier shares (None: unset, the engine's default), re-exported.
from services.common.sampling import Sampling as Sampling


@dataclass(frozen=True)
class EngineRequest:
    """One generation in token ids."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling = field(default_factory=Sampling)
    priority: int = 0
    adapter: str = ""
    """LoRA adapter name; empty uses the base model."""
    replay_token_ids: tuple[int, ...] = ()
    """Tokens an earlier attempt already delivered: the engine re-generates them first as
    forced decode steps (not emitted), so a resumed greedy run equals an undisturbed one.
    ``sampling.max_tokens`` / ``min_tokens`` count the tokens after them."""


@dataclass
class EngineOutput:
    """One delta from the engine; the last one has ``finish_reason`` set."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    """The EOS or stop token id that ended the generation (``finish_reason`` STOP)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (vLLM ``num_cached_tokens``)."""
    queue_ms: float | None = None
    """Time queued in the engine before first scheduled, when the engine reports it."""
    ttft_ms: float | None = None
    """Time from arrival to first token, when the engine reports it."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load as its scheduler last reported it."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV cache blocks in use, 0..1."""
    prefix_cache_hit_rate: float = 0.0
    """Prefix cache hits / queries since start, 0..1."""
    scheduler_running: int = 0
    """The scheduler's own count as last reported, not capped by the frontend's view."""
    scheduler_waiting: int = 0
    """The scheduler's own count as last reported, not capped by the frontend's view."""


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about a started engine."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...] = ()
    max_logprobs: int = 20
    """Most alternatives per token the engine returns (vLLM ``max_logprobs``)."""


class EngineDeadError(RuntimeError):
    """The engine is gone (engine-core process died); the worker must exit."""


class RequestRejected(InvalidArgument):
    """The engine refused one request for its own values, not for the engine's health.

    Engine adapters raise it for the engine's client errors (vLLM's ``VLLMClientError``),
    so the caller gets INVALID_ARGUMENT naming the field and the router never counts it
    against the worker.
    """


OutputSink = Callable[["EngineOutput | Exception"], None]
"""Where the engine puts one request's outputs (see :meth:`Engine.start`).

A sink may also have a ``step_tokens(token_ids)`` method (see :class:`TokenSink`): an engine
may then hand it a step's plain new token ids (a request without logprobs that did not
end in that step) without building an :class:`EngineOutput` for them."""


@runtime_checkable
class TokenSink(Protocol):
    """An :data:`OutputSink` that also takes plain token ids."""

    def __call__(self, out: EngineOutput | Exception) -> None: ...

    def step_tokens(self, token_ids: list[int]) -> None:
        """The same as ``sink(EngineOutput(token_ids))`` for a request that asked for no
        logprobs and did not end with these tokens. ``token_ids`` stays the engine's: the
        sink copies what it keeps and never changes it."""
        ...


@runtime_checkable
class Engine(Protocol):
    """What the worker needs from an inference engine."""

    @property
    def info(self) -> EngineInfo:
        """Static facts; valid once the engine is built."""
        ...

    @property
    def errored(self) -> bool:
        """True once the engine is dead; it never recovers."""
        ...

    def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Token-id deltas of one request; the last output has ``finish_reason`` set.

        Raises :class:`EngineDeadError` if the engine dies. Closing the iterator early
        must free the request in the engine. The worker itself runs requests through
        :meth:`start`; this is for callers that want one request's stream (benchmarks,
        tests); :func:`stream_from_start` builds it on :meth:`start`.
        """
        ...

    async def start(self, request: EngineRequest, sink: OutputSink) -> None:
        """Hand one request to the engine; its outputs then reach ``sink`` per engine step.

        The engine calls ``sink`` from its own step loop, for every request that advanced
        in one step within the same event-loop callback, so a caller can fill one frame
        per step without a task or a generator per request. The last output has
        ``finish_reason`` set (ABORT after :meth:`abort`). Instead of it, ``sink`` may get
        an exception: :class:`EngineDeadError` (the engine died) or
        :class:`RequestRejected` (it refused the request's values); nothing follows one.
        ``start`` itself may raise either when the request cannot be handed over at all.
        ``sink`` must not block or raise.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request; its iterator then ends with ``FinishReason.ABORT``. Unknown ids are ignored."""
        ...

    def load(self) -> EngineLoad:
        """Latest load; cheap (no engine round trip)."""
        ...

    async def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the engine is dead."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
        ...


async def stream_from_start(engine: Engine, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
    """:meth:`Engine.generate` for an engine with a step loop of its own: one request's
    outputs from :meth:`Engine.start` through a queue, raising what the sink got instead
    of an output. Closing it before the last output aborts the request in the engine."""
    outputs: asyncio.Queue[EngineOutput | Exception] = asyncio.Queue()
    await engine.start(request, outputs.put_nowait)
    finished = False
    try:
        while True:
            out = await outputs.get()
            if isinstance(out, Exception):
                finished = True
                raise out
            # Known before the yield: a caller may close the stream at the last output, and
            # the id may by then belong to a newer request that an abort would hit.
            finished = out.finish_reason is not None
            yield out
            if finished:
                return
    finally:
        if not finished:
            await engine.abort(request.request_id)

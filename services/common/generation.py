"""Token-level generation: the one request/delta/final model the internal tiers share.

The router and the worker pass token ids, not text; these types are what their cores
work on. No grpc, no protobuf: :mod:`services.common.generation_convert` is the one
converter to and from ``llmesh.common.v1`` (``TokenRequest``, ``TokenDelta``,
``TokenFinal``) and of the router's ``RouterFinal``, used by every servicer and client on
those boundaries.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.sampling import Sampling


class FinishReason(enum.Enum):
    """Why the engine stopped one generation."""

    STOP = "stop"
    """EOS or one of ``stop_token_ids`` was generated (the token is in the output)."""
    LENGTH = "length"
    """``max_tokens`` or the context length was reached."""
    ABORT = "abort"
    """Aborted by the caller (Abort RPC, cancelled call, passed deadline)."""
    ERROR = "error"
    """The engine failed this request."""


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one generated token and its top alternatives as (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenRequest:
    """One generation in token ids, as a tier below the gateway receives it."""

    request_id: str = ""
    """Unique per generation; the handle for Abort. Empty: the receiver names it."""
    model: str = ""
    """Model id; empty means the worker's (or the router's default) model."""
    prompt_token_ids: tuple[int, ...] = ()
    sampling: Sampling = field(default_factory=Sampling)
    priority: int = 0
    replay_token_ids: tuple[int, ...] = ()
    """Tokens an earlier attempt already delivered (resume after a failure): the engine
    re-generates them first as forced decode steps and does not stream them again;
    ``sampling.max_tokens`` / ``min_tokens`` count only the tokens after them."""


@dataclass(slots=True)
class Delta:
    """Newly generated token ids of one request (a plain list: no per-token objects).

    Built per request and engine step on every hop, so not frozen: a frozen dataclass
    sets each field through ``object.__setattr__`` (0.47 against 0.12 µs per object).
    Nothing changes a delta once built."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    """One entry per token id when the request asked for logprobs, else None."""


@dataclass(frozen=True)
class Final:
    """The closing message of one request."""

    finish_reason: FinishReason
    stop_token_id: int | None = None
    """The EOS or stop token id that ended the generation (``finish_reason`` STOP)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True)
class ServedBy:
    """Which worker ended a request, and how it got there."""

    worker_id: str = ""
    zone: str = ""
    device: str = ""
    degraded: bool = False
    """The zone is on the degraded rung of the ladder (a fallback)."""
    resumed: int = 0
    """Resumes of the request on the way, counting every tier's."""


@dataclass(frozen=True)
class RouterFinal:
    """A request's end as a router reports it (router to gateway): the worker's final with
    the router's counts and times over every attempt, who served it, and how many attempts
    failed before its first token."""

    final: Final
    served_by: ServedBy = field(default_factory=ServedBy)
    retries: int = 0

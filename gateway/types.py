"""Domain types of the gateway (no grpc, no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The types every tier shares, re-exported for the gateway's modules: the router's end of
# a request and who served it come from services.common.generation like the router's own.
from services.common.generation import Final as Final
from services.common.generation import FinishReason as FinishReason
from services.common.generation import RouterFinal as RouterFinal
from services.common.generation import ServedBy as ServedBy
from services.common.sampling import Sampling as Sampling


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class StreamOptions:
    """How a stream's deltas are paced, as the caller asked; 0 takes the deployment's value."""

    interval: int = 0
    """Tokens per delta (1 = a delta per token)."""
    max_delay_ms: int = 0
    """Longest time text waits for the interval to fill."""


@dataclass
class GenerateCall:
    """One public generate request, after conversion from the wire."""

    model: str = ""
    prompt: str = ""
    messages: list[ChatTurn] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    priority: int = 0
    request_id: str = ""
    stream_options: StreamOptions = field(default_factory=StreamOptions)


@dataclass(frozen=True)
class ModelMeta:
    id: str
    max_context_length: int
    tokenizer_checksum: str
    is_default: bool = False
    vocab_size: int = 0


@dataclass(frozen=True)
class Encoded:
    model: str
    token_ids: list[int]
    tokenizer_checksum: str
    truncated: bool = False


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass
class TokenGeneration:
    """What the router needs: token ids and engine sampling (no stop strings)."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: Sampling
    priority: int = 0
    tenant: str = ""
    """The authenticated tenant's name: the router bounds each tenant's share of its queue."""


@dataclass
class Timing:
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


@dataclass
class RouterDelta:
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class PostConfig:
    model: str
    stop: list[str]
    filter_mode: str = "off"
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    skip_chars: int = 0


@dataclass(frozen=True)
class PostDelta:
    text: str


@dataclass(frozen=True)
class PostFinal:
    finish_reason: str  # stop, length, cancelled, content_filter, error
    matched_stop: str = ""
    completion_tokens: int = 0
    redactions: int = 0


@dataclass
class TextDelta:
    """A piece of output text for the client, with token detail when asked."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    model: str
    text: str
    finish_reason: str
    matched_stop: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    served_by: ServedBy = field(default_factory=ServedBy)
    timing: Timing = field(default_factory=Timing)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

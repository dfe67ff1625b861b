"""Prometheus metrics of the tokenizer tier (``llmesh_tokenizer_`` prefix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import trace
from prometheus_client import Counter, Histogram

if TYPE_CHECKING:
    from services.tokenizer.core import EncodeInput, EncodeResult

INPUTS = Counter(
    "llmesh_tokenizer_inputs",
    "Inputs encoded, by model and kind (prompt or messages).",
    ["model", "kind"],
)
TOKENS = Counter(
    "llmesh_tokenizer_tokens",
    "Token ids produced, by model.",
    ["model"],
)
TRUNCATIONS = Counter(
    "llmesh_tokenizer_truncations",
    "Inputs cut to truncate_to tokens, by model.",
    ["model"],
)
ENCODE_BATCH_SIZE = Histogram(
    "llmesh_tokenizer_encode_batch_size",
    "Texts per encode_batch call (micro-batching of concurrent requests).",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)


def count_encoded(item: EncodeInput, result: EncodeResult) -> None:
    """Count one encoded input, and put its sizes (never its text) on the current span
    (the RPC's span for Encode, the request's for a Session entry)."""
    span = trace.get_current_span()
    span.set_attribute("llmesh.model", result.model)
    span.set_attribute("llmesh.prompt_tokens", result.count)
    INPUTS.labels(result.model, "messages" if item.messages else "prompt").inc()
    TOKENS.labels(result.model).inc(result.count)
    if result.truncated:
        TRUNCATIONS.labels(result.model).inc()

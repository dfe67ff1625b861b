"""Prometheus metrics of the tokenizer tier (``llmesh_tokenizer_`` prefix)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

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

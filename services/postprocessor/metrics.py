"""Prometheus metrics of the postprocessor tier (``llmesh_postprocessor_`` prefix).

Counts only: the filter never records the text it redacted, only its kind.
"""

from __future__ import annotations

from prometheus_client import Counter

REQUESTS = Counter(
    "llmesh_postprocessor_requests",
    "Streams opened, by model.",
    ["model"],
)
TOKENS = Counter(
    "llmesh_postprocessor_tokens",
    "Token ids detokenized, by model.",
    ["model"],
)
REDACTIONS = Counter(
    "llmesh_postprocessor_redactions",
    "Sensitive-data matches redacted or blocked, by kind (card, iban, cn_id, phone, email).",
    ["kind"],
)
STOP_STRING_HITS = Counter(
    "llmesh_postprocessor_stop_string_hits",
    "Streams ended by a stop string, by model.",
    ["model"],
)
FINISHES = Counter(
    "llmesh_postprocessor_finishes",
    "Streams finished, by final finish reason.",
    ["reason"],
)

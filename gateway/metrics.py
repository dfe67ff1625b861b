"""Gateway metrics (``llmesh_gateway_*``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from gateway.types import Completion

REQUESTS = Counter(
    "llmesh_gateway_requests",
    "Completed generate requests by model, finish reason and tenant.",
    ["model", "finish_reason", "tenant"],
)
PROMPT_TOKENS = Counter("llmesh_gateway_prompt_tokens", "Prompt tokens of completed requests.", ["model"])
COMPLETION_TOKENS = Counter(
    "llmesh_gateway_completion_tokens", "Completion tokens of completed requests.", ["model"]
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REQUEST_SECONDS = Histogram(
    "llmesh_gateway_request_duration_seconds", "End-to-end generate latency.", ["model"],
    buckets=LATENCY_BUCKETS,
)
TTFT_SECONDS = Histogram(
    "llmesh_gateway_time_to_first_token_seconds", "Time to the first text delta.", ["model"],
    buckets=LATENCY_BUCKETS,
)
TPOT_SECONDS = Histogram(
    "llmesh_gateway_time_per_output_token_seconds", "Mean time per output token after the first.",
    ["model"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1),
)
RATE_LIMITED = Counter(
    "llmesh_gateway_rate_limited", "Requests refused with RESOURCE_EXHAUSTED, by tenant.", ["tenant"]
)
AUTH_FAILURES = Counter(
    "llmesh_gateway_auth_failures",
    "Calls refused for their credentials, by surface (grpc, http) and reason (missing, malformed, "
    "unknown_key).",
    ["surface", "reason"],
)
FAILOVERS = Counter(
    "llmesh_gateway_failovers",
    "Streams moved to another replica by the gateway (router retry/resume, postprocessor replay).",
    ["tier", "kind"],
)

HTTP_STREAM_EVENTS = Counter(
    "llmesh_gateway_http_stream_events",
    "Text events of streamed HTTP responses, by how they went out: direct (written by the code "
    "that released the text) or awaited (the handler's write, which waits for a slow client).",
    ["path"],
)


def record_completion(completion: Completion, tenant: str) -> None:
    model = completion.model
    REQUESTS.labels(model, completion.finish_reason, tenant).inc()
    PROMPT_TOKENS.labels(model).inc(completion.prompt_tokens)
    COMPLETION_TOKENS.labels(model).inc(completion.completion_tokens)
    REQUEST_SECONDS.labels(model).observe(completion.timing.total_ms / 1000)
    TTFT_SECONDS.labels(model).observe(completion.timing.ttft_ms / 1000)
    if completion.completion_tokens > 1:
        per_token = (completion.timing.total_ms - completion.timing.ttft_ms) / 1000
        TPOT_SECONDS.labels(model).observe(max(0.0, per_token) / (completion.completion_tokens - 1))

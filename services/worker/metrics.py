"""Worker metrics (``llmesh_worker_*``); the shared interceptor counts RPCs."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "llmesh_worker_requests", "Finished generations by finish reason.", ["finish_reason"]
)
REJECTED = Counter(
    "llmesh_worker_rejected_requests",
    "Requests refused for their own values (by the worker's checks or by the engine); never a health event.",
)
GENERATED_TOKENS = Counter("llmesh_worker_generated_tokens", "Tokens generated.")
IN_FLIGHT = Gauge("llmesh_worker_in_flight", "Generations admitted and not yet finished.")
TTFT = Histogram(
    "llmesh_worker_ttft_seconds", "Time to first token as the engine reports it.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CANARIES = Counter("llmesh_worker_canaries", "Canary generations by result.", ["result"])
ENGINE_RUNNING = Gauge("llmesh_worker_engine_running", "Requests the engine scheduler is running.")
ENGINE_WAITING = Gauge("llmesh_worker_engine_waiting", "Requests waiting in the engine scheduler.")
KV_CACHE_USAGE = Gauge("llmesh_worker_kv_cache_usage", "Fraction of KV cache blocks in use.")
PREFIX_CACHE_HIT_RATE = Gauge(
    "llmesh_worker_prefix_cache_hit_rate",
    "Fraction of prompt tokens served from the engine's prefix cache (as the engine reports it).",
)
SERVING = Gauge("llmesh_worker_serving", "1 while readiness is SERVING.")

"""Router metrics (``llmesh_router_*``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

WORKER_HEALTHY = Gauge(
    "llmesh_router_worker_healthy",
    "1 if the worker is healthy and reachable (and not refused), else 0.",
    ["worker", "zone"],
)
WORKER_CIRCUIT = Gauge(
    "llmesh_router_worker_circuit_state",
    "Circuit breaker state per worker: 0 closed, 1 open, 2 half-open.",
    ["worker", "zone"],
)
WORKER_IN_FLIGHT = Gauge(
    "llmesh_router_worker_in_flight",
    "Requests this router has in flight on the worker.",
    ["worker", "zone"],
)
FAILOVERS = Counter(
    "llmesh_router_failovers",
    "Attempts that failed on a worker and moved to another one, by zone of the failed worker.",
    ["zone"],
)
RETRIES = Counter("llmesh_router_retries", "Re-attempts after a failure before the first token.")
RESUMES = Counter("llmesh_router_resumes", "Re-submissions after a failure mid-stream.")
REFUSED = Counter(
    "llmesh_router_workers_refused", "Workers refused for a tokenizer checksum mismatch."
)
BATCH_SIZE = Histogram(
    "llmesh_router_batch_size",
    "Requests per worker call (1 = sent alone).",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
WINDOW_WAIT = Histogram(
    "llmesh_router_batch_window_wait_seconds",
    "Time the oldest request of a batch waited in the batching window.",
    buckets=(0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
)
QUEUE_DEPTH = Gauge(
    "llmesh_router_queue_depth",
    "Requests waiting for worker capacity, by priority (one queue; max_queue bounds the sum).",
    ["priority"],
)
REJECTED = Counter(
    "llmesh_router_rejected",
    "Requests refused with RESOURCE_EXHAUSTED by admission, all reasons together.",
)
ADMISSION_REFUSED = Counter(
    "llmesh_router_admission_refused",
    "Admission refusals (RESOURCE_EXHAUSTED + RetryInfo) by reason: expected_wait (would "
    "not be served within its deadline or queue_timeout_s), tenant_share, queue_full, "
    "displaced (by a higher priority), queue_timeout (waited queue_timeout_s).",
    ["reason"],
)
DRAIN_RATE = Gauge(
    "llmesh_router_drain_rate",
    "Worker slots freed per second as measured for admission (held slots / mean hold time).",
)
ROUTED = Counter(
    "llmesh_router_routed_requests", "Attempts dispatched to a worker, by zone.", ["zone", "degraded"]
)

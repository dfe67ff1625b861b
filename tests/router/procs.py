"""Spawning real ``llmesh worker`` processes for router tests."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from llmesh.models import ensure_model
from llmesh.procs import TierProcess, free_port, spawn_tier

WORKER_SERVICE = "llmesh.worker.v1.WorkerService"
LOG_DIR = Path(os.environ.get("LLMESH_TEST_LOG_DIR", "/tmp/llmesh-router-tests"))


def spawn_fake_worker(
    name: str, zone: str, *, delay_ms: float = 10.0, max_running: int = 64,
    extra: Sequence[str] = (), netns: str = "", host: str = "127.0.0.1",
) -> TierProcess:
    """A real worker process with the deterministic fake engine (starts in ~1 s)."""
    model = ensure_model("tiny-deepseek", quiet=True)
    port = free_port() if not netns else 50051
    proc = spawn_tier(
        name, "worker",
        ["--engine", "fake", "--model", str(model), "--zone", zone, "--worker-id", name,
         "--host", host, "--port", str(port), "--fake-token-delay-ms", str(delay_ms),
         "--fake-max-running", str(max_running), "--drain-seconds", "0", "--log-format", "text",
         *extra],
        address=f"{host}:{port}", service=WORKER_SERVICE, log_dir=LOG_DIR, zone=zone, netns=netns,
    )
    return proc


def spawn_real_worker(
    name: str, zone: str, cpu: str, *, model_name: str = "tiny-deepseek", dtype: str = "auto",
    netns: str = "", host: str = "127.0.0.1",
) -> TierProcess:
    """A real vLLM CPU worker (tiny DeepSeek by default), pinned to one core; with
    ``netns`` it runs inside that network namespace, listening on ``host``."""
    model = ensure_model(model_name, quiet=True)
    port = free_port() if not netns else 50051
    return spawn_tier(
        name, "worker",
        ["--model", str(model), "--zone", zone, "--worker-id", name, "--host", host, "--port", str(port),
         "--enforce-eager", "--cpu-kvcache-space-gb", "1", "--cpu-omp-threads-bind", cpu,
         "--max-num-seqs", "8", "--max-model-len", "1024", "--drain-seconds", "0", "--dtype", dtype,
         "--log-format", "text",
         # No canary generations: the tests compare greedy token streams, and on a CPU with
         # AMX a canary sharing an engine step changes a bf16 step's numbers (a killed-worker
         # resume once departed from the undisturbed run at token 275, 5 December 2026).
         "--canary-interval-s", "0"],
        address=f"{host}:{port}", service=WORKER_SERVICE, log_dir=LOG_DIR, zone=zone, netns=netns,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpu},
    )

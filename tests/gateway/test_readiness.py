"""Readiness tells the truth (issue 16): with the only worker stopped, router and gateway
report NOT_SERVING within the health interval, and SERVING again once it is back.
Liveness stays SERVING throughout (Kubernetes stops routing, it does not restart)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmesh.meshconfig import MeshConfig, RouterConfig, TierConfig, WorkerConfig
from llmesh.procs import check_health, free_port
from llmesh.up import Mesh

from .conftest import running_mesh

ROUTER = "llmesh.router.v1.RouterService"
GATEWAY = "llmesh.v1.InferenceService"


@pytest.fixture(scope="module")
def one_worker_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1, "settings": {"drain_seconds": 0}},
        router=RouterConfig(zones=["zone-a"]),
        tokenizer=TierConfig(),
        workers=[WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 5})],
    )
    with running_mesh(config, tmp_path_factory.mktemp("readiness-mesh")) as mesh:
        yield mesh


def wait_status(address: str, service: str, want: str, timeout: float) -> float:
    """Seconds until ``service`` at ``address`` reports ``want``; fails after ``timeout``."""
    start = time.monotonic()
    while True:
        status = check_health(address, service)
        if status == want:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{service} at {address} stayed {status}, wanted {want}")
        time.sleep(0.02)


def test_readiness_follows_the_only_worker(one_worker_mesh: Mesh) -> None:
    procs = {p.tier: p for p in one_worker_mesh.procs}
    router, gateway, worker = procs["router"].address, procs["gateway"].address, procs["worker"]
    model = one_worker_mesh.model_name
    assert check_health(router, ROUTER) == "SERVING"
    assert check_health(router, f"{ROUTER}/{model}") == "SERVING"
    assert check_health(router, f"{ROUTER}/no-such-model") == "SERVICE_UNKNOWN"
    assert check_health(gateway, GATEWAY) == "SERVING"
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        # The router's load poll (150 ms, 400 ms timeout) notices; allow a loaded box slack.
        took = wait_status(router, ROUTER, "NOT_SERVING", timeout=5.0)
        assert check_health(router, f"{ROUTER}/{model}") == "NOT_SERVING"
        wait_status(gateway, GATEWAY, "NOT_SERVING", timeout=5.0)
        assert check_health(gateway, "") == "SERVING" and check_health(router, "") == "SERVING"
        print(f"router NOT_SERVING {took:.2f} s after the worker stopped")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    wait_status(router, ROUTER, "SERVING", timeout=10.0)
    wait_status(router, f"{ROUTER}/{model}", "SERVING", timeout=1.0)
    wait_status(gateway, GATEWAY, "SERVING", timeout=5.0)

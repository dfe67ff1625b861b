"""frontend_cpus: the worker's serving threads are pinned off the engine's cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmesh.procs import check_health, free_port, spawn_tier
from services.worker.affinity import check_frontend_cpus, parse_cpu_list
from services.worker.servicer import SERVICE_NAME


def thread_affinities(pid: int) -> dict[int, frozenset[int]]:
    return {int(tid): frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def test_cpu_lists_parse_and_bad_ones_name_the_field() -> None:
    assert parse_cpu_list("1") == {1}
    assert parse_cpu_list("0-2, 5") == {0, 1, 2, 5}
    for bad in ("", "x", "3-1", "-1", "1-"):
        with pytest.raises(ValueError, match="frontend_cpus"):
            parse_cpu_list(bad)


def test_frontend_cpus_must_be_available_and_apart_from_the_engine() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert check_frontend_cpus(str(allowed[-1])) == {allowed[-1]}
    with pytest.raises(ValueError, match=r"frontend_cpus: CPUs \[4096\] are not available"):
        check_frontend_cpus("4096")
    if len(allowed) >= 2:
        with pytest.raises(ValueError, match="also in cpu_omp_threads_bind"):
            check_frontend_cpus(str(allowed[0]), f"{allowed[0]}-{allowed[-1]}")
        # vLLM's own words for "choose for me" and "do not bind" overlap nothing.
        assert check_frontend_cpus(str(allowed[0]), "auto") == {allowed[0]}


def test_worker_refuses_a_bad_frontend_cpus_before_starting(tiny_deepseek_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "llmesh.cli", "worker", "--engine", "fake", "--model", str(tiny_deepseek_dir),
         "--frontend-cpus", "0-x"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "frontend_cpus: '0-x' is not a CPU id" in result.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_every_serving_thread_is_pinned(tiny_deepseek_dir: Path, tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    port = free_port()
    proc = spawn_tier("pinned", "worker",
                      ["--engine", "fake", "--model", str(tiny_deepseek_dir), "--port", str(port),
                       "--fake-token-delay-ms", "0", "--frontend-cpus", str(cpu)],
                      address=f"127.0.0.1:{port}", service=SERVICE_NAME, log_dir=tmp_path)
    try:
        proc.wait_serving(timeout=60)
        assert check_health(proc.address, SERVICE_NAME) == "SERVING"
        time.sleep(0.2)
        affinities = thread_affinities(proc.pid)
        assert len(affinities) > 1
        assert set(affinities.values()) == {frozenset({cpu})}, affinities
        assert "serving threads pinned to CPUs" in (tmp_path / "pinned.log").read_text()
    finally:
        proc.stop(timeout=10)

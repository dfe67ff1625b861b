"""The engine watchdog kills engine processes that outlive a SIGKILLed worker (no vLLM)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from services.worker.watchdog import engine_processes, start_watchdog
    # Stand-ins for the engine core and its model worker: a child with a grandchild.
    child = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time;"
        " subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    time.sleep(1.0)
    procs = engine_processes(os.getpid())
    start_watchdog(os.getpid(), procs)
    print(" ".join(str(pid) for pid, _ in procs), flush=True)
    time.sleep(60)
""")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        time.sleep(0.1)
    return alive


def test_engine_processes_die_with_a_killed_worker() -> None:
    repo = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, cwd=repo,
                              env={**os.environ, "PYTHONPATH": str(repo)}, start_new_session=True)
    try:
        assert parent.stdout is not None
        engine_pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(engine_pids) == 2
        time.sleep(0.3)
        assert wait_gone(engine_pids, 0.5) == engine_pids  # still running while the worker lives
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        assert wait_gone(engine_pids, 10) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)  # whatever is left of this test's processes

"""Engine-process watchdog: kill the engine if its worker dies without closing it.

vLLM's engine-core process has no parent-death detection: when the worker is killed
(SIGKILL, OOM killer) the engine core and its model workers keep running and keep their
memory. After the engine is built the worker starts this watchdog as a small separate
process with the engine's process ids; it polls, and once the worker is gone it kills
those processes (checked by creation time, so a reused pid is never hit). It exits by
itself once the engine processes are gone (a normal shutdown).

    python -m services.worker.watchdog --parent PID PID:CREATE_TIME ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5


def engine_processes(parent_pid: int) -> list[tuple[int, float]]:
    """(pid, create time) of every descendant of ``parent_pid`` (the engine's processes)."""
    import psutil  # a vLLM dependency; only the vLLM engine needs the watchdog

    return [(p.pid, p.create_time()) for p in psutil.Process(parent_pid).children(recursive=True)]


def start_watchdog(parent_pid: int, processes: list[tuple[int, float]]) -> subprocess.Popen[bytes] | None:
    """Start the watchdog for ``processes``; None when there is nothing to watch."""
    if not processes:
        return None
    args = [f"{pid}:{created!r}" for pid, created in processes]
    return subprocess.Popen(
        [sys.executable, "-m", "services.worker.watchdog", "--parent", str(parent_pid), *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None,
    )


def _alive(pid: int, created: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - created) < 0.01
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker.watchdog")
    parser.add_argument("--parent", type=int, required=True, help="the worker's pid")
    parser.add_argument("processes", nargs="+", help="PID:CREATE_TIME of each engine process")
    args = parser.parse_args(argv)
    watched = []
    for item in args.processes:
        pid, _, created = item.partition(":")
        watched.append((int(pid), float(created)))
    # Ctrl-C in a terminal reaches the whole process group; the worker handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        watched = [(pid, created) for pid, created in watched if _alive(pid, created)]
        if not watched:
            return 0  # the engine is gone: a normal shutdown
        if os.getppid() != args.parent:
            # The worker died and the engine outlived it: free its memory and cores.
            for pid, created in reversed(watched):  # deepest (model workers) first
                if _alive(pid, created):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            print(f"llmesh worker watchdog: worker {args.parent} died; killed engine processes "
                  f"{[pid for pid, _ in watched]}", file=sys.stderr, flush=True)
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())

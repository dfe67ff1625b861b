"""CPU and wake-ups per second of every thread of a running mesh, from the kernel's
scheduler counters: where an idle or a loaded mesh spends its CPU, wake-up by wake-up.

Usage: ``.venv/bin/python scripts/thread_wakes.py [--mesh-state mesh.json] [--seconds 20]
[PID ...]``

Without pids, the tiers of the mesh that ``llmesh up`` runs (its ``mesh.json``, or
``--mesh-state``) are read. ``/proc/<pid>/task/<tid>/schedstat`` holds, per thread, the
nanoseconds it ran and how many times it was put on a CPU: sampled at the start and at
the end of ``--seconds``, their differences are CPU milliseconds per second and wake-ups
per second. On a box whose tiers share two cores with an engine, a wake-up costs a tier
a few hundred microseconds before the work it woke for (cold caches), so the count of
wake-ups per engine step is what to bring down. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (name, ns on CPU, times put on a CPU) for every thread of ``pid``."""
    found: dict[int, tuple[str, int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ran, _waited, slices = (task / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        found[int(task.name)] = (name, int(ran), int(slices))
    return found


def _mesh_pids(state_path: str | None) -> list[tuple[str, int]]:
    if state_path is None:
        from llmesh.home import run_dir

        path = run_dir() / "mesh.json"
    else:
        path = Path(state_path)
    state = json.loads(path.read_text())
    return [(str(p["name"]), int(p["pid"])) for p in state["processes"] if p.get("pid")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("pids", nargs="*", type=int, help="processes to watch (default: the mesh's tiers)")
    parser.add_argument("--mesh-state", help="mesh.json of the running mesh (default: `llmesh up`'s)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to count")
    parser.add_argument("--min-ms", type=float, default=0.01, help="leave out threads below this CPU (ms/s)")
    args = parser.parse_args()
    targets = [(str(pid), pid) for pid in args.pids] if args.pids else _mesh_pids(args.mesh_state)
    before = {pid: _threads(pid) for _, pid in targets}
    time.sleep(args.seconds)
    after = {pid: _threads(pid) for _, pid in targets}
    total_ms = total_wakes = 0.0
    print(f"{'process':<18} {'thread':<18} {'CPU ms/s':>9} {'wakes/s':>8}")
    for label, pid in targets:
        for tid, (name, ran, slices) in sorted(after[pid].items()):
            if tid not in before[pid]:
                continue
            ms = (ran - before[pid][tid][1]) / 1e6 / args.seconds
            wakes = (slices - before[pid][tid][2]) / args.seconds
            total_ms, total_wakes = total_ms + ms, total_wakes + wakes
            if ms >= args.min_ms:
                print(f"{label:<18} {name + ('*' if tid == pid else ''):<18} {ms:9.2f} {wakes:8.1f}")
    print(f"{'all':<18} {'(* main thread)':<18} {total_ms:9.2f} {total_wakes:8.1f}")


if __name__ == "__main__":
    main()

"""Keep the worker's serving threads off the cores the engine computes on.

The engine's OpenMP threads are bound one per core and meet at a barrier every layer, so
one preempted thread stalls the whole step. A gRPC frontend that floats over every core
preempts them: ``frontend_cpus`` pins every thread of the worker's own process (gRPC,
the event loop, AsyncLLM's output handling) to other cores. It is applied after the
engine's processes have started, so they keep the binding vLLM gave them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def parse_cpu_list(text: str, field_name: str = "frontend_cpus") -> frozenset[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5}; a clear ValueError naming the field otherwise."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{field_name}: {part!r} is not a CPU id or a range like 2-3") from None
        if first < 0 or last < first:
            raise ValueError(f"{field_name}: {part!r} is not a range of CPU ids")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{field_name}: no CPU ids in {text!r}")
    return frozenset(cpus)


def check_frontend_cpus(text: str, omp_bind: str = "") -> frozenset[int]:
    """The CPU set of ``text``, which must be CPUs this process may run on."""
    cpus = parse_cpu_list(text)
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"frontend_cpus: CPUs {sorted(cpus - allowed)} are not available to this "
                         f"process (allowed: {sorted(allowed)})")
    if omp_bind and omp_bind not in ("auto", "nobind"):
        engine = set().union(*(parse_cpu_list(part, "cpu_omp_threads_bind") for part in omp_bind.split("|")))
        if cpus & engine:
            raise ValueError(f"frontend_cpus: CPUs {sorted(cpus & engine)} are also in cpu_omp_threads_bind "
                             f"{omp_bind!r}; the frontend must use other cores")
    return cpus


def pin_process(cpus: frozenset[int]) -> int:
    """Every thread of this process onto ``cpus`` (threads started later inherit it);
    returns how many threads were pinned."""
    pinned = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    log.info("serving threads pinned to CPUs %s (%d threads)", ",".join(map(str, sorted(cpus))), pinned)
    return pinned

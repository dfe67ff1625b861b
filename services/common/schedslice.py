"""A short scheduler slice for a tier's threads, so that a wake-up runs at once.

Linux's EEVDF scheduler (6.6 and later) lets the task on a CPU run to the end of its slice
(``sched_base_slice``, 1.4 ms on a 2-CPU machine) before a task it woke gets the CPU, unless
the woken task asks for a shorter slice (6.12 and later: ``sched_attr.sched_runtime`` for
SCHED_OTHER, no privilege needed). On a host whose cores an engine keeps busy (vLLM's CPU
backend runs its compute threads on every core it is given), every hop of a request's way
out — engine to worker, worker to gateway, gateway to the client — waited up to a slice
for its CPU: the first token of a one-stream request reached the client 7.8 ms later than
``vllm serve``'s at the P50 of 48 pairs, against -1.8 ms with a 0.3 ms slice on llmesh's
processes (docs/benchmarks.md, sixth session of 7 December 2026).

:func:`apply_slice` sets the slice on every thread the process has (threads started later
inherit it from the thread that starts them). Tiers call it after their warm-up, so a
child process started before (the worker's vLLM engine core) keeps the kernel's default:
the engine's compute is what should yield. Elsewhere (another OS, an architecture without
the syscall's number here, a kernel that refuses it) it logs once and changes nothing.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import struct

log = logging.getLogger(__name__)

_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "arm64": 274}
"""The syscall's number per machine (``uname -m``): x86-64's table, and the generic table
arm64 (Kunpeng) uses."""

_SCHED_OTHER = 0
_ATTR_SIZE = 48  # SCHED_ATTR_SIZE_VER0: size, policy, flags, nice, priority, runtime, deadline, period


def _setattr_syscall() -> tuple[ctypes.CDLL, int] | None:
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not os.path.isdir("/proc/self/task"):
        return None
    return ctypes.CDLL(None, use_errno=True), number


def apply_slice(slice_us: int, *, tier: str) -> int:
    """Ask for a ``slice_us`` µs slice for every thread of this process (0 changes nothing).
    Returns how many threads took it; never raises."""
    if slice_us <= 0:
        return 0
    syscall = _setattr_syscall()
    if syscall is None:
        log.info("%s: no scheduler slice on %s/%s", tier, platform.system(), platform.machine())
        return 0
    libc, number = syscall
    done = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)  # a thread's own nice stays
        except OSError:
            continue  # the thread ended
        attr = ctypes.create_string_buffer(
            struct.pack("IIQiIQQQ", _ATTR_SIZE, _SCHED_OTHER, 0, nice, 0, slice_us * 1000, 0, 0), _ATTR_SIZE)
        if libc.syscall(number, tid, attr, 0) != 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:  # the thread ended
                continue
            log.warning("%s: the kernel refused a %d µs scheduler slice (%s); keeping its default",
                        tier, slice_us, os.strerror(err))
            return done
        done += 1
    log.info("%s: %d µs scheduler slice on %d threads", tier, slice_us, done)
    return done


def thread_slice_ns(tid: int) -> int | None:
    """A thread's slice in ns as /proc reports it (``se.slice``), None where it does not."""
    try:
        with open(f"/proc/{tid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1])
    except (OSError, ValueError):
        return None
    return None

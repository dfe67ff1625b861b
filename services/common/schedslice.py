"""A short scheduler slice and a higher priority for a tier's threads, so that a wake-up
runs at once.

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

A short slice decides who runs first at a wake-up, not who keeps the CPU after it: a tier
that used its 0.3 ms slice, or an engine compute thread woken for the next step while the
tier ran, still put a tier's reply behind a whole engine step (the kernel's scheduler
trace of one-stream requests showed the gateway preempted with its reply half-written,
and 2 ms of each first token's way spent runnable but off the CPU, each way). A nice value
below 0 (``latency_nice``, -10 by default) gives the tiers' threads the larger weight
too, so the little CPU they want comes first: the first token's lead over ``vllm serve``
went from +3.88 ms to -1.18 ms at the P50 of 40 pairs each, in blocks alternating nice 0
and -10 on the same servers (docs/benchmarks.md, eighth session). It needs CAP_SYS_NICE;
without it (the Kubernetes base drops every capability) the tiers log it and keep the
slice.
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


def apply_slice(slice_us: int, *, tier: str, nice: int = 0) -> int:
    """Ask for a ``slice_us`` µs slice (0: the kernel's) and, with ``nice`` below 0, that
    nice value for every thread of this process. Returns how many threads took what was
    asked; never raises.

    A negative nice needs CAP_SYS_NICE (or an RLIMIT_NICE allowing it): without it the
    kernel refuses, which is logged once, and every thread keeps its own nice with the
    slice still asked for. Threads keep a nice lower than the one asked (an operator's)."""
    if slice_us <= 0 and nice >= 0:
        return 0
    syscall = _setattr_syscall()
    if syscall is None:
        log.info("%s: no scheduler slice or nice on %s/%s", tier, platform.system(), platform.machine())
        return 0
    libc, number = syscall
    done = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            own = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:
            continue  # the thread ended
        err = _setattr(libc, number, tid, slice_us, min(own, nice) if nice < 0 else own)
        if err in (errno.EPERM, errno.EACCES) and nice < 0 and own > nice:
            log.info("%s: nice %d refused (no CAP_SYS_NICE); threads keep nice %d, latency_nice 0 "
                     "stops asking", tier, nice, own)
            nice = 0
            err = _setattr(libc, number, tid, slice_us, own)
        if err == errno.ESRCH:  # the thread ended
            continue
        if err:
            log.warning("%s: the kernel refused a %d µs scheduler slice (%s); keeping its default",
                        tier, slice_us, os.strerror(err))
            return done
        done += 1
    log.info("%s: scheduler slice %s µs (0: the kernel's), nice %s on %d threads", tier, slice_us,
             nice if nice < 0 else "unchanged", done)
    return done


def _setattr(libc: ctypes.CDLL, number: int, tid: int, slice_us: int, nice: int) -> int:
    """sched_setattr(SCHED_OTHER, nice, slice) for one thread; the errno, 0 when done.
    A slice of 0 is the kernel's default."""
    attr = ctypes.create_string_buffer(
        struct.pack("IIQiIQQQ", _ATTR_SIZE, _SCHED_OTHER, 0, nice, 0, max(slice_us, 0) * 1000, 0, 0),
        _ATTR_SIZE)
    if libc.syscall(number, tid, attr, 0) != 0:
        return ctypes.get_errno()
    return 0


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

"""services/common/schedslice.py: a tier's threads ask Linux for a short scheduler slice
and a lower nice value, and a process started before (the worker's engine core) keeps the
kernel's slice and its own nice.

Each check runs in a child interpreter, so the test process's own scheduling is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.common.schedslice import apply_slice, thread_slice_ns

ROOT = Path(__file__).resolve().parents[2]

needs_eevdf = pytest.mark.skipif(thread_slice_ns(os.getpid()) is None,
                                 reason="this kernel reports no se.slice (no EEVDF custom slices)")


def _run(code: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


@needs_eevdf
def test_every_thread_and_those_started_later_take_the_slice_a_child_started_before_does_not():
    before, done, main, other, later, child = _run("""
        import subprocess, sys, threading, time
        from services.common.schedslice import apply_slice, thread_slice_ns

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        time.sleep(0.2)
        before = thread_slice_ns(threading.get_native_id())
        release, tids = threading.Event(), []
        waiter = threading.Thread(target=lambda: (tids.append(threading.get_native_id()), release.wait()))
        waiter.start()
        while not tids:
            time.sleep(0.01)
        done = apply_slice(300, tier="test")
        later = []
        starter = threading.Thread(target=lambda: later.append(thread_slice_ns(threading.get_native_id())))
        starter.start()
        starter.join()
        print(before, done, thread_slice_ns(threading.get_native_id()), thread_slice_ns(tids[0]), later[0],
              thread_slice_ns(child.pid))
        release.set()
        child.kill()
    """)
    assert before != 300_000
    assert done >= 2
    assert main == other == later == 300_000
    assert child == before  # started before: the kernel's slice


@needs_eevdf
def test_zero_leaves_the_kernels_slice():
    before, done, after = _run("""
        import threading
        from services.common.schedslice import apply_slice, thread_slice_ns
        before = thread_slice_ns(threading.get_native_id())
        print(before, apply_slice(0, tier="test"), thread_slice_ns(threading.get_native_id()))
    """)
    assert done == 0 and after == before


def test_a_machine_without_the_syscall_changes_nothing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("platform.machine", lambda: "sparc64")
    assert apply_slice(300, tier="test") == 0


needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="lowering a nice value needs CAP_SYS_NICE (root here)")


@needs_root
@needs_eevdf
def test_every_thread_and_those_started_later_take_the_nice_a_child_started_before_does_not():
    main, other, later, child, slice_ns = _run("""
        import os, subprocess, sys, threading, time
        from services.common.schedslice import apply_slice, thread_slice_ns

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        time.sleep(0.2)
        release, tids = threading.Event(), []
        waiter = threading.Thread(target=lambda: (tids.append(threading.get_native_id()), release.wait()))
        waiter.start()
        while not tids:
            time.sleep(0.01)
        apply_slice(300, tier="test", nice=-10)
        later = []
        starter = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0)))
        starter.start()
        starter.join()
        me = threading.get_native_id()
        print(os.getpriority(os.PRIO_PROCESS, me), os.getpriority(os.PRIO_PROCESS, tids[0]), later[0],
              os.getpriority(os.PRIO_PROCESS, child.pid), thread_slice_ns(me))
        release.set()
        child.kill()
    """)
    assert main == other == later == -10
    assert child == 0  # started before: its own nice
    assert slice_ns == 300_000  # the slice with it


@needs_root
def test_a_lower_nice_an_operator_gave_is_kept():
    (nice,) = _run("""
        import os
        from services.common.schedslice import apply_slice
        os.setpriority(os.PRIO_PROCESS, 0, -15)
        apply_slice(300, tier="test", nice=-10)
        print(os.getpriority(os.PRIO_PROCESS, 0))
    """)
    assert nice == -15


@needs_root
@needs_eevdf
def test_without_cap_sys_nice_the_nice_is_refused_and_the_slice_still_taken():
    """A process without the privilege (here: root dropping to nobody, whose RLIMIT_NICE
    allows no raise) keeps its nice and still takes the slice, every thread counted."""
    nice, done, threads, slice_ns = _run("""
        import os, threading
        from services.common.schedslice import apply_slice, thread_slice_ns
        os.setgid(65534)
        os.setuid(65534)
        release = threading.Event()
        threading.Thread(target=release.wait).start()
        done = apply_slice(300, tier="test", nice=-10)
        print(os.getpriority(os.PRIO_PROCESS, 0), done, len(os.listdir("/proc/self/task")),
              thread_slice_ns(threading.get_native_id()))
        release.set()
    """)
    assert nice == 0
    assert done == threads >= 2
    assert slice_ns == 300_000


def test_nothing_asked_changes_nothing():
    assert apply_slice(0, tier="test", nice=0) == 0

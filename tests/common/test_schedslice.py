"""services/common/schedslice.py: a tier's threads ask Linux for a short scheduler slice,
and a process started before (the worker's engine core) keeps the kernel's.

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

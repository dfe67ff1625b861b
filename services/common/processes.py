"""Several processes per CPU tier on one port: a supervisor that forks them.

A Python process runs one event loop on one core; a CPU tier (gateway, tokenizer,
postprocessor) on a many-core host uses more of them by running ``--processes N``
copies of itself on the same port. This follows gRPC's guidance for Python servers
(grpc examples/python/multiprocessing): one server per process, the processes sharing the
port through SO_REUSEPORT (the kernel spreads incoming connections across them), and the
fork done before any grpc object (server, channel, event loop, thread) exists, since
gRPC's core does not survive a fork it was running across.

The parent is a supervisor only: it picks the ports (a port 0 is chosen once, here, so
every child binds the same one), forks, forwards SIGTERM/SIGINT to the children, and
exits when they have all stopped. It restarts nothing: a child that dies leaves the
others serving (connections it held fail UNAVAILABLE and reconnect to a survivor), the
supervisor logs it, and restarts belong to Kubernetes or ``llmesh up``.

Per process:

- health: every process serves grpc.health.v1 on the shared port; a probe reaches one of
  them (whichever the kernel picks), so a pod is healthy while any process is;
- metrics: each process serves its own ``/metrics`` on ``metrics_port + index``
  (``metrics_port`` 0: each picks a free port, logged); ``llmesh_process_info{tier,
  index, pid}`` says which process a scrape came from (``llmesh status`` reads it);
- logs: the children share the parent's stderr; every JSON line carries ``pid`` and
  ``process`` (the index), the supervisor's ``process: "supervisor"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TypeVar

from prometheus_client import Gauge

from services.common.settings import ServerSettings

log = logging.getLogger(__name__)

S = TypeVar("S", bound=ServerSettings)

CPU_TIERS = ("gateway", "tokenizer", "postprocessor")
"""Tiers that may run several processes. The router keeps one (its admission queue and
breakers are per process state), the worker one per engine."""

PROCESS_INFO = Gauge(
    "llmesh_process_info",
    "1 for this process; which process of a tier (index of --processes) a scrape came from.",
    ["tier", "index", "pid"],
)

_PR_SET_PDEATHSIG = 1


class _ProcessFields(logging.Filter):
    """Adds ``pid`` and ``process`` (index, or "supervisor") to every JSON log line."""

    def __init__(self, process: int | str) -> None:
        super().__init__()
        self.process = process

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "fields", None)
        merged = dict(fields) if isinstance(fields, dict) else {}
        merged.setdefault("pid", record.process)
        merged.setdefault("process", self.process)
        record.fields = merged
        return True


def _tag_logs(process: int | str) -> None:
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, _ProcessFields)]:
            handler.removeFilter(old)
        handler.addFilter(_ProcessFields(process))


def reserve_port(host: str, port: int) -> tuple[int, socket.socket | None]:
    """The port every child binds. A fixed port is returned as is; 0 is resolved here,
    once: a socket bound with SO_REUSEPORT (never listening, so it takes no connections)
    holds the port until the supervisor exits, and the children join it."""
    if port != 0:
        return port, None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), 0))
    return int(sock.getsockname()[1]), sock


def _die_with_parent(parent: int) -> None:
    """Linux: a child gets SIGKILL if the supervisor dies (even by SIGKILL), so no orphan
    keeps the port. Best effort elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def run_processes(
    settings: S,
    *,
    tier: str,
    serve: Callable[[S], int],
    ports: Sequence[str] = ("port",),
) -> int:
    """Run ``serve(settings)`` in ``settings.processes`` processes and return the exit code.

    One process: ``serve`` runs here, as before. Several: the ports named by ``ports``
    (settings fields; -1 means off) are resolved once, then each child gets a copy of the
    settings with those ports and its own ``metrics_port`` (base + index). Call it before
    any grpc object or event loop exists; ``serve`` creates them in the child.
    """
    count = settings.processes
    if count <= 1:
        PROCESS_INFO.labels(tier, "0", str(os.getpid())).set(1)
        return serve(settings)
    if tier not in CPU_TIERS:
        raise ValueError(f"{tier}: processes must be 1 (several processes serve only "
                         f"{', '.join(CPU_TIERS)})")
    update: dict[str, int] = {}
    held: list[socket.socket] = []
    for name in ports:
        wanted = int(getattr(settings, name))
        if wanted < 0:
            continue
        update[name], sock = reserve_port(settings.host, wanted)
        if sock is not None:
            held.append(sock)
    shared = settings.model_copy(update=update)
    _tag_logs("supervisor")
    parent = os.getpid()
    children: dict[int, int] = {}
    stopping = False

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    # Installed before forking (a signal between two forks must not kill the supervisor
    # with its children running); each child puts the defaults back.
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(count):
            mine = shared
            if settings.metrics_port > 0:
                mine = shared.model_copy(update={"metrics_port": settings.metrics_port + index})
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                _child(mine, index, tier=tier, parent=parent, held=held, serve=serve)
            children[pid] = index
            log.info("%s process %d/%d started, pid %d", tier, index, count, pid,
                     extra={"fields": {"child_pid": pid, "index": index}})
            if stopping:
                forward(signal.SIGTERM, None)
        log.info("%s: %d processes sharing %s", tier, count,
                 ", ".join(f"{name} {getattr(shared, name)}" for name in update) or "no port")
        worst = 0
        while children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            index = children.pop(pid, -1)
            code = _exit_code(status)
            if stopping and code == 128 + signal.SIGTERM:
                code = 0  # stopped by the SIGTERM we forwarded before it had installed its handler
            if code and not worst:
                worst = code
            fields = {"child_pid": pid, "index": index, "exit_code": code}
            if stopping:
                log.info("%s process %d (pid %d) stopped, exit code %d", tier, index, pid, code,
                         extra={"fields": fields})
            else:
                # Not restarted here: the others keep serving; Kubernetes or `llmesh up`
                # restart the tier (the supervisor exits once every process has).
                log.error("%s process %d (pid %d) exited unexpectedly (exit code %d); %d of %d "
                          "processes still serving; not restarted", tier, index, pid, code,
                          len(children), count, extra={"fields": fields})
        return worst
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sock in held:
            sock.close()


def _child(settings: S, index: int, *, tier: str, parent: int, held: Sequence[socket.socket],
           serve: Callable[[S], int]) -> None:
    code = 1
    try:
        # Its own process group: a terminal's Ctrl-C reaches only the supervisor, which
        # forwards one SIGTERM (two signals could land after the server removed its
        # handlers and kill it mid-drain). _die_with_parent covers a killed supervisor.
        os.setpgid(0, 0)
        _die_with_parent(parent)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sock in held:
            sock.close()
        _tag_logs(index)
        PROCESS_INFO.labels(tier, str(index), str(os.getpid())).set(1)
        code = serve(settings)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)

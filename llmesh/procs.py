"""Start tier processes and wait for them to report SERVING (used by ``llmesh up`` and tests)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_LOWEST_PORT = 10_000
_handed_out: set[int] = set()
"""Ports this process already handed out: never twice."""


def _ephemeral_start() -> int:
    """Where the kernel's ephemeral range (the local ports of outgoing connections) starts."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind-then-close), below the kernel's ephemeral
    range: a port the kernel picked for us (bind to 0) comes from that range, where any
    outgoing connection made before our server binds it may take it as its local port."""
    top = _ephemeral_start()
    attempts = 200 if top - _LOWEST_PORT > 1_000 else 0  # else too few ports below it
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randrange(_LOWEST_PORT, top)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_health(
    address: str, service: str = "", timeout: float = 1.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> str:
    """One health Check: SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNREACHABLE."""
    channel = (
        grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    )
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.RpcError as err:
        if err.code() is grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        return "UNREACHABLE"
    finally:
        channel.close()


@dataclass
class TierProcess:
    """One child process of the mesh."""

    name: str
    tier: str
    address: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    service: str = ""
    zone: str = ""
    metrics_port: int = -1
    log_path: Path | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_serving(
        self, timeout: float = 300.0, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        """Block until readiness health is SERVING; raise if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.popen.returncode}"
                    + (f"; log: {self.log_path}" if self.log_path else "")
                    + _tail(self.log_path)
                )
            if check_health(self.address, self.service, credentials=credentials) == "SERVING":
                return
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not SERVING at {self.address} after {timeout:.0f}s"
                           + _tail(self.log_path))

    def terminate(self) -> None:
        """Send SIGTERM without waiting."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the process and everything it started (its own session), e.g. vLLM's
        engine-core processes, which would otherwise outlive it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()
        self.popen.wait(10)


def _tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n--- log tail ---\n" + "\n".join(text)


def spawn_tier(
    name: str,
    tier: str,
    args: Sequence[str],
    *,
    address: str,
    service: str = "",
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    zone: str = "",
    metrics_port: int = -1,
    netns: str = "",
) -> TierProcess:
    """Start ``llmesh <tier> <args>`` as a child process.

    ``service`` is the full gRPC service name used for the readiness check. With
    ``netns``, the process runs inside that network namespace (``ip netns exec``).
    """
    argv = [sys.executable, "-m", "llmesh.cli", tier, *args]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("OTEL_SERVICE_NAME", f"llmesh-{tier}")
    log_path = None
    stdout: int | IO[bytes] = subprocess.DEVNULL
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        stdout = log_path.open("ab")
    popen = subprocess.Popen(
        argv, env=full_env, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
    )
    return TierProcess(
        name=name, tier=tier, address=address, argv=argv, popen=popen, service=service,
        zone=zone, metrics_port=metrics_port, log_path=log_path,
    )

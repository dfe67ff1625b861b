"""What an idle tier wakes up for: gRPC keepalive and the metrics listener.

An idle mesh's CPU is wakeups: every gRPC keepalive ping wakes the event-engine threads
on both ends, and prometheus_client's listener polled twice a second. Covered: a channel
pings only while a call is open, and that ping still ends a call whose peer stopped
answering (a SIGSTOPped server) within keepalive's bound; the metrics listener serves a
scrape and otherwise sleeps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from services.common.channels import KEEPALIVE_OPTIONS, create_channel
from services.common.metrics import start_metrics_server

# A health server in a process of its own, so that it can be stopped (SIGSTOP) with
# its TCP connections left open, as a frozen or partitioned host leaves them.
_SERVER = """
import asyncio, sys
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from services.common.channels import SERVER_KEEPALIVE_OPTIONS

async def main():
    server = grpc.aio.server(options=list(SERVER_KEEPALIVE_OPTIONS))
    servicer = health.aio.HealthServicer()
    await servicer.set("probe", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


@pytest.fixture
def health_server() -> Iterator[tuple[int, subprocess.Popen[str]]]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield port, proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def test_channels_ping_only_under_an_open_call() -> None:
    options = dict(KEEPALIVE_OPTIONS)
    assert options["grpc.keepalive_permit_without_calls"] == 0
    # The bound the README gives for a frozen peer under an open call: ping + timeout.
    assert options["grpc.keepalive_time_ms"] + options["grpc.keepalive_timeout_ms"] <= 4000
    assert options["grpc.http2.ping_timeout_ms"] <= options["grpc.keepalive_timeout_ms"]


async def test_keepalive_ends_a_watch_whose_server_froze(
    health_server: tuple[int, subprocess.Popen[str]],
) -> None:
    port, proc = health_server
    channel = create_channel(f"127.0.0.1:{port}", interceptors=[])
    try:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="probe"))
        first = await asyncio.wait_for(call.read(), timeout=10)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        # Nothing else would end this call: the server holds the stream open and its
        # kernel still acknowledges TCP; only the unanswered ping does.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), timeout=15)
        took = time.monotonic() - stopped
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Not a speed assertion: the keepalive bound (2 s + 2 s) with room for a slow box,
        # well short of the 15 s the read was given.
        assert took < 10.0, f"the frozen server's Watch ended only after {took:.1f} s"
    finally:
        await channel.close()


def _switches(native_id: int) -> int:
    """Times the thread has been scheduled onto a CPU (its wakeups, near enough)."""
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[2])


def test_the_metrics_listener_serves_and_otherwise_sleeps() -> None:
    registry = CollectorRegistry()
    Counter("llmesh_probe", "a counter only this test registers", registry=registry).inc(3)
    before = {t.ident for t in threading.enumerate()}
    port = start_metrics_server(0, "127.0.0.1", registry=registry)
    assert port > 0
    [listener] = [t for t in threading.enumerate() if t.ident not in before]
    assert listener.daemon and listener.native_id is not None
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "llmesh_probe_total 3.0" in body
    time.sleep(0.2)  # the scrape's own wakeups settle
    woken = _switches(listener.native_id)
    time.sleep(1.6)  # prometheus_client's listener would have polled three times
    assert _switches(listener.native_id) - woken == 0, "the idle metrics listener woke up"
    # Still serving after the quiet spell.
    again = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "llmesh_probe_total 3.0" in again


def test_metrics_port_minus_one_serves_nothing() -> None:
    assert start_metrics_server(-1) == -1

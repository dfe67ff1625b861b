"""What an idle tier wakes up for: gRPC keepalive and the metrics listener.

An idle mesh's CPU is wakeups: every gRPC keepalive ping wakes the event-engine threads
on both ends, and prometheus_client's listener polled twice a second. Covered: a channel
pings only while a call is open, and that ping still ends a call whose peer stopped
answering (a SIGSTOPped server) within keepalive's bound; the calls held open for as long
as the mesh runs (health Watches) ping rarely, and still end; the metrics listener serves
a scrape and otherwise sleeps.
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
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from gateway.core import GatewayConfig
from services.common import channels
from services.common.channels import IDLE_TIMEOUT_MS, KEEPALIVE_OPTIONS, create_channel
from services.common.metrics import start_metrics_server
from services.common.readiness import READINESS_KEEPALIVE_MS, UNREACHABLE, UpstreamHealth
from services.router.workerclient import CONTROL_KEEPALIVE_MS, GrpcWorkerClient

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


def _channel_options(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The options of every insecure channel created from here on."""
    made: list[dict[str, object]] = []
    real = grpc.aio.insecure_channel

    def spy(target: str, options: list[tuple[str, object]], **kwargs: object) -> grpc.aio.Channel:
        made.append(dict(options))
        return real(target, options=options, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(channels.grpc.aio, "insecure_channel", spy)
    return made


async def test_held_open_watches_ping_rarely(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _channel_options(monkeypatch)
    await create_channel("127.0.0.1:1", keepalive_time_ms=7000).close()
    assert made[-1]["grpc.keepalive_time_ms"] == 7000
    # The timeout and the no-call rule stay: only the spacing changes.
    assert made[-1]["grpc.http2.ping_timeout_ms"] == dict(KEEPALIVE_OPTIONS)["grpc.http2.ping_timeout_ms"]
    assert made[-1]["grpc.keepalive_permit_without_calls"] == 0
    # A worker's control channel (its health Watch): the load reports notice a silent
    # worker first. Its generation channel keeps the default.
    client = GrpcWorkerClient("127.0.0.1:1")
    await client.close()
    assert [m["grpc.keepalive_time_ms"] for m in made[-2:]] == [
        dict(KEEPALIVE_OPTIONS)["grpc.keepalive_time_ms"], CONTROL_KEEPALIVE_MS,
    ]
    # The gateway's readiness Watch of each router: beats a 5 s probe acting after two misses.
    upstream = UpstreamHealth(["127.0.0.1:1"], "probe")
    await upstream.close()
    assert made[-1]["grpc.keepalive_time_ms"] == READINESS_KEEPALIVE_MS
    assert READINESS_KEEPALIVE_MS + 2000 <= 12_000 < CONTROL_KEEPALIVE_MS


async def test_a_readiness_watch_marks_a_frozen_replica_unreachable(
    health_server: tuple[int, subprocess.Popen[str]],
) -> None:
    """The rarer ping still ends a Watch whose server froze (1 s here, to keep it short)."""
    port, proc = health_server
    target = f"127.0.0.1:{port}"
    changed = asyncio.Event()
    upstream = UpstreamHealth([target], "probe", keepalive_time_ms=1000, on_change=changed.set)
    upstream.start()

    async def becomes(status: str, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while upstream.status[target] != status:
                await changed.wait()
                changed.clear()

    try:
        await becomes("SERVING", 10)
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        await becomes(UNREACHABLE, 15)
        took = time.monotonic() - stopped
        assert upstream.status[target] == UNREACHABLE
        # 1 s ping + 2 s timeout, with room for a slow box: not a speed assertion.
        assert took < 10.0, f"the frozen replica showed only after {took:.1f} s"
    finally:
        await upstream.close()


async def test_a_channel_without_calls_lets_its_connection_go() -> None:
    """A connected transport's keepalive timer fires with or without a call: a channel
    used once lets its connection go, and connects again at its next call."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("probe", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = create_channel(f"127.0.0.1:{port}", interceptors=[], idle_timeout_ms=1000)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(service="probe"), timeout=10)
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        async with asyncio.timeout(10):
            state = channel.get_state()
            while state != grpc.ChannelConnectivity.IDLE:
                await channel.wait_for_state_change(state)
                state = channel.get_state()
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="probe"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await channel.close()
        await server.stop(None)
    # The default outlasts the gateway's model-list refresh: a serving gateway does not
    # reconnect to a tokenizer on a request's path.
    assert GatewayConfig().models_refresh_s * 1000 < IDLE_TIMEOUT_MS


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

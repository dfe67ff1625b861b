"""Two gateway processes on one port (``gateway.processes: 2``, SO_REUSEPORT).

Both serve (their pids in the per-request log lines), ``llmesh status`` lists both, and a
``kill -9`` of one leaves the other serving with no failed request for clients that retry
on UNAVAILABLE (a gRPC retry policy in the channel's service config).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.meshconfig import MeshConfig, RouterConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.status import collect
from llmesh.up import Mesh
from tests.gateway.conftest import gateway_address, running_mesh
from tests.gateway.helpers import request, stub

# The client's retry policy: UNAVAILABLE (a connection to a process that died) is retried,
# and the retry's new connection lands on a process still listening.
RETRY_ON_UNAVAILABLE = json.dumps({"methodConfig": [{
    "name": [{"service": "llmesh.v1.InferenceService"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
}]})


@pytest.fixture(scope="module")
def two_gateways(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": free_port(), "processes": 2,
                 "settings": {"drain_seconds": 0}},
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 2})],
    )
    with running_mesh(config, tmp_path_factory.mktemp("two-gateways")) as mesh:
        yield mesh


def _status(mesh: Mesh, tmp_path: Path) -> dict[str, object]:
    state = tmp_path / "mesh.json"
    state.write_text(json.dumps(mesh.state()))
    gateway = next(p for p in collect(state)["processes"] if p["tier"] == "gateway")  # type: ignore[attr-defined]
    return gateway  # type: ignore[no-any-return]


def _served_by_pids(mesh: Mesh) -> list[int]:
    """pids of the per-request log lines of the gateway's processes, in order."""
    log = next(p.log_path for p in mesh.procs if p.tier == "gateway")
    assert log is not None
    lines = (json.loads(x) for x in log.read_text().splitlines() if x.startswith("{"))
    return [int(x["pid"]) for x in lines if str(x["msg"]).startswith("request ") and "pid" in x]


def _ready_pids(mesh: Mesh) -> set[int]:
    """pids of the gateway's processes that logged their readiness as SERVING."""
    log = next(p.log_path for p in mesh.procs if p.tier == "gateway")
    assert log is not None
    lines = (json.loads(x) for x in log.read_text().splitlines() if x.startswith("{"))
    return {int(x["pid"]) for x in lines
            if x.get("msg") == "readiness of llmesh.v1.InferenceService: SERVING" and "pid" in x}


async def _until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _channel(mesh: Mesh) -> grpc.aio.Channel:
    # A local subchannel pool: each channel its own connection, so the kernel picks a
    # process per channel (channels to one target otherwise share one connection).
    return grpc.aio.insecure_channel(gateway_address(mesh), options=[
        ("grpc.service_config", RETRY_ON_UNAVAILABLE), ("grpc.enable_retries", 1),
        ("grpc.use_local_subchannel_pool", 1),
    ])


def _generate() -> object:
    return request(prompt="hello", sampling={"max_tokens": 12, "temperature": 0, "ignore_eos": True})


async def test_two_processes_serve_status_lists_both_and_a_kill_9_fails_no_retried_request(
    two_gateways: Mesh, tmp_path: Path
) -> None:
    mesh = two_gateways
    # `llmesh up` returns once the shared port answers SERVING, which one process may do
    # before the other is ready (80 ms apart in a CI run where the status check below then
    # reached the other): wait until each process has logged its readiness.
    await _until(lambda: len(_ready_pids(mesh)) == 2, "both gateway processes ready", timeout=30.0)
    gateway = _status(mesh, tmp_path)
    members = gateway["processes"]
    assert isinstance(members, list) and len(members) == 2
    pids = {int(m["pid"]) for m in members}
    assert all(m["alive"] for m in members) and len(pids) == 2 and gateway["pid"] not in pids
    assert gateway["health"] == "SERVING"

    # Both serve: new connections until the per-request log lines name both pids.
    channels: list[grpc.aio.Channel] = []
    try:
        for _ in range(64):
            channel = _channel(mesh)
            channels.append(channel)
            reply = await stub(channel).Generate(_generate(), timeout=30)
            assert reply.usage.completion_tokens == 12
            if set(_served_by_pids(mesh)) == pids:
                break
        assert set(_served_by_pids(mesh)) == pids, "both processes served requests"

        # Load on every connection, then kill -9 one process in the middle of it.
        ok = [0] * len(channels)
        errors: list[str] = []
        stop = asyncio.Event()

        async def client(i: int, channel: grpc.aio.Channel) -> None:
            while not stop.is_set():
                try:
                    await stub(channel).Generate(_generate(), timeout=30)
                    ok[i] += 1
                except grpc.aio.AioRpcError as err:
                    errors.append(f"{err.code().name}: {err.details()}")

        tasks = [asyncio.ensure_future(client(i, c)) for i, c in enumerate(channels)]
        await _until(lambda: min(ok) >= 2 or bool(errors), "load on every connection")
        victim = int(members[0]["pid"])
        survivor = (pids - {victim}).pop()
        os.kill(victim, signal.SIGKILL)
        at_kill = list(ok)
        await _until(lambda: all(n >= k + 3 for n, k in zip(ok, at_kill, strict=True)) or bool(errors),
                     "every client to succeed again after the kill")
        stop.set()
        await asyncio.gather(*tasks)
        assert errors == [], errors

        after = _status(mesh, tmp_path)
        assert after["alive"], "the supervisor keeps running with one process lost"
        by_index = {int(m["index"]): m for m in after["processes"]}  # type: ignore[union-attr]
        assert not by_index[0]["alive"] and by_index[1]["pid"] == survivor and by_index[1]["alive"]
        assert after["health"] == "SERVING"
        assert _served_by_pids(mesh)[-1] == survivor
    finally:
        for channel in channels:
            await channel.close()

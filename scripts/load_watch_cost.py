"""CPU per load report of the router's worker watch: over the worker's framed listener
against the gRPC ``WatchLoad`` stream.

Usage: ``.venv/bin/python scripts/load_watch_cost.py [--model DIR] [--interval-ms 10]
[--seconds 15] [--rounds 2]``

Starts one fake-engine worker (``llmesh worker --engine fake``, no canaries), then watches
its load with the router's own client (``services/router/workerclient.py``) under uvloop,
as the router does, one transport after the other for ``--rounds`` rounds. Reported per
report received: the worker process's CPU (psutil, as ``llmesh bench`` reads it) and this
process's CPU over the same window. Both include what each process spends anyway while idle, so the difference
between the transports is the figure to read, not the absolute values. First, the floor:
what a bare uvloop timer wake-up plus a 64-byte socket write costs this process, with no
llmesh code (on a VM it is a large part of each report). Every report
comes every ``load_interval_ms`` on an idle mesh too (150 ms by default), so the saving
per report times that rate is what an idle router and worker save per second. Not a test:
it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.router.workerclient import GrpcWorkerClient


def _process_cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def _watch(address: str, pid: int, framed: bool, interval_s: float,
                 seconds: float) -> dict[str, object]:
    client = GrpcWorkerClient(address)
    opener = client._opener()
    if not framed:
        opener._no_listener()  # as for a worker without the listener: gRPC
    received = 0

    async def follow() -> None:
        nonlocal received
        async for _ in client.watch_load(interval_s):
            received += 1

    task = asyncio.ensure_future(follow())
    await asyncio.sleep(2.0)  # connected and steady
    n0, worker0, own0 = received, _process_cpu_s(pid), time.process_time()
    await asyncio.sleep(seconds)
    n1, worker1, own1 = received, _process_cpu_s(pid), time.process_time()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await client.close()
    reports = max(1, n1 - n0)
    return {
        "transport": "framed" if opener.framed_calls else "grpc",
        "reports": n1 - n0,
        "worker_us_per_report": round((worker1 - worker0) * 1e6 / reports, 1),
        "router_us_per_report": round((own1 - own0) * 1e6 / reports, 1),
    }


async def _floor(interval_s: float, seconds: float) -> dict[str, object]:
    """What one timer wake-up and one small socket write cost this process with no
    llmesh code at all: the floor under every periodic report on this machine."""
    ours, theirs = socket.socketpair()
    _, writer = await asyncio.open_connection(sock=ours)
    theirs.setblocking(False)
    n, start, cpu0 = 0, time.monotonic(), time.process_time()
    while time.monotonic() - start < seconds:
        writer.write(b"x" * 64)
        await asyncio.sleep(interval_s)
        with contextlib.suppress(BlockingIOError):
            theirs.recv(65536)
        n += 1
    cpu1 = time.process_time()
    writer.close()
    theirs.close()
    return {"transport": "none (timer wake-up and a 64-byte write)", "iterations": n,
            "us_per_iteration": round((cpu1 - cpu0) * 1e6 / max(1, n), 1)}


def _start_worker(model: str) -> tuple[subprocess.Popen[str], str]:
    llmesh = Path(sys.executable).parent / "llmesh"
    popen = subprocess.Popen(
        [str(llmesh), "worker", "--engine", "fake", "--model", model, "--port", "0",
         "--canary-interval-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert popen.stdout is not None
    address = ""
    for line in popen.stdout:
        found = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
        if found:
            address = found.group(1)
        if "worker ready" in line:
            break
    if not address:
        popen.kill()
        raise SystemExit("load_watch_cost: the worker did not start")
    return popen, address


async def _main(args: argparse.Namespace) -> list[dict[str, object]]:
    popen, address = _start_worker(args.model)
    loop = asyncio.get_running_loop()
    assert popen.stdout is not None
    drain = loop.run_in_executor(None, popen.stdout.read)  # a full pipe would block the worker
    try:
        await asyncio.sleep(1.0)
        results = [await _floor(args.interval_ms / 1000.0, min(args.seconds, 5.0))]
        for _ in range(args.rounds):
            for framed in (False, True):
                results.append(await _watch(
                    address, popen.pid, framed, args.interval_ms / 1000.0, args.seconds))
        return results
    finally:
        popen.terminate()
        popen.wait(10)
        await drain


def main() -> None:
    from llmesh.models import ensure_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory (default: the default model)")
    parser.add_argument("--interval-ms", type=int, default=10, help="report interval the watch asks for")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds per transport and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of gRPC then framed")
    args = parser.parse_args()
    if not args.model:
        args.model = str(ensure_model())
    import uvloop

    uvloop.install()
    print(json.dumps(asyncio.run(_main(args)), indent=1))


if __name__ == "__main__":
    main()

"""Benchmark: CPU of a fake-engine worker per output token, driven over one Session.

    python -m services.worker.bench_session --streams 128 --tokens 256 --step-ms 2 --rounds 3

Starts ``llmesh worker --engine fake`` as a subprocess (``--fake-max-running`` = streams,
so every request runs at once), opens one ``Session`` and submits ``--streams`` requests of
``--tokens`` tokens each (``ignore_eos``) in one message, then reads frames until every
request ended. The worker's user + system CPU (all its threads) is read before and after
each round; a round's figure is that CPU divided by the tokens received. The fake's own
work (hashing the next token) is part of it, as in a capacity run. One warm-up round of
16 x 32 tokens comes first. Prints one JSON line per round, then a summary. This is a
benchmark, not a test: on a shared machine repeat it and report the spread.

To compare with an older tree, run this file with that tree on ``PYTHONPATH``, from a
directory outside every checkout (``cd /tmp && PYTHONPATH=<old checkout> python
<this checkout>/services/worker/bench_session.py``): the driver is then the same and only
the worker differs. The worker is started with ``python -m``, which puts the current
directory first on its path: started inside a checkout it runs that checkout's worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


async def one_round(stub: Any, streams: int, tokens: int, tag: str) -> tuple[int, int]:
    """Every request of one round over one Session; (tokens received, frames)."""
    from llmesh.common.v1 import common_pb2
    from llmesh.worker.v1 import worker_pb2

    submits = [
        worker_pb2.SessionSubmit(handle=h, request=common_pb2.TokenRequest(
            request_id=f"{tag}-{h}", prompt_token_ids=[100 + h % 50, 200, 300 + h],
            sampling=common_pb2.EngineSampling(max_tokens=tokens, ignore_eos=True)))
        for h in range(1, streams + 1)
    ]
    received = frames = ended = 0
    async for frame in stub.Session(iter([worker_pb2.SessionRequest(submit=submits)]), timeout=600):
        frames += 1
        received += len(frame.token_ids)
        ended += len(frame.finals) + len(frame.errors)
    if ended != streams:
        raise RuntimeError(f"{ended} of {streams} requests ended")
    return received, frames


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import grpc

    from llmesh.procs import free_port, spawn_tier
    from llmesh.worker.v1 import worker_pb2_grpc
    from services.worker.bench import cpu_seconds

    port = free_port()
    proc = spawn_tier(
        "bench-session-worker", "worker",
        ["--engine", "fake", "--model", str(args.model), "--port", str(port),
         "--fake-token-delay-ms", str(args.step_ms), "--fake-max-running", str(args.streams),
         "--canary-interval-s", "0", "--log-level", "WARNING"],
        address=f"127.0.0.1:{port}", service="llmesh.worker.v1.WorkerService", log_dir=Path(args.log_dir),
    )
    rounds: list[dict[str, Any]] = []
    try:
        proc.wait_serving(timeout=60)
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            await one_round(stub, 16, 32, "warm-up")
            for r in range(args.rounds):
                cpu_before, started = cpu_seconds([proc.pid]), time.perf_counter()
                received, frames = await one_round(stub, args.streams, args.tokens, f"round-{r}")
                cpu = cpu_seconds([proc.pid]) - cpu_before
                rounds.append({
                    "round": r, "tokens": received, "frames": frames,
                    "wall_s": round(time.perf_counter() - started, 3), "worker_cpu_s": round(cpu, 3),
                    "worker_cpu_us_per_token": round(cpu / received * 1e6, 2),
                })
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        proc.stop()
    per_token = [r["worker_cpu_us_per_token"] for r in rounds]
    return {
        "streams": args.streams, "tokens": args.tokens, "step_ms": args.step_ms,
        "worker_cpu_us_per_token": {"median": statistics.median(per_token), "min": min(per_token),
                                    "max": max(per_token)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker.bench_session", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        default=Path("~/.cache/llmesh/models/smollm2-135m-instruct").expanduser(),
                        help="model directory (the fake reads its vocabulary and context length)")
    parser.add_argument("--streams", type=int, default=128, help="requests in flight at once")
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated per request")
    parser.add_argument("--step-ms", type=float, default=2.0, help="the fake engine's step time")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds")
    parser.add_argument("--log-dir", default="/tmp/llmesh-worker-bench-session")
    args = parser.parse_args(argv)
    args.model = args.model.expanduser()
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

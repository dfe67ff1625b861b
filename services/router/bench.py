"""Router benchmark: throughput and TTFT with batching windows off vs on.

    python -m services.router.bench [--engine fake|real] [--requests 256] [--concurrency 64]

Starts worker processes (the deterministic fake engine by default; ``--engine real``
starts vLLM CPU workers with the tiny DeepSeek model, one per core -- run that under
``flock /tmp/llmesh-engine.lock``), then for each window setting a ``llmesh router``
process, and drives it with concurrent streaming clients from this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass

import grpc

from llmesh.common.v1 import common_pb2
from llmesh.models import ensure_model
from llmesh.procs import TierProcess, free_port, spawn_tier
from llmesh.router.v1 import router_pb2, router_pb2_grpc

WORKER_SERVICE = "llmesh.worker.v1.WorkerService"
ROUTER_SERVICE = "llmesh.router.v1.RouterService"


@dataclass
class Result:
    label: str
    requests: int
    seconds: float
    tokens: int
    ttft_ms: list[float]
    errors: int

    def row(self) -> dict[str, object]:
        ttft = sorted(self.ttft_ms) or [0.0]
        return {
            "setting": self.label,
            "requests": self.requests,
            "errors": self.errors,
            "output_tok_per_s": round(self.tokens / self.seconds, 1),
            "req_per_s": round(self.requests / self.seconds, 2),
            "ttft_p50_ms": round(statistics.median(ttft), 1),
            "ttft_p99_ms": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
        }


def start_workers(engine: str, count: int, delay_ms: float, max_running: int) -> list[TierProcess]:
    model = ensure_model("tiny-deepseek", quiet=True)
    procs = []
    for i in range(count):
        port = free_port()
        args = ["--model", str(model), "--zone", "zone-a", "--worker-id", f"bench-{i}",
                "--port", str(port), "--log-format", "text", "--log-level", "WARNING"]
        env = {}
        if engine == "fake":
            args += ["--engine", "fake", "--fake-token-delay-ms", str(delay_ms),
                     "--fake-max-running", str(max_running)]
        else:
            cpu = str(i % 2)
            args += ["--enforce-eager", "--cpu-kvcache-space-gb", "1", "--cpu-omp-threads-bind", cpu,
                     "--max-num-seqs", str(max_running), "--max-model-len", "1024"]
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cpu}
        procs.append(spawn_tier(f"bench-worker-{i}", "worker", args, address=f"127.0.0.1:{port}",
                                service=WORKER_SERVICE, env=env))
    for proc in procs:
        proc.wait_serving(300)
    return procs


def start_router(workers: list[TierProcess], window_ms: float, max_size: int) -> TierProcess:
    port = free_port()
    spec = json.dumps([{"address": w.address, "zone": "zone-a"} for w in workers])
    proc = spawn_tier(
        "bench-router", "router",
        ["--port", str(port), "--workers", spec, "--batch-max-wait-ms", str(window_ms),
         "--batch-max-size", str(max_size), "--max-queue", "100000", "--log-level", "WARNING"],
        address=f"127.0.0.1:{port}", service=ROUTER_SERVICE,
    )
    proc.wait_serving(60)
    return proc


async def drive(address: str, label: str, requests: int, concurrency: int, max_tokens: int,
                prompt_len: int) -> Result:
    channel = grpc.aio.insecure_channel(address)
    stub = router_pb2_grpc.RouterServiceStub(channel)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    ttfts: list[float] = []
    tokens = 0
    errors = 0

    async def one(i: int) -> None:
        nonlocal tokens, errors
        message = common_pb2.TokenRequest(
            request_id=f"{label}-{i}", prompt_token_ids=[(i * 7 + j) % 4000 + 5 for j in range(prompt_len)]
        )
        message.sampling.max_tokens = max_tokens
        message.sampling.temperature = 0.0
        message.sampling.ignore_eos = True
        start = time.perf_counter()
        first = None
        try:
            async for response in stub.Generate(router_pb2.GenerateRequest(request=message), timeout=300):
                if response.HasField("delta") and response.delta.token_ids:
                    if first is None:
                        first = time.perf_counter()
                    tokens += len(response.delta.token_ids)
        except grpc.aio.AioRpcError:
            errors += 1
            return
        if first is not None:
            ttfts.append((first - start) * 1000.0)

    async def client() -> None:
        while not queue.empty():
            await one(queue.get_nowait())

    # Warm up connections (not measured).
    await asyncio.gather(*(one(-k - 1) for k in range(4)))
    ttfts.clear()
    tokens = 0
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    await channel.close()
    return Result(label, requests, seconds, tokens, ttfts, errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.router.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["fake", "real"], default="fake")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--fake-token-delay-ms", type=float, default=10.0)
    parser.add_argument("--max-running", type=int, default=32,
                        help="engine running-request limit (fake) / max_num_seqs (real)")
    parser.add_argument("--window-ms", type=float, default=5.0, help="batch_max_wait_ms of the 'on' run")
    parser.add_argument("--max-batch", type=int, default=16, help="batch_max_size of the 'on' run")
    args = parser.parse_args(argv)
    workers = start_workers(args.engine, args.workers, args.fake_token_delay_ms, args.max_running)
    results: list[Result] = []
    try:
        for label, window in (("window off", 0.0), (f"window on ({args.window_ms:g} ms)", args.window_ms)):
            router = start_router(workers, window, args.max_batch)
            try:
                results.append(asyncio.run(drive(router.address, label, args.requests, args.concurrency,
                                                 args.max_tokens, args.prompt_len)))
            finally:
                router.stop()
    finally:
        for worker in workers:
            worker.stop()
    print(json.dumps({"engine": args.engine, "workers": args.workers, "requests": args.requests,
                      "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                      "results": [r.row() for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

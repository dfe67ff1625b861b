"""Benchmark: worker throughput over gRPC vs in-process AsyncLLM under the same load.

    python -m services.worker.bench --model ~/.cache/llmesh/models/smollm2-135m-instruct \\
        --concurrency 32 --requests 64 --max-tokens 128 --rounds 6

Two engines with the same arguments and the same CPU binding are started one after the
other and then kept: (1) ``AsyncLLM`` in this process, (2) ``llmesh worker`` as a
subprocess, driven over a grpc.aio channel with ``Generate`` streams. Rounds of the same
load then alternate between them (A B, B A, A B, ...), so slow drift of the machine hits
both alike; an idle engine costs no CPU, and only one of them runs at a time. Every
request generates exactly ``--max-tokens`` tokens (``ignore_eos``). Prints one JSON object:
per mode the best round and every round, the ratio of each adjacent pair of rounds and
their median (the headline), and the CPU the serving layer spent per output token.
This is a benchmark, not a test: run it on an otherwise idle box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.worker.engine import EngineRequest, Sampling

OneRequest = Callable[[int, list[int]], Awaitable[tuple[int, float]]]

IN_PROCESS = "in-process AsyncLLM"
OVER_GRPC = "worker over gRPC"


@dataclass
class RoundResult:
    output_tokens: int
    seconds: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    frontend_cpu_s: float
    """CPU seconds of the non-engine processes in this round: this process, plus the
    worker's main process over gRPC (the price of the serving layer)."""


@dataclass
class ModeResult:
    mode: str
    best: RoundResult
    round_tok_s: list[float]
    frontend_cpu_us_per_token: float
    """Serving-layer CPU per output token over every round of this mode."""


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def make_prompts(model_dir: Path, n: int, length: int, seed: int = 0) -> list[list[int]]:
    from services.worker.fake_engine import FakeModel

    model = FakeModel.from_dir(model_dir)
    rng = random.Random(seed)
    ordinary = [t for t in range(model.vocab_size) if t not in model.special_ids]
    return [[rng.choice(ordinary) for _ in range(length)] for _ in range(n)]


async def drive(
    concurrency: int, prompts: list[list[int]], one: OneRequest
) -> tuple[float, list[int], list[float]]:
    """Run every prompt through ``one(i, prompt) -> (tokens, ttft_s)`` with bounded concurrency."""
    semaphore = asyncio.Semaphore(concurrency)
    counts: list[int] = []
    ttfts: list[float] = []

    async def run(i: int, prompt: list[int]) -> None:
        async with semaphore:
            tokens, ttft = await one(i, prompt)
            counts.append(tokens)
            ttfts.append(ttft)

    start = time.perf_counter()
    await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - start, counts, ttfts


async def measure(concurrency: int, prompts: list[list[int]], one: OneRequest,
                  frontend_pids: list[int]) -> RoundResult:
    cpu_before = cpu_seconds(frontend_pids)
    seconds, counts, ttfts = await drive(concurrency, prompts, one)
    cpu = cpu_seconds(frontend_pids) - cpu_before
    ttfts.sort()
    return RoundResult(
        output_tokens=sum(counts), seconds=round(seconds, 3),
        output_tok_s=round(sum(counts) / seconds, 1),
        ttft_p50_ms=round(statistics.median(ttfts) * 1000, 1),
        ttft_p90_ms=round(ttfts[int(0.9 * (len(ttfts) - 1))] * 1000, 1),
        frontend_cpu_s=round(cpu, 3),
    )


def in_process_request(engine: Any, max_tokens: int) -> OneRequest:
    """One request straight into the worker's own ``VllmEngine`` adapter over AsyncLLM."""
    async def one(i: int, prompt: list[int]) -> tuple[int, float]:
        start = time.perf_counter()
        ttft = 0.0
        count = 0
        request = EngineRequest(f"inproc-{i}-{time.monotonic_ns()}", tuple(prompt),
                                Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        async for out in engine.generate(request):
            if out.token_ids and not count:
                ttft = time.perf_counter() - start
            count += len(out.token_ids)
        return count, ttft
    return one


def grpc_request(channel: Any, max_tokens: int) -> OneRequest:
    """One request over ``WorkerService.Generate`` (one message per token delta)."""
    from llmesh.common.v1 import common_pb2
    from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc

    stub = worker_pb2_grpc.WorkerServiceStub(channel)

    async def one(i: int, prompt: list[int]) -> tuple[int, float]:
        start = time.perf_counter()
        ttft = 0.0
        count = 0
        request = common_pb2.TokenRequest(
            request_id=f"grpc-{i}-{time.monotonic_ns()}", prompt_token_ids=prompt,
            sampling=common_pb2.EngineSampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
        async for msg in stub.Generate(worker_pb2.GenerateRequest(request=request)):
            if msg.HasField("delta"):
                if not count:
                    ttft = time.perf_counter() - start
                count += len(msg.delta.token_ids)
        return count, ttft
    return one


async def run(args: argparse.Namespace, engine_args: dict[str, object],
              prompts: list[list[int]]) -> dict[str, Any]:
    import grpc

    from llmesh.procs import free_port, spawn_tier
    from services.worker.affinity import check_frontend_cpus, pin_process
    from services.worker.servicer import SERVICE_NAME
    from services.worker.vllm_engine import VllmEngine

    engine = VllmEngine.build(engine_args)
    port = free_port()
    worker_args = ["--model", str(args.model), "--port", str(port), "--canary-interval-s", "0",
                   "--max-num-seqs", str(args.max_num_seqs), "--log-level", "WARNING",
                   "--cpu-kvcache-space-gb", str(args.cpu_kvcache_space_gb)]
    if args.omp_threads_bind:
        worker_args += ["--cpu-omp-threads-bind", args.omp_threads_bind]
    if args.frontend_cpus:
        worker_args += ["--frontend-cpus", args.frontend_cpus]
    proc = spawn_tier("bench-worker", "worker", worker_args, address=f"127.0.0.1:{port}",
                      service=SERVICE_NAME, log_dir=Path(args.log_dir))
    try:
        proc.wait_serving(timeout=600)
        if args.frontend_cpus:
            # Like the worker does with the same setting: after both engines started, so
            # their processes keep the binding vLLM gave them.
            pin_process(check_frontend_cpus(args.frontend_cpus, args.omp_threads_bind))
        async with grpc.aio.insecure_channel(proc.address) as channel:
            modes: dict[str, tuple[OneRequest, list[int]]] = {
                IN_PROCESS: (in_process_request(engine, args.max_tokens), [os.getpid()]),
                OVER_GRPC: (grpc_request(channel, args.max_tokens), [os.getpid(), proc.pid]),
            }
            for one, _ in modes.values():
                await drive(1, prompts[:2], one)  # warm-up, like the worker's
            rounds: dict[str, list[RoundResult]] = {IN_PROCESS: [], OVER_GRPC: []}
            pair_ratios: list[float] = []
            for pair in range(args.rounds):
                order = [IN_PROCESS, OVER_GRPC] if pair % 2 == 0 else [OVER_GRPC, IN_PROCESS]
                for mode in order:
                    one, pids = modes[mode]
                    rounds[mode].append(await measure(args.concurrency, prompts, one, pids))
                    print(json.dumps({"pair": pair, "mode": mode, **asdict(rounds[mode][-1])}),
                          file=sys.stderr, flush=True)
                pair_ratios.append(rounds[OVER_GRPC][-1].output_tok_s / rounds[IN_PROCESS][-1].output_tok_s)
    finally:
        proc.stop(timeout=30)
        await engine.shutdown()
    results = []
    for mode, rs in rounds.items():
        tokens = sum(r.output_tokens for r in rs)
        results.append(ModeResult(
            mode=mode, best=max(rs, key=lambda r: r.output_tok_s),
            round_tok_s=[r.output_tok_s for r in rs],
            frontend_cpu_us_per_token=round(sum(r.frontend_cpu_s for r in rs) / tokens * 1e6, 1),
        ))
    total = {mode: sum(r.output_tokens for r in rs) / sum(r.seconds for r in rs)
             for mode, rs in rounds.items()}
    return {
        "results": [asdict(r) for r in results],
        "pair_ratios": [round(r, 3) for r in pair_ratios],
        "grpc_over_inprocess_ratio": round(statistics.median(pair_ratios), 3),
        "ratio_of_totals": round(total[OVER_GRPC] / total[IN_PROCESS], 3),
        "ratio_of_best_rounds": round(results[1].best.output_tok_s / results[0].best.output_tok_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        default=Path("~/.cache/llmesh/models/smollm2-135m-instruct").expanduser())
    parser.add_argument("--concurrency", type=int, default=32, help="streams in flight at once")
    parser.add_argument("--requests", type=int, default=64, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="vLLM max_num_seqs of both engines")
    parser.add_argument("--cpu-kvcache-space-gb", type=float, default=2.0, help="KV cache of each engine")
    parser.add_argument("--rounds", type=int, default=6,
                        help="pairs of rounds (one per mode, order alternating); the median ratio counts")
    parser.add_argument("--omp-threads-bind", default="",
                        help="VLLM_CPU_OMP_THREADS_BIND of both engines (default: vLLM's auto binding, "
                             "which keeps one core for the engine's scheduler and the frontend)")
    parser.add_argument("--frontend-cpus", default="",
                        help="the worker's frontend_cpus, and the same pinning for this process "
                             "(e.g. 1 with --omp-threads-bind 0; default: not pinned)")
    parser.add_argument("--log-dir", default="/tmp/llmesh-worker-bench")
    args = parser.parse_args(argv)
    args.model = args.model.expanduser()
    # vLLM logs to stdout by default; keep stdout for the JSON result.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.cpu_kvcache_space_gb:g}"
    if args.omp_threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_threads_bind
    prompts = make_prompts(args.model, args.requests, args.prompt_len)
    engine_args: dict[str, object] = {
        "model": str(args.model), "enforce_eager": True, "max_num_seqs": args.max_num_seqs,
    }
    load_before = os.getloadavg()
    started = time.perf_counter()
    summary = asyncio.run(run(args, engine_args, prompts))
    print(json.dumps({
        "model": args.model.name, "concurrency": args.concurrency, "requests": args.requests,
        "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "rounds": args.rounds,
        "omp_threads_bind": args.omp_threads_bind or "auto", "frontend_cpus": args.frontend_cpus or "any",
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - started, 1), **summary,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

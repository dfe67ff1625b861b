"""Tokenizer tier benchmark: requests/s and latency at 1, 16 and 64 concurrent callers.

    python -m services.tokenizer.bench                      # starts its own tokenizer process
    python -m services.tokenizer.bench --target host:port   # measures a running one

Each caller sends Encode requests (a chat of a system and a user message, rendered with
the model's template) back to back over one shared channel. Not a test: figures depend
on the machine; record them in docs/benchmarks-tokenizer.md with the command used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

WORDS = [
    "account", "balance", "transfer", "loan", "rate", "credit", "card", "payment", "branch", "customer",
    "statement", "interest", "deposit", "mortgage", "currency", "exchange", "fee", "limit", "review",
    "policy", "risk", "audit", "report", "quarter",
]


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    seconds: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    mean_tokens: float
    mean_encode_batch: float | None = None
    """Texts per encode_batch call on the server (from its metrics; only when started here)."""


def _batch_counters(metrics_url: str) -> tuple[float, float] | None:
    """(sum, count) of llmesh_tokenizer_encode_batch_size from a /metrics endpoint."""
    import urllib.request

    try:
        body = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return None
    values = {}
    for line in body.splitlines():
        for key in ("llmesh_tokenizer_encode_batch_size_sum", "llmesh_tokenizer_encode_batch_size_count"):
            if line.startswith(key + " "):
                values[key] = float(line.split()[1])
    if len(values) != 2:
        return None
    prefix = "llmesh_tokenizer_encode_batch_size"
    return values[f"{prefix}_sum"], values[f"{prefix}_count"]


def _request(rng: random.Random, words: int, model: str) -> tokenizer_pb2.EncodeRequest:
    user = " ".join(rng.choice(WORDS) for _ in range(words))
    return tokenizer_pb2.EncodeRequest(input=tokenizer_pb2.EncodeInput(
        model=model,
        messages=[
            tokenizer_pb2.ChatMessage(role="system", content="You are a careful banking assistant."),
            tokenizer_pb2.ChatMessage(role="user", content=user + " 你好?"),
        ],
    ))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def run_level(stub: tokenizer_pb2_grpc.TokenizerServiceStub, concurrency: int, seconds: float,
                    words: int, model: str, seed: int) -> LevelResult:
    rng = random.Random(seed)
    requests = [_request(rng, words, model) for _ in range(64)]
    latencies: list[float] = []
    tokens: list[int] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        nonlocal errors
        i = k
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                reply = await stub.Encode(requests[i % len(requests)], timeout=30)
            except grpc.aio.AioRpcError:
                errors += 1
                continue
            latencies.append(time.perf_counter() - start)
            tokens.append(reply.result.count)
            i += concurrency

    started = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - started
    return LevelResult(
        concurrency=concurrency,
        requests=len(latencies),
        errors=errors,
        seconds=round(elapsed, 2),
        requests_per_s=round(len(latencies) / elapsed, 1),
        p50_ms=round(_percentile(latencies, 0.50) * 1000, 2),
        p99_ms=round(_percentile(latencies, 0.99) * 1000, 2),
        mean_tokens=round(statistics.fmean(tokens), 1) if tokens else 0.0,
    )


async def bench(target: str, levels: list[int], seconds: float, words: int, model: str,
                metrics_url: str = "") -> list[LevelResult]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        # Warm the channel and the server (template compile, first encode).
        await run_level(stub, 1, min(1.0, seconds), words, model, seed=0)
        results = []
        for c in levels:
            before = _batch_counters(metrics_url) if metrics_url else None
            result = await run_level(stub, c, seconds, words, model, seed=c)
            after = _batch_counters(metrics_url) if metrics_url else None
            if before and after and after[1] > before[1]:
                result.mean_encode_batch = round((after[0] - before[0]) / (after[1] - before[1]), 2)
            results.append(result)
        return results


async def bench_core(model_dir: Path, levels: list[int], seconds: float, words: int,
                     threads: int) -> list[LevelResult]:
    """The same load on TokenizerCore in this process, without gRPC: the encoder's ceiling."""
    from services.tokenizer.convert import encode_input_from_proto
    from services.tokenizer.core import TokenizerCore
    from services.tokenizer.loader import load_models

    batches: list[int] = []
    core = TokenizerCore(load_models([str(model_dir)]), threads=threads, on_batch=batches.append)
    results = []
    try:
        for concurrency in levels:
            rng = random.Random(concurrency)
            items = [encode_input_from_proto(_request(rng, words, "").input) for _ in range(64)]
            latencies: list[float] = []
            batches.clear()
            deadline = time.perf_counter() + seconds

            async def caller(k: int, items=items, latencies=latencies, deadline=deadline,
                             concurrency=concurrency) -> None:
                i = k
                while time.perf_counter() < deadline:
                    start = time.perf_counter()
                    await core.encode(items[i % len(items)])
                    latencies.append(time.perf_counter() - start)
                    i += concurrency

            started = time.perf_counter()
            await asyncio.gather(*(caller(k) for k in range(concurrency)))
            elapsed = time.perf_counter() - started
            results.append(LevelResult(
                concurrency=concurrency, requests=len(latencies), errors=0, seconds=round(elapsed, 2),
                requests_per_s=round(len(latencies) / elapsed, 1),
                p50_ms=round(_percentile(latencies, 0.50) * 1000, 2),
                p99_ms=round(_percentile(latencies, 0.99) * 1000, 2),
                mean_tokens=0.0,
                mean_encode_batch=round(statistics.fmean(batches), 2) if batches else None,
            ))
    finally:
        core.close()
    return results


def _print_table(title: str, results: list[LevelResult]) -> None:
    print(title)
    print(f"{'callers':>8} {'requests':>9} {'errors':>6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'tokens':>7} {'batch':>6}")
    for r in results:
        batch = "-" if r.mean_encode_batch is None else r.mean_encode_batch
        print(f"{r.concurrency:>8} {r.requests:>9} {r.errors:>6} {r.requests_per_s:>8} {r.p50_ms:>8} "
              f"{r.p99_ms:>8} {r.mean_tokens:>7} {batch:>6}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.tokenizer.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="", help="host:port of a running tokenizer (default: start one)")
    parser.add_argument("--model-dir", default="", help="model directory for the started tokenizer "
                        "(default: the prepared smollm2-135m-instruct)")
    parser.add_argument("--model", default="", help="model name to request (default: the default model)")
    parser.add_argument("--levels", default="1,16,64", help="comma-separated concurrent callers")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each level")
    parser.add_argument("--words", type=int, default=120, help="words in the user message")
    parser.add_argument("--encode-threads", type=int, default=2,
                        help="--encode-threads of the started server")
    parser.add_argument("--core", action="store_true",
                        help="also run the load on TokenizerCore in-process (no gRPC), for comparison")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]

    proc = None
    target = args.target
    metrics_url = ""
    model_dir: Path | None = Path(args.model_dir) if args.model_dir else None
    if model_dir is None and (not target or args.core):
        from llmesh.models import DEFAULT_MODEL, ensure_model

        model_dir = ensure_model(DEFAULT_MODEL, quiet=True)
    if not target:
        from llmesh.procs import free_port, spawn_tier
        from services.tokenizer.servicer import SERVICE_NAME

        port, metrics_port = free_port(), free_port()
        target = f"127.0.0.1:{port}"
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        proc = spawn_tier(
            "tokenizer-bench", "tokenizer",
            ["--port", str(port), "--metrics-port", str(metrics_port), "--models", str(model_dir),
             "--log-level", "WARNING",
             "--encode-threads", str(args.encode_threads), "--drain-seconds", "0"],
            address=target, service=SERVICE_NAME,
        )
        proc.wait_serving(timeout=60)
    try:
        results = asyncio.run(bench(target, levels, args.seconds, args.words, args.model, metrics_url))
    finally:
        if proc is not None:
            proc.stop()
    core_results: list[LevelResult] = []
    if args.core:
        assert model_dir is not None
        core_results = asyncio.run(
            bench_core(model_dir, levels, args.seconds, args.words, args.encode_threads)
        )
    if args.json:
        print(json.dumps({"grpc": [asdict(r) for r in results],
                          "core": [asdict(r) for r in core_results]}, indent=2))
    else:
        _print_table(f"gRPC Encode against {target}", results)
        if core_results:
            _print_table("TokenizerCore in-process (no gRPC)", core_results)
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

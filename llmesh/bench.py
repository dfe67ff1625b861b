"""``llmesh bench``: llmesh against ``vllm serve`` on the same model, engine settings and machine.

Phases, one after the other (never two engines loaded at once: on a small box they would
share cores and both figures would be wrong):

1. llmesh: a local mesh (one vLLM CPU worker on all cores) is started -- or ``--target``
   names a running one -- warmed up, and driven at every concurrency level.
2. reference: ``python -m vllm.entrypoints.openai.api_server`` with the same engine
   settings (max_num_seqs, max_model_len, enforce_eager, KV cache space, cores) -- or
   ``--reference-url`` names a running one -- driven with the same requests.
3. overhead: a fake-engine mesh; sequential requests straight to the worker, to the
   router and through the gateway (gRPC and HTTP) give the per-request cost of the tiers.
   Each request goes down every path in turn, so background load hits all paths alike;
   ``added_paired_ms`` is the median of the per-request differences.
4. paired: llmesh and the reference up at the same time, only one of them loaded at any
   moment: the TTFT llmesh adds at one stream, each prompt sent to both in turn; then the
   throughput and serving CPU at the top level in blocks alternating between the two
   (llmesh, reference, reference, llmesh, ...), so the machine's drift between the two
   systems' levels leaves the ratio.
5. batching: the router's batching window on vs off, on fake-engine meshes.
6. capacity (``--capacity`` alone, or ``--with-capacity`` before the others): the whole mesh
   over the step-based fake engine at accelerator rates, CPU microseconds per output token
   of every tier.

The load is closed-loop and seeded: per level, a fixed list of requests (prompt and
output lengths drawn from ``--seed``) is sent over N concurrent streams, each stream
sending its next request when the previous one finished. Both systems get the same
requests through the same OpenAI HTTP client code (``--llmesh-protocol grpc`` drives
llmesh over gRPC instead). Output: ``<out>/bench.json`` and ``<out>/bench.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from llmesh.bench_load import (
    BenchRequest,
    CpuMeter,
    LevelResult,
    LlmeshGrpcDriver,
    OpenAIHttpDriver,
    RequestResult,
    WorkloadSpec,
    make_workload,
    median_interval,
    percentile,
    run_level,
)
from llmesh.bench_report import plot, ratio, ratios, text_summary, write_json
from services.common.modelinfo import engine_dtype

DEFAULT_LEVELS = (1, 8, 32)
QUICK_REQUESTS_PER_STREAM = 2
QUICK_MIN_REQUESTS = 8
PAIRED_REQUESTS = 48
QUICK_PAIRED_REQUESTS = 24
PAIRED_GAP_S = 1.25
"""Default pause before each request of the paired TTFT phase (see :func:`_paired_ttft`)."""


def router_worker_transport() -> str:
    """The router's default worker_transport: the bench measures what a mesh runs unless told."""
    from services.router.settings import RouterSettings

    return str(RouterSettings.model_fields["worker_transport"].default)


def gateway_transport(tier: str) -> str:
    """The gateway's default ``<tier>_transport`` (the layout a mesh runs unless told)."""
    from gateway.settings import GatewaySettings

    return str(GatewaySettings.model_fields[f"{tier}_transport"].default)


@dataclass(frozen=True)
class BenchOptions:
    """Everything one bench run needs (from the command line)."""

    model_dir: Path
    model_name: str
    levels: tuple[int, ...]
    requests_per_stream: int
    min_requests: int
    seed: int
    workload: WorkloadSpec
    protocol: str
    max_num_seqs: int
    max_model_len: int
    kvcache_gb: float
    omp_bind: str
    out_dir: Path
    log_dir: Path
    progress: bool
    overhead_requests: int
    batching_levels: tuple[int, ...]
    batching_wait_ms: float
    fake_token_delay_ms: float
    capacity_streams: int = 128
    capacity_tokens: int = 256
    capacity_step_ms: float = 2.0
    capacity_requests_per_stream: int = 1
    stream_interval: int = 1
    stream_max_delay_ms: int = 0
    gateway_processes: int = 1
    paired_requests: int = 48
    """Prompts of the paired TTFT phase (each sent to llmesh and to the reference)."""
    paired_tokens: int = 8
    """max_tokens of each request of the paired TTFT phase."""
    paired_gap_s: float = PAIRED_GAP_S
    """Pause before each request of the paired TTFT phase."""
    paired_blocks: int = 4
    """Load blocks per system in the paired throughput phase (0: no such phase)."""
    paired_concurrency: int = 32
    """Concurrent streams of each block of the paired throughput phase."""
    capacity_idle_s: float = 5.0
    """Seconds the capacity mesh is measured idle (warmed up, no load) before the load."""
    capacity_protocol: str = "grpc"
    """How the capacity load reaches the gateway: ``grpc`` (GenerateStream) or ``http``
    (the OpenAI streaming completions, as the real-engine phase drives it)."""
    worker_transport: str = field(default_factory=router_worker_transport)
    """The router's worker_transport in every mesh the bench starts (session or calls);
    the router's own default unless set."""
    postprocessor_transport: str = field(default_factory=lambda: gateway_transport("postprocessor"))
    """The gateway's postprocessor_transport in every mesh the bench starts: ``local``
    runs the postprocessing in the gateway's process and starts no postprocessor."""
    tokenizer_transport: str = field(default_factory=lambda: gateway_transport("tokenizer"))
    """The gateway's tokenizer_transport likewise (``local``: no tokenizer process)."""
    router_transport: str = field(default_factory=lambda: gateway_transport("router"))
    """The gateway's router_transport likewise (``local``: the router runs in the gateway's
    process and event loop, no router process)."""

    def requests_for(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_stream * concurrency)


# --------------------------------------------------------------------------- running load


def _bar(opts: BenchOptions, desc: str, total: int) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", disable=not opts.progress, leave=True,
                file=sys.stderr, dynamic_ncols=True)


async def _drive_levels(
    opts: BenchOptions, label: str, driver: Any, cpu: CpuMeter | None, levels: Sequence[int],
    warmup: int = 2,
) -> list[LevelResult]:
    """Warm up (not measured), then every level in order with its own seeded requests."""
    async with driver:
        warm = make_workload(warmup, seed=opts.seed + 999_999, spec=opts.workload)
        for req in warm:
            res = await driver(req)
            if not res.ok:
                print(f"llmesh bench: {label} warm-up request failed: {res.error}", file=sys.stderr)
        out = []
        for c in levels:
            requests = make_workload(opts.requests_for(c), seed=opts.seed * 1000 + c, spec=opts.workload)
            with _bar(opts, f"{label:>9} {c:>3} streams", len(requests)) as bar:

                def tick(_result: RequestResult, bar: tqdm = bar) -> None:
                    bar.update()

                out.append(await run_level(driver, requests, c, cpu=cpu, on_result=tick))
        return out


def _system(label: str, levels: list[LevelResult], **extra: Any) -> dict[str, Any]:
    return {"label": label, **extra, "levels": [lv.summary() for lv in levels]}


# --------------------------------------------------------------------------- llmesh


def _mesh_cpu_groups(procs: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for p in procs:
        groups.setdefault(str(p["tier"]), []).append(int(p["pid"]))
    return groups


@contextlib.contextmanager
def _started_mesh(config: Any, log_dir: Path) -> Iterator[Any]:
    from llmesh.up import Mesh

    mesh = Mesh(config, log_dir=log_dir)
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


def _router_settings(opts: BenchOptions, batch_max_wait_ms: float | None) -> dict[str, Any]:
    settings: dict[str, Any] = {"worker_transport": opts.worker_transport}
    if batch_max_wait_ms is not None:
        settings["batch_max_wait_ms"] = batch_max_wait_ms
    return settings


def _gateway_settings(opts: BenchOptions) -> dict[str, Any]:
    return {"drain_seconds": 0, "postprocessor_transport": opts.postprocessor_transport,
            "tokenizer_transport": opts.tokenizer_transport, "router_transport": opts.router_transport}


def _engine_mesh_config(opts: BenchOptions, *, batch_max_wait_ms: float | None = None) -> Any:
    from llmesh.meshconfig import GatewayConfig, MeshConfig, RouterConfig, WorkerConfig
    from llmesh.procs import free_port

    router_settings = _router_settings(opts, batch_max_wait_ms)
    return MeshConfig(
        model=str(opts.model_dir),
        served_model_name=opts.model_name,
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), settings=_gateway_settings(opts)),
        router=RouterConfig(settings=router_settings),
        workers=[WorkerConfig(
            zone="zone-a", device="cpu", engine="vllm", cpu_omp_threads_bind=opts.omp_bind,
            settings={"max_num_seqs": opts.max_num_seqs, "max_model_len": opts.max_model_len,
                      "cpu_kvcache_space_gb": opts.kvcache_gb, "enforce_eager": True},
        )],
    )


def _llmesh_driver(opts: BenchOptions, grpc_target: str, http_url: str) -> Any:
    if opts.protocol == "grpc":
        if not grpc_target:
            raise SystemExit("llmesh bench: --llmesh-protocol grpc needs --target HOST:PORT")
        return LlmeshGrpcDriver(grpc_target, opts.model_name)
    if not http_url:
        raise SystemExit("llmesh bench: the llmesh mesh has no HTTP listener; pass --target-http "
                         "or use --llmesh-protocol grpc")
    return OpenAIHttpDriver(http_url, opts.model_name)


def run_llmesh(opts: BenchOptions, args: argparse.Namespace) -> dict[str, Any]:
    """Drive an existing mesh (``--target``/``--target-http``) or start one for the run."""
    label = f"llmesh ({opts.protocol})"
    with _llmesh_target(opts, args, "llmesh") as mine:
        state = mine.state
        cpu = CpuMeter(_mesh_cpu_groups(state["processes"]), engine_groups=("worker",)) if state else None
        if cpu is None:
            print("llmesh bench: no mesh state file, so no CPU figures for llmesh", file=sys.stderr)
        levels = asyncio.run(_drive_levels(opts, "llmesh", mine.driver, cpu, opts.levels))
    if not mine.started:
        return _system(label, levels, target=mine.target, started_by_bench=False)
    assert state is not None
    return _system(label, levels, target=mine.target, started_by_bench=True,
                   processes=sorted({p["tier"] for p in state["processes"]}))


@dataclass
class _LlmeshTarget:
    driver: Any
    target: str
    """The address the report names: the gateway's gRPC address, or the HTTP URL driven."""
    state: dict[str, Any] | None
    """The mesh's state (its processes' pids), when known."""
    started: bool
    """Started by the bench (else a running mesh named by --target/--target-http)."""


@contextlib.contextmanager
def _llmesh_target(opts: BenchOptions, args: argparse.Namespace, log_name: str) -> Iterator[_LlmeshTarget]:
    """The running llmesh (``--target``/``--target-http``) or a mesh started here for the
    phase (its logs under ``<out>/logs/<log_name>``), with a driver for it."""
    if args.target or args.target_http:
        state = _read_state(args.mesh_state)
        http_url = args.target_http or (state or {}).get("http", "")
        yield _LlmeshTarget(_llmesh_driver(opts, args.target or "", http_url), args.target or http_url,
                            state, started=False)
        return
    config = _engine_mesh_config(opts)
    print(f"llmesh bench: starting the llmesh mesh ({log_name})", file=sys.stderr)
    with _started_mesh(config, opts.log_dir / log_name) as mesh:
        state = mesh.state()
        grpc_target = f"{config.gateway.host}:{config.gateway.port}"
        yield _LlmeshTarget(_llmesh_driver(opts, grpc_target, state["http"]), grpc_target, state,
                            started=True)


def _read_state(path: str | None) -> dict[str, Any] | None:
    from llmesh.home import run_dir

    candidate = Path(path) if path else run_dir() / "mesh.json"
    if not candidate.is_file():
        return None
    data: dict[str, Any] = json.loads(candidate.read_text())
    return data


# --------------------------------------------------------------------------- reference


def reference_argv(opts: BenchOptions, port: int) -> list[str]:
    """The ``vllm serve`` command line (through the module: the console script is broken here)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(opts.model_dir), "--served-model-name", opts.model_name,
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
        "--max-model-len", str(opts.max_model_len), "--max-num-seqs", str(opts.max_num_seqs),
        "--disable-uvicorn-access-log",
        # The dtype llmesh's CPU worker runs the model in (float32 for a float32 checkpoint).
        "--dtype", engine_dtype("auto", opts.model_dir, "cpu"),
    ]


def _wait_http_ready(url: str, popen: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
            raise RuntimeError(f"reference server exited with code {popen.returncode}; log {log}\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"reference server not ready at {url} after {timeout:.0f}s; log {log}")


@contextlib.contextmanager
def _started_reference(opts: BenchOptions) -> Iterator[tuple[str, int]]:
    from llmesh.procs import free_port

    port = free_port()
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{opts.kvcache_gb:g}"
    if opts.omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = opts.omp_bind
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    log = opts.log_dir / "reference-vllm.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(reference_argv(opts, port), env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        _wait_http_ready(f"http://127.0.0.1:{port}/health", popen, log, timeout=600)
        yield f"http://127.0.0.1:{port}", popen.pid
    finally:
        _stop_group(popen)


def _stop_group(popen: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (engine core included), then SIGKILL."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(10)
    # The engine core may outlive its parent for a moment; it is in the same group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)


def run_reference(opts: BenchOptions, args: argparse.Namespace) -> dict[str, Any]:
    label = "vllm serve"
    if args.reference_url:
        cpu = (CpuMeter({"vllm": [args.reference_pid]}, engine_groups=("vllm",))
               if args.reference_pid else None)
        driver = OpenAIHttpDriver(args.reference_url, opts.model_name)
        levels = asyncio.run(_drive_levels(opts, "reference", driver, cpu, opts.levels))
        return _system(label, levels, target=args.reference_url, started_by_bench=False)
    print("llmesh bench: starting the reference vllm server", file=sys.stderr)
    with _started_reference(opts) as (url, pid):
        cpu = CpuMeter({"vllm": [pid]}, engine_groups=("vllm",))
        levels = asyncio.run(_drive_levels(opts, "reference", OpenAIHttpDriver(url, opts.model_name),
                                           cpu, opts.levels))
    return _system(label, levels, target="vllm.entrypoints.openai.api_server", started_by_bench=True,
                   command=" ".join(reference_argv(opts, 0)).replace(" --port 0", ""))


# --------------------------------------------------------------------------- paired TTFT


@contextlib.contextmanager
def _reference_for_pairs(opts: BenchOptions, args: argparse.Namespace) -> Iterator[tuple[Any, int]]:
    """A driver for the reference and its pid (0 when unknown: no CPU figures for it)."""
    if args.reference_url:
        yield OpenAIHttpDriver(args.reference_url, opts.model_name), args.reference_pid
        return
    print("llmesh bench: starting the reference vllm server beside it", file=sys.stderr)
    with _started_reference(opts) as (url, pid):
        yield OpenAIHttpDriver(url, opts.model_name), pid


def run_paired(opts: BenchOptions, args: argparse.Namespace) -> dict[str, Any]:
    """The paired phases: llmesh and the reference up at the same time (their engines bound
    to the same cores, only one system loaded at any moment), so the machine's drift falls
    on both alike. First the added TTFT at one stream (:func:`_paired_ttft`), then the
    throughput at ``paired_concurrency`` streams in alternating blocks
    (:func:`_paired_throughput`; none with ``paired_blocks`` 0)."""
    spec = WorkloadSpec(prompt_words=opts.workload.prompt_words,
                        output_tokens=(opts.paired_tokens, opts.paired_tokens))
    warmup = 3
    requests = make_workload(opts.paired_requests + warmup, seed=opts.seed + 7171, spec=spec)
    out: dict[str, Any] = {}
    with (_llmesh_target(opts, args, "paired-llmesh") as mine,
          _reference_for_pairs(opts, args) as (reference, reference_pid)):
        drivers = {"llmesh": mine.driver, "reference": reference}
        with _bar(opts, "   paired TTFT (interleaved)", 1) as bar:
            levels = asyncio.run(interleaved(drivers, requests, warmup=warmup, gap_s=opts.paired_gap_s))
            bar.update()
        out["paired_ttft"] = _paired_ttft(opts, levels)
        if opts.paired_blocks:
            meters = {"llmesh": CpuMeter(_mesh_cpu_groups(mine.state["processes"]), engine_groups=("worker",))
                      if mine.state else None,
                      "reference": CpuMeter({"vllm": [reference_pid]}, engine_groups=("vllm",))
                      if reference_pid else None}
            out["paired_throughput"] = _paired_throughput(opts, drivers, meters)
    return out


def _paired_ttft(opts: BenchOptions, levels: dict[str, LevelResult]) -> dict[str, Any]:
    """The time to first token llmesh adds at one stream, measured in pairs.

    Every prompt goes to both systems, one after the other, the order alternating, and the
    figure is the median of the per-prompt differences. Run one after the other, as the
    levels are, the two systems' TTFT P50 each carry the engine's and the machine's drift
    of that minute; in pairs the drift falls on both alike.

    Every request starts after a pause (``--paired-ttft-gap-s``, :data:`PAIRED_GAP_S`): a vLLM engine's worker
    process busy-polls its shared-memory queue for a second after its last step (vLLM's
    ``SpinCondition.busy_loop_s``), on the cores the other system's engine then steps on;
    back to back, a request sent right after the other system's took about a second to
    its first token instead of 60-95 ms.
    """
    diffs = paired_differences_ms(levels, "llmesh", "reference")
    interval = median_interval(diffs)
    return {
        "requests": opts.paired_requests,
        "output_tokens_per_request": opts.paired_tokens,
        "pairs": len(diffs),
        "llmesh": _path_figures(levels["llmesh"]),
        "reference": _path_figures(levels["reference"]),
        "added_ttft_ms": {q: round(percentile(diffs, p), 3) for q, p in (("p25", 25), ("p50", 50),
                                                                          ("p75", 75))},
        "p50_interval_ms": [round(v, 3) for v in interval] if interval is not None else None,
        "differences_ms": [round(d, 3) for d in diffs],
        "gap_s": opts.paired_gap_s,
        "note": "one request at a time, each after a pause of gap_s; each prompt sent to llmesh and to "
                "the reference in turn, the order alternating; added_ttft_ms: percentiles of the "
                "per-prompt differences (llmesh minus reference); p50_interval_ms: a 95 % interval for "
                "their median (order statistics; null below 6 pairs); differences_ms: each pair's",
    }


def block_order(names: Sequence[str], blocks: int) -> list[str]:
    """``blocks`` blocks of each name, in pairs whose order alternates (A B, B A, A B, ...):
    a drift that runs linearly through the phase falls on both names alike over each two
    pairs."""
    order: list[str] = []
    for i in range(blocks):
        order += list(names) if i % 2 == 0 else list(reversed(names))
    return order


async def alternating_blocks(drivers: dict[str, Any], meters: dict[str, CpuMeter | None], blocks: int,
                             concurrency: int, workload: Callable[[int], list[BenchRequest]],
                             warm: Sequence[BenchRequest], gap_s: float = 0.0,
                             on_block: Callable[[], None] | None = None) -> list[tuple[str, LevelResult]]:
    """Closed-loop load at ``concurrency`` streams, one block per system at a time in
    :func:`block_order`; pair ``i`` sends ``workload(i)`` (the same requests) to each system.
    ``warm`` goes to every system first (not measured); ``gap_s``: a pause before each block."""
    names = list(drivers)
    out: list[tuple[str, LevelResult]] = []
    async with contextlib.AsyncExitStack() as stack:
        for driver in drivers.values():
            await stack.enter_async_context(driver)
        for name in names:
            await run_level(drivers[name], warm, concurrency)
        for i, name in enumerate(block_order(names, blocks)):
            if gap_s:
                await asyncio.sleep(gap_s)
            out.append((name, await run_level(drivers[name], workload(i // len(names)), concurrency,
                                              cpu=meters.get(name))))
            if on_block is not None:
                on_block()
    return out


def merged_level(levels: Sequence[LevelResult]) -> LevelResult:
    """Blocks of one system as one level: their requests, wall time and CPU added up."""
    cpu: dict[str, float] = {}
    engines: dict[str, float] = {}
    for level in levels:
        for tier, v in level.cpu_s.items():
            cpu[tier] = cpu.get(tier, 0.0) + v
        for tier, v in level.engine_cpu_s.items():
            engines[tier] = engines.get(tier, 0.0) + v
    return LevelResult(concurrency=levels[0].concurrency, results=[r for lv in levels for r in lv.results],
                       duration_s=sum(lv.duration_s for lv in levels), cpu_s=cpu, engine_cpu_s=engines)


_BLOCK_KEYS = ("requests", "errors", "duration_s", "output_tokens", "output_tokens_per_s")


def _paired_throughput(opts: BenchOptions, drivers: dict[str, Any],
                       meters: dict[str, CpuMeter | None]) -> dict[str, Any]:
    """Throughput and serving CPU at ``paired_concurrency`` streams, both systems up, in
    alternating blocks (llmesh, reference, reference, llmesh, ...). Run one after the other,
    minutes apart, as the levels are, the two systems' throughput carries the engine's
    drift of their minutes (a one-stream inter-token gap of 27 ms in one system's level and
    23 ms in the other's, same machine, same run); in blocks that alternate, it falls on
    both alike."""
    c = opts.paired_concurrency
    per_block = opts.requests_for(c)
    warm = make_workload(c, seed=opts.seed + 8282, spec=WorkloadSpec(opts.workload.prompt_words, (16, 16)))

    def workload(pair: int) -> list[BenchRequest]:
        return make_workload(per_block, seed=opts.seed * 1000 + c + 7919 * (pair + 1), spec=opts.workload)

    with _bar(opts, f"   paired {c} streams (blocks)", 2 * opts.paired_blocks) as bar:
        blocks = asyncio.run(alternating_blocks(drivers, meters, opts.paired_blocks, c, workload, warm,
                                                gap_s=opts.paired_gap_s, on_block=bar.update))
    systems = {name: merged_level([lv for n, lv in blocks if n == name]).summary() for name in drivers}
    summaries = [(n, lv.summary()) for n, lv in blocks]
    tok_s = {name: [s["output_tokens_per_s"] for n, s in summaries if n == name] for name in drivers}
    pair_ratios = [ratio(a, b) for a, b in zip(tok_s["llmesh"], tok_s["reference"], strict=True)]

    def serving(name: str) -> float:
        return float(systems[name].get("serving_cpu_us_per_token", {}).get("total", math.nan))

    return {
        "concurrency": c,
        "blocks_per_system": opts.paired_blocks,
        "requests_per_block": per_block,
        "order": [n for n, _ in blocks],
        "blocks": [{"system": n, **{k: s[k] for k in _BLOCK_KEYS},
                    "serving_cpu_us_per_token": s.get("serving_cpu_us_per_token")}
                   for n, s in summaries],
        "llmesh": systems["llmesh"],
        "reference": systems["reference"],
        "output_tokens_per_s_ratio": ratio(systems["llmesh"]["output_tokens_per_s"],
                                           systems["reference"]["output_tokens_per_s"]),
        "pair_ratios": pair_ratios,
        "serving_cpu_ratio": ratio(serving("llmesh"), serving("reference")),
        "note": "both systems up; blocks of requests_per_block requests at concurrency streams, the "
                "systems alternating in pairs (order); pair i sends the same requests to both; llmesh "
                "and reference: every block of the system added up; output_tokens_per_s_ratio: llmesh "
                "over reference over all blocks; pair_ratios: of each pair's two blocks; "
                "serving_cpu_ratio: CPU per output token without the engine processes",
    }


# --------------------------------------------------------------------------- overhead


def _fake_mesh_config(opts: BenchOptions, *, token_delay_ms: float, batch_max_wait_ms: float | None,
                      stream_interval: int = 1, stream_max_delay_ms: int = 0,
                      gateway_processes: int = 1) -> Any:
    from llmesh.meshconfig import GatewayConfig, MeshConfig, RouterConfig, WorkerConfig
    from llmesh.procs import free_port

    router_settings = _router_settings(opts, batch_max_wait_ms)
    gateway_settings = _gateway_settings(opts)
    if stream_interval != 1:
        gateway_settings["stream_interval"] = stream_interval
    if stream_max_delay_ms:
        gateway_settings["stream_max_delay_ms"] = stream_max_delay_ms
    return MeshConfig(
        model=str(opts.model_dir),
        served_model_name=opts.model_name,
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), settings=gateway_settings,
                              processes=gateway_processes),
        router=RouterConfig(settings=router_settings),
        workers=[WorkerConfig(zone="zone-a", engine="fake",
                              settings={"fake_token_delay_ms": token_delay_ms, "fake_max_running": 256,
                                        "max_num_seqs": 256})],
    )


class _TokenPathDriver:
    """Sends token ids straight to a worker's or a router's Generate (no tokenizer, no postprocessor)."""

    def __init__(self, target: str, kind: str, model_dir: Path, model: str) -> None:
        from tokenizers import Tokenizer

        self.target = target
        self.kind = kind
        self.model = model
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._channel: Any = None
        self._stub: Any = None

    async def __aenter__(self) -> _TokenPathDriver:
        import grpc

        self._channel = grpc.aio.insecure_channel(self.target)
        if self.kind == "worker":
            from llmesh.worker.v1 import worker_pb2_grpc

            self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        else:
            from llmesh.router.v1 import router_pb2_grpc

            self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def __call__(self, request: BenchRequest) -> RequestResult:
        import grpc

        from llmesh.common.v1 import common_pb2

        ids = self.tokenizer.encode(request.prompt, add_special_tokens=False).ids
        token_request = common_pb2.TokenRequest(
            request_id=uuid.uuid4().hex, model=self.model, prompt_token_ids=ids,
            sampling=common_pb2.EngineSampling(max_tokens=request.max_tokens, ignore_eos=True,
                                               temperature=0.0),
        )
        if self.kind == "worker":
            from llmesh.worker.v1 import worker_pb2

            req: Any = worker_pb2.GenerateRequest(request=token_request)
        else:
            from llmesh.router.v1 import router_pb2

            req = router_pb2.GenerateRequest(request=token_request)
        result = RequestResult()
        start = time.perf_counter()
        last: float | None = None
        tokens = 0
        try:
            async for item in self._stub.Generate(req, timeout=60):
                if item.HasField("delta") and item.delta.token_ids:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.chunk_gaps_s.append(now - last)
                    last = now
                    tokens += len(item.delta.token_ids)
        except grpc.aio.AioRpcError as err:
            result.error = f"{err.code().name}: {err.details()}"
        result.latency_s = time.perf_counter() - start
        result.output_tokens = tokens
        result.ok = not result.error and tokens > 0
        return result


async def interleaved(drivers: dict[str, Any], requests: Sequence[BenchRequest],
                      warmup: int = 5, gap_s: float = 0.0) -> dict[str, LevelResult]:
    """Sequential requests on every path, each request sent down each path in turn (the
    order rotating from one request to the next), so a burst of background load falls on
    all paths alike: on a shared machine the differences between paths (the added
    figures) then hold still, where one path after the other they moved by several ms.
    ``gap_s``: a pause before every measured request."""
    names = list(drivers)
    async with contextlib.AsyncExitStack() as stack:
        for driver in drivers.values():
            await stack.enter_async_context(driver)
        for req in requests[:warmup]:
            for name in names:
                await drivers[name](req)
        results: dict[str, list[RequestResult]] = {name: [] for name in names}
        start = time.perf_counter()
        for i, req in enumerate(requests[warmup:]):
            turn = i % len(names)
            for name in names[turn:] + names[:turn]:
                if gap_s:
                    await asyncio.sleep(gap_s)
                results[name].append(await drivers[name](req))
        duration = time.perf_counter() - start
    return {name: LevelResult(1, results[name], duration) for name in names}


def paired_differences_ms(levels: dict[str, LevelResult], path: str, base: str) -> list[float]:
    """``path``'s TTFT minus ``base``'s for each request both answered, in ms."""
    return [(a.ttft_s - b.ttft_s) * 1000.0 for a, b in zip(levels[path].results, levels[base].results,
                                                          strict=True) if a.ok and b.ok]


def paired_added_ms(levels: dict[str, LevelResult], path: str, base: str) -> float:
    """Median over requests of ``path``'s TTFT minus ``base``'s for the same request."""
    pairs = paired_differences_ms(levels, path, base)
    return statistics.median(pairs) if pairs else float("nan")


def _path_figures(level: LevelResult) -> dict[str, Any]:
    s = level.summary()
    return {k: s[k] for k in ("requests", "errors", "error_samples", "ttft_ms", "latency_ms", "itl_ms")}


def run_overhead(opts: BenchOptions) -> dict[str, Any]:
    """Per-request cost of router and gateway (+ tokenizer, postprocessor) over a fake worker."""
    config = _fake_mesh_config(opts, token_delay_ms=0.0, batch_max_wait_ms=None)
    spec = WorkloadSpec(prompt_words=(16, 64), output_tokens=(32, 32))
    requests = make_workload(opts.overhead_requests + 5, seed=opts.seed + 4242, spec=spec)
    print("llmesh bench: starting a fake-engine mesh for the overhead measurement", file=sys.stderr)
    with _started_mesh(config, opts.log_dir / "overhead") as mesh:
        worker = next(p for p in mesh.procs if p.tier == "worker")
        # No router process with router_transport local: no path straight to it.
        router = next((p for p in mesh.procs if p.tier == "router"), None)
        gateway = f"{config.gateway.host}:{config.gateway.port}"
        http = mesh.state()["http"]
        drivers: dict[str, Any] = {
            "worker (direct)": _TokenPathDriver(worker.address, "worker", opts.model_dir, opts.model_name),
            "gateway gRPC": LlmeshGrpcDriver(gateway, opts.model_name),
            "gateway HTTP": OpenAIHttpDriver(http, opts.model_name),
        }
        if router is not None:
            drivers["router (direct)"] = _TokenPathDriver(router.address, "router", opts.model_dir,
                                                          opts.model_name)
        with _bar(opts, " overhead paths (interleaved)", 1) as bar:
            levels = asyncio.run(interleaved(drivers, requests))
            bar.update()
        paths = {name: _path_figures(level) for name, level in levels.items()}

    def p50(path: str, fig: str) -> float:
        return float(paths[path][fig]["p50"]) if path in paths else float("nan")

    added = {
        "router_ttft_p50": p50("router (direct)", "ttft_ms") - p50("worker (direct)", "ttft_ms"),
        "router_total_p50": p50("router (direct)", "latency_ms") - p50("worker (direct)", "latency_ms"),
        "router_gateway_ttft_p50": p50("gateway gRPC", "ttft_ms") - p50("worker (direct)", "ttft_ms"),
        "router_gateway_total_p50": p50("gateway gRPC", "latency_ms") - p50("worker (direct)", "latency_ms"),
        "router_gateway_http_ttft_p50": p50("gateway HTTP", "ttft_ms") - p50("worker (direct)", "ttft_ms"),
    }
    return {
        "engine": "fake (0 ms per token)",
        "requests_per_path": opts.overhead_requests,
        "output_tokens_per_request": spec.output_tokens[0],
        "paths": paths,
        "added_ms": {k: round(v, 3) for k, v in added.items() if not math.isnan(v)},
        "added_paired_ms": {
            key: round(paired_added_ms(levels, path, "worker (direct)"), 3)
            for key, path in (("router_ttft_p50", "router (direct)"),
                              ("router_gateway_ttft_p50", "gateway gRPC"),
                              ("router_gateway_http_ttft_p50", "gateway HTTP"))
            if path in levels
        },
        "note": "gateway paths include the tokenizer and postprocessor calls; sequential requests, "
                "each sent down every path in turn; added_paired_ms: median of per-request differences",
    }


# --------------------------------------------------------------------------- batching


def run_batching(opts: BenchOptions) -> dict[str, Any]:
    """The router's batching window on (``batching_wait_ms``) vs off (0) on fake-engine meshes."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for label, wait_ms in (("on", opts.batching_wait_ms), ("off", 0.0)):
        config = _fake_mesh_config(opts, token_delay_ms=opts.fake_token_delay_ms, batch_max_wait_ms=wait_ms)
        print(f"llmesh bench: fake-engine mesh with batch_max_wait_ms={wait_ms:g}", file=sys.stderr)
        with _started_mesh(config, opts.log_dir / f"batching-{label}") as mesh:
            cpu = CpuMeter(_mesh_cpu_groups(mesh.state()["processes"]))
            driver = LlmeshGrpcDriver(f"{config.gateway.host}:{config.gateway.port}", opts.model_name)
            levels = asyncio.run(_drive_levels(opts, f"batch {label}", driver, cpu, opts.batching_levels))
        runs[label] = [lv.summary() for lv in levels]
    comparison = []
    for on, off in zip(runs["on"], runs["off"], strict=True):
        comparison.append({
            "concurrency": on["concurrency"],
            "on_tok_s": on["output_tokens_per_s"], "off_tok_s": off["output_tokens_per_s"],
            "on_ttft_p50_ms": on["ttft_ms"]["p50"], "off_ttft_p50_ms": off["ttft_ms"]["p50"],
            "on_ttft_p99_ms": on["ttft_ms"]["p99"], "off_ttft_p99_ms": off["ttft_ms"]["p99"],
            "on_cpu_s_per_1k": on["cpu_s_per_1k_tokens"].get("total"),
            "off_cpu_s_per_1k": off["cpu_s_per_1k_tokens"].get("total"),
            "on_errors": on["errors"], "off_errors": off["errors"],
        })
    return {"engine": f"fake ({opts.fake_token_delay_ms:g} ms per token)", "on_ms": opts.batching_wait_ms,
            "runs": runs, "comparison": comparison}


# --------------------------------------------------------------------------- capacity


class _OwnConnectionDriver(LlmeshGrpcDriver):
    """A driver whose channel has a connection of its own (a local subchannel pool;
    channels to one target otherwise share one)."""

    async def __aenter__(self) -> _OwnConnectionDriver:
        from llmesh.client import AsyncClient

        self._client = AsyncClient(self.target, api_key=self.api_key, timeout=self.timeout_s, max_attempts=1,
                                   options=[("grpc.use_local_subchannel_pool", 1)])
        return self


class _SpreadDriver:
    """Requests round-robin over several connections: with SO_REUSEPORT the kernel gives
    each connection to one of a tier's processes, so one connection would load one."""

    def __init__(self, drivers: Sequence[LlmeshGrpcDriver]) -> None:
        self.drivers = list(drivers)
        self._next = itertools.count()

    async def __aenter__(self) -> _SpreadDriver:
        for driver in self.drivers:
            await driver.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for driver in self.drivers:
            await driver.__aexit__(*exc)

    async def __call__(self, request: BenchRequest) -> RequestResult:
        return await self.drivers[next(self._next) % len(self.drivers)](request)


def run_capacity(opts: BenchOptions) -> dict[str, Any]:
    """The serving layer's own cost: the whole mesh over the step-based fake engine.

    ``capacity_streams`` concurrent streams (GenerateStream calls, or streamed HTTP
    completions with ``capacity_protocol`` http) of ``capacity_tokens`` tokens each
    (ignore_eos, greedy), the fake producing one token per running request every
    ``capacity_step_ms``, as an accelerator does per engine step. Reports tokens/s to the
    client and CPU microseconds per output token of every tier (from /proc, user+system,
    each tier's whole process tree); the load generator's own CPU is not counted.
    ``stream_interval`` is the gateway's deployment default (tokens per delta): the report
    says how many tokens a delta carried and the gaps between deltas (ITL at interval 1).
    """
    config = _fake_mesh_config(opts, token_delay_ms=opts.capacity_step_ms, batch_max_wait_ms=None,
                               stream_interval=opts.stream_interval,
                               stream_max_delay_ms=opts.stream_max_delay_ms,
                               gateway_processes=opts.gateway_processes)
    spec = WorkloadSpec(prompt_words=(16, 48), output_tokens=(opts.capacity_tokens, opts.capacity_tokens))
    total = opts.capacity_streams * opts.capacity_requests_per_stream
    requests = make_workload(total, seed=opts.seed + 777, spec=spec)
    print(f"llmesh bench: capacity, fake engine {opts.capacity_step_ms:g} ms per step, "
          f"{opts.capacity_streams} streams x {opts.capacity_tokens} tokens over {opts.capacity_protocol}, "
          f"stream interval {opts.stream_interval}, {opts.gateway_processes} gateway process(es)",
          file=sys.stderr)
    with _started_mesh(config, opts.log_dir / "capacity") as mesh:
        state = mesh.state()
        cpu = CpuMeter(_mesh_cpu_groups(state["processes"]))
        # With several gateway processes the driver opens several connections (the kernel
        # gives each to one process); one connection would load one process only.
        target = f"{config.gateway.host}:{config.gateway.port}"
        driver: Any
        if opts.capacity_protocol == "http":
            # A pool of connections: SO_REUSEPORT spreads them over gateway processes.
            driver = OpenAIHttpDriver(state["http"], opts.model_name)
        elif opts.gateway_processes == 1:
            driver = LlmeshGrpcDriver(target, opts.model_name)
        else:
            driver = _SpreadDriver([_OwnConnectionDriver(target, opts.model_name)
                                    for _ in range(16 * opts.gateway_processes)])

        async def drive() -> LevelResult:
            async with driver:
                # Warm every tier (channels, first-request paths) outside the measurement.
                await run_level(driver, make_workload(4, seed=opts.seed, spec=spec), 4)
                if opts.capacity_idle_s > 0:
                    # What the mesh costs doing nothing (health, load reports, keepalives).
                    before = cpu.sample()
                    started = time.monotonic()
                    await asyncio.sleep(opts.capacity_idle_s)
                    idle_s = time.monotonic() - started
                    idle.update({tier: cpu_s / idle_s * 1000.0 for tier, cpu_s in
                                 CpuMeter.delta(before, cpu.sample()).trees.items()})
                with _bar(opts, " capacity", total) as bar:
                    return await run_level(driver, requests, opts.capacity_streams, cpu=cpu,
                                           on_result=lambda _r: bar.update())

        idle: dict[str, float] = {}
        level = asyncio.run(drive())
    summary = level.summary()
    tokens = summary["output_tokens"]
    idle_ms_per_s: dict[str, float] | None = None
    if idle:
        idle_ms_per_s = {tier: round(ms, 2) for tier, ms in idle.items()}
        idle_ms_per_s["total"] = round(sum(idle.values()), 2)
    rate = summary["output_tokens_per_s"]
    us_per_token = {tier: _round_us(cpu_s / tokens) if tokens else None
                    for tier, cpu_s in level.cpu_s.items()}
    us_per_token["total"] = _round_us(sum(level.cpu_s.values()) / tokens) if tokens else None
    ok = [r for r in level.results if r.ok]
    deltas = sum(len(r.chunk_gaps_s) + 1 for r in ok)
    return {
        "engine": f"fake, step-based, {opts.capacity_step_ms:g} ms per step",
        "streams": opts.capacity_streams,
        "protocol": opts.capacity_protocol,
        "tokens_per_request": opts.capacity_tokens,
        "stream_interval": opts.stream_interval,
        "gateway_processes": opts.gateway_processes,
        "worker_transport": opts.worker_transport,
        "postprocessor_transport": opts.postprocessor_transport,
        "tokenizer_transport": opts.tokenizer_transport,
        "router_transport": opts.router_transport,
        "stream_max_delay_ms": opts.stream_max_delay_ms or "gateway default",
        "deltas_per_request": round(deltas / len(ok), 1) if ok else None,
        "tokens_per_delta": round(tokens / deltas, 2) if deltas else None,
        "delta_gap_ms": summary["itl_ms"],
        "requests": total,
        "errors": summary["errors"],
        "error_samples": summary["error_samples"],
        "output_tokens": tokens,
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "ttft_ms": summary["ttft_ms"],
        "cpu_us_per_token": us_per_token,
        "idle_s": opts.capacity_idle_s,
        "idle_cpu_ms_per_s": idle_ms_per_s,
        "idle_us_per_token": (round(idle_ms_per_s["total"] * 1000.0 / rate, 1)
                              if rate and idle_ms_per_s else None),
        "note": "client CPU excluded; on a 2-core box the load generator competes with the mesh; "
                "idle_us_per_token: the idle mesh's CPU per second over this run's tokens per second "
                "(the part of cpu_us_per_token the mesh spends whatever the load)",
    }


def _round_us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


# --------------------------------------------------------------------------- CLI


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive = _at_least(1)
_count = _at_least(0)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmesh bench",
        description="Benchmark llmesh against vllm serve (the reference) on the same model, engine "
        "settings and machine, one after the other. Closed-loop seeded load at several concurrency "
        "levels; reports output tokens/s, TTFT and inter-token latency (P50/P99), errors, CPU seconds "
        "per tier per 1k output tokens and the llmesh/reference ratio of every figure; also the "
        "TTFT llmesh adds at one stream measured in pairs (both systems up, one request at a time) and "
        "the throughput at the top level in blocks alternating between the two (both up), "
        "the per-request overhead of router+gateway (fake engine) and the batching window on vs off. "
        "Writes <out>/bench.json and <out>/bench.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument("--quick", action="store_true",
                   help=f"fewer requests per level ({QUICK_REQUESTS_PER_STREAM} per stream, at least "
                   f"{QUICK_MIN_REQUESTS}) and shorter overhead/batching phases (< 10 min on 2 cores)")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="model name known to `llmesh model`, or a model directory")
    g.add_argument("--concurrency", type=_levels, default=DEFAULT_LEVELS,
                   help="comma-separated concurrent-stream levels")
    g.add_argument("--requests-per-stream", type=int, default=4,
                   help="requests per level = max(--min-requests, this x concurrency)")
    g.add_argument("--min-requests", type=int, default=16, help="least requests per level")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and output lengths")
    g.add_argument("--prompt-words", type=_range, default=(16, 96), help="words per prompt, LO-HI (uniform)")
    g.add_argument("--output-tokens", type=_range, default=(96, 128),
                   help="max_tokens per request, LO-HI (uniform; EOS ignored, so exactly this many)")
    g.add_argument("--llmesh-protocol", choices=("http", "grpc"), default="http",
                   help="drive llmesh through its OpenAI HTTP listener (same client as the reference) "
                   "or through gRPC GenerateStream")
    g.add_argument("--skip-llmesh", action="store_true", help="do not run the llmesh phase")
    g.add_argument("--skip-reference", action="store_true", help="do not run the vllm serve phase")
    g.add_argument("--skip-overhead", action="store_true", help="do not measure router+gateway overhead")
    g.add_argument("--skip-batching", action="store_true", help="do not compare batching window on/off")
    g.add_argument("--skip-paired-ttft", action="store_true",
                   help="do not run the paired phases (llmesh and the reference up at once): the added "
                   "TTFT in pairs and the throughput in alternating blocks")
    e = p.add_argument_group("engine settings (both systems)")
    e.add_argument("--max-num-seqs", type=int, default=32, help="vLLM max_num_seqs")
    e.add_argument("--max-model-len", type=int, default=2048, help="vLLM max_model_len")
    e.add_argument("--kvcache-gb", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    e.add_argument("--omp-threads-bind", default="0-1",
                   help="VLLM_CPU_OMP_THREADS_BIND of the engine (all cores for each system, one at a time)")
    t = p.add_argument_group("existing servers instead of starting them")
    t.add_argument("--target", default="", help="gRPC address of a running llmesh gateway")
    t.add_argument("--target-http", default="", help="base URL of a running llmesh gateway's HTTP listener")
    t.add_argument("--mesh-state", default=None,
                   help="mesh.json of the running mesh (pids for CPU figures); default: `llmesh up`'s")
    t.add_argument("--reference-url", default="", help="base URL of a running OpenAI-compatible reference")
    t.add_argument("--reference-pid", type=int, default=0, help="pid of the running reference (CPU figures)")
    o = p.add_argument_group("overhead and batching phases")
    o.add_argument("--overhead-requests", type=int, default=200,
                   help="sequential requests per path (each request goes down every path in turn)")
    o.add_argument("--paired-ttft-requests", type=_positive, default=None,
                   help="prompts of the paired TTFT phase: llmesh and the reference up at once, one "
                   "request at a time, each prompt sent to both in turn (the order alternating); the "
                   f"added TTFT is the median of the differences (default {PAIRED_REQUESTS}; "
                   f"{QUICK_PAIRED_REQUESTS} with --quick unless given)")
    o.add_argument("--paired-ttft-tokens", type=_positive, default=8,
                   help="max_tokens of each request of the paired TTFT phase")
    o.add_argument("--paired-ttft-gap-s", type=float, default=PAIRED_GAP_S,
                   help="pause before each request of the paired TTFT phase (a vLLM engine's worker "
                   "busy-polls for a second after its last step, on the cores the other engine uses)")
    o.add_argument("--paired-blocks", type=_count, default=4,
                   help="blocks per system of the paired throughput phase: with both systems up, "
                   "closed-loop load at --paired-concurrency streams, one system at a time, the "
                   "systems alternating in pairs (llmesh, reference, reference, llmesh, ...), each "
                   "block the requests of a level; the throughput ratio over all blocks then carries "
                   "no drift of the machine between the two systems' levels (0: no such phase)")
    o.add_argument("--paired-concurrency", type=_positive, default=None,
                   help="streams of each block of the paired throughput phase (default: the highest "
                   "--concurrency level)")
    o.add_argument("--batching-concurrency", type=_levels, default=(1, 32),
                   help="levels of the batching phase")
    o.add_argument("--batching-wait-ms", type=float, default=5.0, help="router batch_max_wait_ms when on")
    c = p.add_argument_group("capacity phase (the serving layer's own CPU cost)")
    c.add_argument("--capacity", action="store_true",
                   help="run only the capacity phase: the whole mesh over the step-based fake engine")
    c.add_argument("--with-capacity", action="store_true",
                   help="add the capacity phase to the other phases (one run: fake-engine capacity and "
                   "the real engine against vllm serve)")
    c.add_argument("--capacity-streams", type=int, default=128,
                   help="concurrent streams (requests in flight)")
    c.add_argument("--capacity-tokens", type=int, default=256, help="output tokens per request")
    c.add_argument("--capacity-step-ms", type=float, default=2.0,
                   help="fake engine step time: every running request gets one token per step")
    c.add_argument("--capacity-requests-per-stream", type=int, default=1,
                   help="requests each stream sends one after the other")
    c.add_argument("--capacity-idle-s", type=float, default=5.0,
                   help="seconds the warmed-up capacity mesh is measured idle before the load "
                   "(its CPU per second per tier; 0 = not measured)")
    c.add_argument("--capacity-protocol", choices=("grpc", "http"), default="grpc",
                   help="grpc: GenerateStream calls; http: streamed /v1/completions, as the real-engine "
                   "phase drives llmesh (with --capacity-step-ms near a real engine's step time, the "
                   "serving cost at real-engine rates without the engine)")
    c.add_argument("--stream-interval", type=int, default=1,
                   help="the gateway's stream_interval in the capacity mesh: tokens per GenerateStream delta "
                   "(1 = a delta per token)")
    c.add_argument("--gateway-processes", type=int, default=1,
                   help="gateway processes in the capacity mesh (its --processes, sharing one port); the "
                   "load is spread over several connections when > 1")
    c.add_argument("--stream-max-delay-ms", type=int, default=0,
                   help="the gateway's stream_max_delay_ms in the capacity mesh (0 = the gateway's default)")
    e.add_argument("--worker-transport", choices=("session", "calls"), default=router_worker_transport(),
                   help="the router's worker_transport in every mesh the bench starts "
                   "(default: the router's default, %(default)s)")
    e.add_argument("--postprocessor-transport", choices=("session", "calls", "local"),
                   default=gateway_transport("postprocessor"),
                   help="the gateway's postprocessor_transport in every mesh the bench starts; local runs "
                   "the postprocessing in the gateway's process, with no postprocessor process "
                   "(default: the gateway's default, %(default)s)")
    e.add_argument("--tokenizer-transport", choices=("session", "calls", "local"),
                   default=gateway_transport("tokenizer"),
                   help="the gateway's tokenizer_transport in every mesh the bench starts; local encodes "
                   "in the gateway's process, with no tokenizer process (default: %(default)s)")
    e.add_argument("--router-transport", choices=("session", "calls", "local"),
                   default=gateway_transport("router"),
                   help="the gateway's router_transport in every mesh the bench starts; local runs the "
                   "router in the gateway's process and event loop, with no router process (the "
                   "overhead phase then has no router (direct) path) (default: %(default)s)")
    o.add_argument("--fake-token-delay-ms", type=float, default=20.0,
                   help="fake engine's delay per token in the batching phase")
    r = p.add_argument_group("output")
    r.add_argument("--out", default="bench-results", help="directory for bench.json, bench.png and logs")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    from llmesh.up import resolve_model
    from services.common.modelinfo import served_model_name

    model_dir = resolve_model(args.model)
    out_dir = Path(args.out)
    quick = args.quick
    return BenchOptions(
        model_dir=model_dir,
        model_name=served_model_name(model_dir, ""),
        levels=args.concurrency,
        requests_per_stream=QUICK_REQUESTS_PER_STREAM if quick else args.requests_per_stream,
        min_requests=QUICK_MIN_REQUESTS if quick else args.min_requests,
        seed=args.seed,
        workload=WorkloadSpec(prompt_words=args.prompt_words, output_tokens=args.output_tokens),
        protocol=args.llmesh_protocol,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kvcache_gb=args.kvcache_gb,
        omp_bind=args.omp_threads_bind,
        out_dir=out_dir,
        log_dir=out_dir / "logs",
        progress=not args.no_progress,
        overhead_requests=min(args.overhead_requests, 60) if quick else args.overhead_requests,
        paired_requests=args.paired_ttft_requests or (QUICK_PAIRED_REQUESTS if quick else PAIRED_REQUESTS),
        paired_tokens=args.paired_ttft_tokens,
        paired_gap_s=max(0.0, args.paired_ttft_gap_s),
        paired_blocks=args.paired_blocks,
        paired_concurrency=args.paired_concurrency or max(args.concurrency),
        batching_levels=args.batching_concurrency,
        batching_wait_ms=args.batching_wait_ms,
        fake_token_delay_ms=args.fake_token_delay_ms,
        capacity_streams=args.capacity_streams,
        capacity_tokens=args.capacity_tokens,
        capacity_step_ms=args.capacity_step_ms,
        capacity_requests_per_stream=args.capacity_requests_per_stream,
        capacity_protocol=args.capacity_protocol,
        capacity_idle_s=args.capacity_idle_s,
        stream_interval=args.stream_interval,
        stream_max_delay_ms=args.stream_max_delay_ms,
        gateway_processes=args.gateway_processes,
        worker_transport=args.worker_transport,
        postprocessor_transport=args.postprocessor_transport,
        tokenizer_transport=args.tokenizer_transport,
        router_transport=args.router_transport,
    )


def _machine() -> str:
    try:
        import psutil

        mem = f", {psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:  # pragma: no cover
        mem = ""
    return f"{os.cpu_count()} cores{mem}, {platform.machine()}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = options_from_args(args)
    started = time.time()
    report: dict[str, Any] = {
        "meta": {
            "command": "llmesh bench " + " ".join(sys.argv[2:] if argv is None else argv),
            "started_unix": round(started, 1),
            "model": opts.model_name,
            "machine": _machine(),
            "seed": opts.seed,
            "quick": bool(args.quick),
            "llmesh_protocol": opts.protocol,
            "engine": {"max_num_seqs": opts.max_num_seqs, "max_model_len": opts.max_model_len,
                       "kvcache_gb": opts.kvcache_gb, "enforce_eager": True,
                       "omp_threads_bind": opts.omp_bind},
            "worker_transport": opts.worker_transport,
        "postprocessor_transport": opts.postprocessor_transport,
        "tokenizer_transport": opts.tokenizer_transport,
        "router_transport": opts.router_transport,
            "workload": {"prompt_words": list(opts.workload.prompt_words),
                         "output_tokens": list(opts.workload.output_tokens),
                         "requests_per_level": {str(c): opts.requests_for(c) for c in opts.levels},
                         "sampling": "temperature 0, ignore_eos, streamed"},
        },
        "systems": {},
    }
    try:
        if args.capacity or args.with_capacity:
            report["capacity"] = run_capacity(opts)
        if args.capacity:
            args.skip_llmesh = args.skip_reference = args.skip_overhead = args.skip_batching = True
            args.skip_paired_ttft = True
        if not args.skip_llmesh:
            report["systems"]["llmesh"] = run_llmesh(opts, args)
        if not args.skip_reference:
            report["systems"]["reference"] = run_reference(opts, args)
        if "llmesh" in report["systems"] and "reference" in report["systems"]:
            report["ratios"] = ratios(report["systems"]["llmesh"]["levels"],
                                      report["systems"]["reference"]["levels"])
        if not (args.skip_llmesh or args.skip_reference or args.skip_paired_ttft):
            report.update(run_paired(opts, args))
        if not args.skip_overhead:
            report["overhead"] = run_overhead(opts)
        if not args.skip_batching:
            report["batching"] = run_batching(opts)
    except (TimeoutError, RuntimeError) as exc:
        print(f"llmesh bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llmesh bench: interrupted", file=sys.stderr)
        return 130
    report["meta"]["duration_s"] = round(time.time() - started, 1)
    json_path = write_json(report, opts.out_dir / "bench.json")
    png_path = plot(report, opts.out_dir / "bench.png")
    print(text_summary(report))
    print(f"\nllmesh bench: wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    if png_path is None:
        print("llmesh bench: no plot (matplotlib is not installed: pip install matplotlib)", file=sys.stderr)
    return 0


__all__ = ["build_parser", "main", "percentile", "reference_argv"]

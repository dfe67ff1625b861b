"""Worker server: build the engine, wire core + servicer, and own the lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.modelinfo import engine_dtype, served_model_name, tokenizer_checksum
from services.common.server import ServerHandle, create_server, run_until_signal
from services.common.sessionwire import SessionMethod
from services.worker import metrics
from services.worker.core import WorkerCore, WorkerIdentity
from services.worker.engine import Engine
from services.worker.servicer import SERVICE_NAME, WorkerServicer
from services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

TIER = "worker"
DEVICES = ("auto", "cpu", "cuda", "npu")
ENGINES = ("vllm", "fake")
EXIT_ENGINE_DEAD = 3
"""Process exit code when the engine died (the supervisor restarts the worker)."""

EngineFactory = Callable[[], Engine]


def resolve_device(requested: str, engine: str = "vllm") -> str:
    """``auto`` -> npu if torch_npu is importable, else cuda if a GPU is visible, else cpu."""
    if requested not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested != "auto":
        return requested
    if engine == "fake":
        return "cpu"
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except Exception:  # a CPU-only torch without CUDA support is fine
        pass
    return "cpu"


def engine_args(settings: WorkerSettings, device: str) -> dict[str, Any]:
    """vLLM AsyncEngineArgs from the settings (None keeps vLLM's default)."""
    model = str(Path(settings.model).expanduser())
    args: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "served_model_name": [served_model_name(model, settings.served_model_name)],
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "data_parallel_size": settings.data_parallel_size,
        "data_parallel_backend": settings.data_parallel_backend,
        "dtype": engine_dtype(settings.dtype, model, device),
        "enforce_eager": settings.enforce_eager,
        "enable_expert_parallel": settings.enable_expert_parallel,
        "trust_remote_code": settings.trust_remote_code,
        "scheduling_policy": settings.scheduling_policy,
    }
    if device in ("cuda", "npu"):
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
    optional = {
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_model_len": settings.max_model_len,
        "block_size": settings.block_size,
        "quantization": settings.quantization,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "max_lora_rank": settings.max_lora_rank,
        "seed": settings.seed,
        "data_parallel_size_local": settings.data_parallel_size_local,
        "data_parallel_start_rank": settings.data_parallel_start_rank,
        "data_parallel_address": settings.data_parallel_address or None,
        "data_parallel_rpc_port": settings.data_parallel_rpc_port,
        "distributed_executor_backend": settings.distributed_executor_backend or None,
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    if settings.enable_lora or settings.lora_modules:
        args["enable_lora"] = True
        args["max_loras"] = max(1, len(settings.lora_modules))
    # Last, so a pass-through argument may refine what llmesh derived (e.g. max_loras);
    # check_engine_args has refused every name that is a setting of its own.
    args.update(settings.engine_args)
    return args


LLMESH_ENGINE_ARGS = frozenset({"model", "tokenizer", "served_model_name", "disable_log_stats",
                                "logits_processors"})
"""Engine arguments llmesh sets itself (the model comes from --model, stats feed GetLoad,
the forced-token logits processor makes resume exact): refused in engine_args."""

EXECUTOR_BACKENDS = ("mp", "ray")


def vllm_engine_arg_names() -> frozenset[str]:
    """The argument names vLLM's AsyncEngineArgs accepts (imports vLLM, no engine start)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def check_engine_args(engine_args: dict[str, Any], known: frozenset[str],
                      owned: frozenset[str]) -> None:
    """Refuse pass-through engine arguments vLLM does not know, or that llmesh owns.

    ``known``: vLLM's EngineArgs names; ``owned``: names set elsewhere (a settings field
    of their own, or by llmesh itself). Each error names the key, and the closest known
    name when there is one, so a typo is not silently dropped or mistaken.
    """
    import difflib

    for key in engine_args:
        if key in owned:
            flag = "--" + key.replace("_", "-")
            hint = (f"set the worker setting {key} ({flag}) instead"
                    if key in WorkerSettings.model_fields else "llmesh sets it itself")
            raise ValueError(f"--engine-args: {key!r} is not allowed here: {hint}")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            maybe = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"--engine-args: unknown vLLM engine argument {key!r}{maybe}; the names are "
                "vLLM's EngineArgs fields (vllm serve --help shows them with dashes)"
            )


def owned_engine_args(known: frozenset[str]) -> frozenset[str]:
    """Engine argument names that engine_args may not set: llmesh's own and every vLLM name
    that is also a WorkerSettings field (one place per fact)."""
    return LLMESH_ENGINE_ARGS | (known & frozenset(WorkerSettings.model_fields))


def default_engine_factory(settings: WorkerSettings, device: str) -> EngineFactory:
    """A blocking constructor for the configured engine (run it in a thread)."""
    if settings.engine == "fake":
        def make_fake() -> Engine:
            from services.worker.fake_engine import FakeEngine

            return FakeEngine(
                settings.model,
                token_delay_ms=settings.fake_token_delay_ms,
                eos_after=settings.fake_eos_after,
                max_running=settings.fake_max_running,
                max_model_len=settings.max_model_len or 0,
                echo=settings.fake_echo,
            )
        return make_fake
    if settings.engine != "vllm":
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {settings.engine!r}")

    def make_vllm() -> Engine:
        from services.worker.vllm_engine import VllmEngine, configure_device_environment, parse_lora_modules

        configure_device_environment(
            device,
            cpu_kvcache_space_gb=settings.cpu_kvcache_space_gb,
            cpu_omp_threads_bind=settings.cpu_omp_threads_bind,
        )
        loras = parse_lora_modules(settings.lora_modules)
        return VllmEngine.build(engine_args(settings, device), loras=loras,
                                vllm_metrics=settings.vllm_metrics)
    return make_vllm


def worker_identity(settings: WorkerSettings, device: str) -> WorkerIdentity:
    model_dir = Path(settings.model).expanduser()
    return WorkerIdentity(
        model=served_model_name(model_dir, settings.served_model_name),
        tokenizer_checksum=tokenizer_checksum(model_dir),
        device=device,
        zone=settings.zone,
        worker_id=settings.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        pid=os.getpid(),
        adapters=tuple(spec.partition("=")[0].strip() for spec in settings.lora_modules),
    )


def check_settings(settings: WorkerSettings) -> None:
    """Fail fast (before any engine starts) on settings that cannot work."""
    if not settings.model:
        raise ValueError("--model is required (a model directory)")
    model_dir = Path(settings.model).expanduser()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {settings.model}: no config.json in that directory")
    if settings.engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {settings.engine!r}")
    if settings.device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {settings.device!r}")
    if settings.frontend_cpus:
        from services.worker.affinity import check_frontend_cpus

        check_frontend_cpus(settings.frontend_cpus, settings.cpu_omp_threads_bind)
    for spec in settings.lora_modules:
        if "=" not in spec:
            raise ValueError(f"--lora-modules: {spec!r} is not name=path")
    check_parallel_settings(settings)
    if settings.headless:
        if settings.engine != "vllm":
            raise ValueError("--headless runs vLLM engine processes: it needs --engine vllm")
        if not settings.data_parallel_address and "master_addr" not in settings.engine_args:
            raise ValueError("--headless needs --data-parallel-address (the leader's address)")
    # Checked against vLLM's own EngineArgs wherever vLLM is installed (a fake-engine mesh
    # then refuses the same typos a real one would); importing it costs seconds, so only
    # when there is something to check.
    if settings.engine_args and (settings.engine == "vllm"
                                 or importlib.util.find_spec("vllm") is not None):
        known = vllm_engine_arg_names()
        check_engine_args(settings.engine_args, known, owned_engine_args(known))


def check_parallel_settings(settings: WorkerSettings) -> None:
    """Sizes, backends and the CPU binding of a split engine (no vLLM import)."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(settings, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(settings, name)}")
    dp, local = settings.data_parallel_size, settings.data_parallel_size_local
    if local is not None and not 1 <= local <= dp:
        raise ValueError(f"--data-parallel-size-local must be in [1, data_parallel_size={dp}], got {local}")
    start = settings.data_parallel_start_rank
    if start is not None and not 0 <= start < dp:
        raise ValueError(f"--data-parallel-start-rank must be in [0, {dp}), got {start}")
    if settings.data_parallel_backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"--data-parallel-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                         f"got {settings.data_parallel_backend!r}")
    backend = settings.distributed_executor_backend
    if backend and backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)} "
                         f"(or empty for vLLM's choice), got {backend!r}")
    uses_ray = "ray" in (backend, settings.data_parallel_backend)
    if uses_ray and settings.engine == "vllm" and importlib.util.find_spec("ray") is None:
        raise ValueError("the ray backend needs Ray installed beside vLLM (pip install 'ray[default]')")
    bind = settings.cpu_omp_threads_bind
    if bind and bind not in ("auto", "nobind") and settings.device in ("cpu", "auto"):
        # vLLM's CPU worker binds rank i to the i-th '|' group: one group per local rank.
        local_dp = local if local is not None else dp
        ranks = settings.tensor_parallel_size * settings.pipeline_parallel_size * local_dp
        groups = len(bind.split("|"))
        if groups != ranks:
            raise ValueError(
                f"--cpu-omp-threads-bind {bind!r} has {groups} core group(s) but this node runs "
                f"{ranks} engine rank(s) (tensor x pipeline x local data parallel); give one "
                "'|'-separated group per rank, e.g. 0|1"
            )


@dataclass
class WorkerServer:
    """A worker's gRPC server, its servicer and (after warm-up) its core."""

    settings: WorkerSettings
    handle: ServerHandle
    servicer: WorkerServicer
    identity: WorkerIdentity
    engine_factory: EngineFactory
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0
    engine: Engine | None = None
    task: asyncio.Task[int] | None = None
    _monitor: asyncio.Task[None] | None = None
    _background: list[asyncio.Task[None]] = field(default_factory=list)
    _watchdog: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return self.handle.port

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.handle.port}"

    @property
    def core(self) -> WorkerCore | None:
        return self.servicer.maybe_core

    async def stop(self) -> int:
        """Stop a worker started with :func:`start_worker`; returns its exit code."""
        self.stop_event.set()
        if self.task is not None:
            return await self.task
        return self.exit_code


async def create_worker_server(
    settings: WorkerSettings, *, engine_factory: EngineFactory | None = None
) -> WorkerServer:
    """Bind the server (``settings.port`` 0 picks a port) without starting the engine."""
    check_settings(settings)
    device = resolve_device(settings.device, settings.engine)
    servicer = WorkerServicer(None)
    handle = await create_server(
        settings,
        tier=TIER,
        register=lambda server: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server),
        service_names=[SERVICE_NAME],
        sessions={
            f"/{SERVICE_NAME}/Session": SessionMethod(servicer.Session, worker_pb2.SessionRequest),
            f"/{SERVICE_NAME}/WatchLoad": SessionMethod(
                servicer.WatchLoadFramed, worker_pb2.WatchLoadRequest),
        },
    )
    return WorkerServer(
        settings=settings,
        handle=handle,
        servicer=servicer,
        identity=worker_identity(settings, device),
        engine_factory=engine_factory or default_engine_factory(settings, device),
    )


async def run_worker(ws: WorkerServer) -> int:
    """Lifecycle in one function; returns the process exit code.

    Order and why: the server starts first and reports live (NOT ready), so probes see
    the process during the long engine start; the engine is built in a thread (it blocks
    for tens of seconds); a warm-up generation must succeed before readiness turns
    SERVING; then a monitor runs canaries and watches for engine death, which flips
    readiness to NOT_SERVING and stops the process with a non-zero code. On shutdown
    run_until_signal reports NOT_SERVING, keeps answering for drain_seconds, lets calls
    finish (grace), and only then is the engine closed.
    """
    settings = ws.settings
    loop = asyncio.get_running_loop()

    def on_engine_dead() -> None:
        # Called from the core: stop serving now; the process exits non-zero. The shutdown
        # path reports NOT_SERVING and keeps answering health for drain_seconds, so pollers
        # and watchers see NOT_SERVING rather than just a vanished peer.
        ws.exit_code = EXIT_ENGINE_DEAD
        metrics.SERVING.set(0)
        ws._background.append(loop.create_task(ws.handle.set_ready(False)))
        ws.stop_event.set()

    async def on_health_change(serving: bool) -> None:
        metrics.SERVING.set(1 if serving else 0)
        log.warning("readiness -> %s", "SERVING" if serving else "NOT_SERVING")
        await ws.handle.set_ready(serving)

    async def warmup() -> None:
        ws.engine = await asyncio.to_thread(ws.engine_factory)
        if settings.frontend_cpus:
            from services.worker.affinity import parse_cpu_list, pin_process

            pin_process(parse_cpu_list(settings.frontend_cpus))
        if settings.engine == "vllm":
            # The engine's processes must not outlive this one (see watchdog.py).
            from services.worker.watchdog import engine_processes, start_watchdog

            ws._watchdog = start_watchdog(os.getpid(), engine_processes(os.getpid()))
        core = WorkerCore(ws.engine, ws.identity, on_engine_dead=on_engine_dead)
        ws.servicer.attach(core)
        _install_fake_signals(ws)
        await core.warm_up(settings.warmup_timeout_s)
        log.info("warm-up generation done (model %s, device %s, zone %s)",
                 ws.identity.model, ws.identity.device, ws.identity.zone)
        metrics.SERVING.set(1)
        ws._monitor = asyncio.ensure_future(core.monitor(
            canary_interval_s=settings.canary_interval_s,
            canary_timeout_s=settings.canary_timeout_s,
            check_interval_s=settings.engine_check_interval_s,
            on_change=on_health_change,
        ))

    async def close_monitor() -> None:
        if ws._monitor is not None:
            ws._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ws._monitor

    async def close_engine() -> None:
        if ws.engine is not None:
            try:
                await asyncio.wait_for(ws.engine.shutdown(), 30)
            except TimeoutError:
                log.warning("engine shutdown timed out")
        # The watchdog is left alone: it exits once the engine processes are gone, and
        # kills any that outlive this process.

    try:
        await run_until_signal(
            ws.handle, tier=TIER, grace_seconds=settings.grace_seconds, warmup=warmup,
            close=[close_monitor, close_engine], stop_event=ws.stop_event,
            drain_seconds=settings.drain_seconds, freeze_heap=True,
            latency_slice_us=settings.latency_slice_us,
            latency_nice=settings.latency_nice,
        )
    except Exception:
        log.exception("worker failed")
        return ws.exit_code or 1
    return ws.exit_code


def _install_fake_signals(ws: WorkerServer) -> None:
    """Fake engine only: SIGUSR1 toggles a wedge, SIGUSR2 kills the engine (fault tests)."""
    from services.worker.fake_engine import FakeEngine

    engine = ws.engine
    if not isinstance(engine, FakeEngine) or threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGUSR1, lambda: engine.wedge(not engine.wedged))
        loop.add_signal_handler(signal.SIGUSR2, engine.kill)


async def start_worker(
    settings: WorkerSettings, *, engine_factory: EngineFactory | None = None
) -> WorkerServer:
    """Start a worker in this event loop (tests); ``await ws.stop()`` ends it."""
    ws = await create_worker_server(settings, engine_factory=engine_factory)
    ws.task = asyncio.ensure_future(run_worker(ws))
    return ws


def serve_headless(settings: WorkerSettings) -> int:
    """A multi-node follower (``--headless``): this node's engine processes, no gRPC server.
    Runs in the main thread (it owns SIGTERM); returns the exit code."""
    from services.worker.vllm_engine import configure_device_environment, run_headless

    device = resolve_device(settings.device, settings.engine)
    configure_device_environment(device, cpu_kvcache_space_gb=settings.cpu_kvcache_space_gb,
                                 cpu_omp_threads_bind=settings.cpu_omp_threads_bind)
    return run_headless(engine_args(settings, device))


async def serve(settings: WorkerSettings) -> int:
    """The process entry point: serve until a signal or engine death; the exit code."""
    ws = await create_worker_server(settings)
    log.info("worker listening on %s", ws.address)
    return await run_worker(ws)


__all__ = [
    "EXIT_ENGINE_DEAD",
    "WorkerServer",
    "check_engine_args",
    "create_worker_server",
    "engine_args",
    "resolve_device",
    "run_worker",
    "serve",
    "serve_headless",
    "start_worker",
]

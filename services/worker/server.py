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

from llmesh.worker.v1 import worker_pb2_grpc
from services.common.modelinfo import served_model_name, tokenizer_checksum
from services.common.server import ServerHandle, create_server, run_until_signal
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
        "dtype": settings.dtype,
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
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    if settings.enable_lora or settings.lora_modules:
        args["enable_lora"] = True
        args["max_loras"] = max(1, len(settings.lora_modules))
    return args


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
        return VllmEngine.build(engine_args(settings, device), loras=loras)
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
            drain_seconds=settings.drain_seconds,
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


async def serve(settings: WorkerSettings) -> int:
    """The process entry point: serve until a signal or engine death; the exit code."""
    ws = await create_worker_server(settings)
    log.info("worker listening on %s", ws.address)
    return await run_worker(ws)


__all__ = [
    "EXIT_ENGINE_DEAD",
    "WorkerServer",
    "create_worker_server",
    "engine_args",
    "resolve_device",
    "run_worker",
    "serve",
    "start_worker",
]

"""Readiness follows warm-up, canaries and engine death (fake engine; fast, no lock)."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from llmesh.procs import check_health, free_port, spawn_tier
from llmesh.worker.v1 import worker_pb2
from services.worker.fake_engine import FakeEngine
from services.worker.server import EXIT_ENGINE_DEAD
from services.worker.servicer import SERVICE_NAME

from .conftest import generate, start_running_worker, token_request


async def test_not_serving_until_warm_up(tiny_deepseek_dir: Path) -> None:
    release = threading.Event()

    def slow_engine() -> FakeEngine:
        release.wait(10)
        return FakeEngine(tiny_deepseek_dir, token_delay_ms=0)

    worker = await start_running_worker(tiny_deepseek_dir, engine_factory=slow_engine, wait=False)
    try:
        await asyncio.sleep(0.2)
        assert await worker.readiness() == "NOT_SERVING"
        assert await worker.readiness("") == "SERVING"  # live while the engine starts
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(worker.stub, token_request("early", [5], max_tokens=1))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        release.set()
        await worker.wait_readiness("SERVING")
        assert "warmed_up" in worker.server.handle.events
        tokens, _ = await generate(worker.stub, token_request("late", [5], max_tokens=2))
        assert len(tokens) == 2
    finally:
        release.set()
        assert await worker.close() == 0


async def test_failed_warm_up_never_serves(tiny_deepseek_dir: Path) -> None:
    def broken_engine() -> FakeEngine:
        raise RuntimeError("no device")

    worker = await start_running_worker(tiny_deepseek_dir, engine_factory=broken_engine, wait=False)
    assert worker.server.task is not None
    assert await asyncio.wait_for(worker.server.task, 10) == 1
    assert "ready" not in worker.server.handle.events
    await worker.channel.close()


async def test_wedged_engine_turns_not_serving_and_recovers(tiny_deepseek_dir: Path) -> None:
    worker = await start_running_worker(tiny_deepseek_dir)
    assert worker.engine is not None
    try:
        worker.engine.wedge()
        await worker.wait_readiness("NOT_SERVING", timeout=5)
        worker.engine.wedge(False)
        await worker.wait_readiness("SERVING", timeout=5)
    finally:
        assert await worker.close() == 0


async def test_dead_engine_turns_not_serving_and_exits_non_zero(tiny_deepseek_dir: Path) -> None:
    worker = await start_running_worker(tiny_deepseek_dir, canary_interval_s=30.0)
    assert worker.engine is not None and worker.server.task is not None
    statuses: list[str] = []
    watch = worker.health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))

    async def follow() -> None:
        try:
            async for reply in watch:
                statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        except grpc.aio.AioRpcError:
            pass  # the server went away after reporting NOT_SERVING

    follower = asyncio.ensure_future(follow())
    in_flight = worker.stub.Generate(worker_pb2.GenerateRequest(
        request=token_request("doomed", [5, 6], max_tokens=2000)))
    await in_flight.read()
    worker.engine.kill()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while await in_flight.read() is not grpc.aio.EOF:
            pass
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE  # fails fast, never hangs
    assert await asyncio.wait_for(worker.server.task, 10) == EXIT_ENGINE_DEAD
    await asyncio.wait_for(follower, 5)
    assert statuses == ["SERVING", "NOT_SERVING"]
    await worker.channel.close()


def test_cli_help_and_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from services.worker.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--zone", "--device", "--engine", "--tensor-parallel-size", "--max-num-seqs",
                 "--enable-prefix-caching", "--cpu-kvcache-space-gb", "--fake-token-delay-ms",
                 "--lora-modules"):
        assert flag in out
    assert main(["--model", "/nonexistent"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["--model", "/nonexistent", "--device", "tpu"]) == 2


def test_cli_fake_worker_process(tiny_deepseek_dir: Path, tmp_path: Path) -> None:
    """`llmesh worker --engine fake` serves in a second or so; SIGUSR2 kills its engine -> exit 3."""
    port = free_port()
    proc = spawn_tier(
        "fake-worker", "worker",
        ["--engine", "fake", "--model", str(tiny_deepseek_dir), "--port", str(port), "--zone", "zone-x",
         "--engine-check-interval-s", "0.05"],
        address=f"127.0.0.1:{port}", service=SERVICE_NAME, log_dir=tmp_path,
    )
    try:
        proc.wait_serving(timeout=30)
        assert check_health(proc.address, "") == "SERVING"
        proc.popen.send_signal(signal.SIGUSR2)
        assert proc.popen.wait(15) == EXIT_ENGINE_DEAD
    finally:
        proc.kill()
    log = (tmp_path / "fake-worker.log").read_text()
    assert "engine is dead" in log


@pytest.mark.skipif(sys.platform != "linux", reason="signals")
def test_cli_sigterm_exits_zero(tiny_deepseek_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = spawn_tier(
        "fake-worker-term", "worker",
        ["--engine", "fake", "--model", str(tiny_deepseek_dir), "--port", str(port)],
        address=f"127.0.0.1:{port}", service=SERVICE_NAME, log_dir=tmp_path,
    )
    try:
        proc.wait_serving(timeout=30)
        assert proc.stop() == 0
    finally:
        proc.kill()


async def test_the_engine_check_wakes_a_busy_worker_less_often(tiny_deepseek_dir: Path) -> None:
    """While requests are in flight their outputs report a dead engine at once, so the
    check runs BUSY_CHECK_FACTOR times less often; idle, every engine_check_interval_s."""
    from services.worker.core import BUSY_CHECK_FACTOR

    worker = await start_running_worker(tiny_deepseek_dir, canary_interval_s=30.0,
                                        engine_check_interval_s=0.05, fake_token_delay_ms=10)
    assert worker.engine is not None
    checks: list[float] = []
    plain_check = worker.engine.check_health
    loop = asyncio.get_running_loop()

    async def counting_check() -> None:
        checks.append(loop.time())
        await plain_check()

    worker.engine.check_health = counting_check  # type: ignore[method-assign]
    try:
        call = worker.stub.Generate(worker_pb2.GenerateRequest(
            request=token_request("busy", [5, 6], max_tokens=120, ignore_eos=True)))  # ~1.2 s
        await call.read()
        start = loop.time()
        while await call.read() is not grpc.aio.EOF:
            pass
        busy = [t for t in checks if start < t < loop.time()]
        span = loop.time() - start
        assert BUSY_CHECK_FACTOR > 1 and len(busy) <= span / (0.05 * BUSY_CHECK_FACTOR) + 1, (len(busy), span)
        idle_from = loop.time()
        await asyncio.sleep(0.6)
        idle = [t for t in checks if t > idle_from + 0.25]  # after the last busy sleep ended
        assert len(idle) >= 5, idle
    finally:
        assert await worker.close() == 0


async def test_busy_engine_is_not_wedged(tiny_deepseek_dir: Path) -> None:
    """A canary queued behind real work times out, but callers still get tokens: stay SERVING."""
    worker = await start_running_worker(tiny_deepseek_dir, fake_max_running=1)
    try:
        call = worker.stub.Generate(worker_pb2.GenerateRequest(
            request=token_request("hog", [5, 6], max_tokens=400)))  # ~0.8 s at 2 ms/token
        await call.read()
        for _ in range(25):  # several canary rounds (0.1 s interval, 0.3 s timeout)
            assert await worker.readiness() == "SERVING"
            await asyncio.sleep(0.02)
        call.cancel()
        assert worker.engine is not None
        worker.engine.wedge()  # no progress at all: that is wedged
        await worker.wait_readiness("NOT_SERVING", timeout=5)
        worker.engine.wedge(False)
    finally:
        assert await worker.close() == 0

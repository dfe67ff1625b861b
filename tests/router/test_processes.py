"""Fault tests with real ``llmesh worker --engine fake`` processes: kill -9, SIGSTOP/SIGCONT."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from llmesh.procs import TierProcess
from tests.router.helpers import RouterUnderTest, request, start_router, wait_for
from tests.router.procs import spawn_fake_worker

pytestmark = pytest.mark.chaos


@pytest.fixture
def two_zone_workers() -> Iterator[list[TierProcess]]:
    procs = [spawn_fake_worker("fz-a", "zone-a", delay_ms=20),
             spawn_fake_worker("fz-b", "zone-b", delay_ms=20)]
    try:
        for proc in procs:
            proc.wait_serving(60)
        yield procs
    finally:
        for proc in procs:
            if proc.alive():
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()


async def _stream_and_fault(rut: RouterUnderTest, prompt: list[int], n: int, after: int, fault) -> tuple:  # type: ignore[no-untyped-def]
    """Stream a generation; after ``after`` tokens call ``fault()`` once."""
    tokens: list[int] = []
    final = None
    faulted = False
    async for response in rut.stub.Generate(request(prompt, n), timeout=60):
        if response.HasField("delta"):
            tokens.extend(response.delta.token_ids)
            if not faulted and len(tokens) >= after:
                faulted = True
                fault()
        else:
            final = response.final
    return tokens, final


@pytest.mark.parametrize("transport", ["calls", "session"])
async def test_kill_9_mid_stream_resumes_with_identical_output(
    two_zone_workers: list[TierProcess], transport: str
) -> None:
    a, b = two_zone_workers
    rut = await start_router([(a.address, "zone-a"), (b.address, "zone-b")], worker_transport=transport)
    try:
        prompt = [11, 22, 33, 44]
        undisturbed, final = await rut.generate(prompt, 40)
        assert final.served_by.worker_id == "fz-a" and final.served_by.resumed == 0
        tokens, final = await _stream_and_fault(rut, prompt, 40, 10, lambda: os.kill(a.pid, signal.SIGKILL))
        assert tokens == undisturbed  # one continuous stream, no duplicates, same greedy text
        assert final.served_by.resumed == 1 and final.served_by.worker_id == "fz-b"
        assert final.final.completion_tokens == 40 and final.final.prompt_tokens == len(prompt)
        status = await rut.status()
        assert status[a.address].health != "SERVING"
        # A new request right away goes to the surviving zone.
        _, final = await rut.generate(prompt, 3)
        assert final.served_by.zone == "zone-b"
    finally:
        await rut.close()


async def test_sigstop_ejects_and_sigcont_recovers(two_zone_workers: list[TierProcess]) -> None:
    a, b = two_zone_workers
    rut = await start_router([(a.address, "zone-a"), (b.address, "zone-b")])
    try:
        prompt = [7, 8, 9]
        undisturbed, _ = await rut.generate(prompt, 60)
        # Stop the serving worker mid-stream: the stream must still complete, resumed.
        tokens, final = await _stream_and_fault(rut, prompt, 60, 5, lambda: os.kill(a.pid, signal.SIGSTOP))
        assert tokens == undisturbed
        assert final.served_by.worker_id == "fz-b" and final.served_by.resumed == 1
        status = await rut.status()
        assert status[a.address].health in ("UNREACHABLE", "UNKNOWN")
        for _ in range(3):
            _, final = await rut.generate(prompt, 2)
            assert final.served_by.worker_id == "fz-b"
        os.kill(a.pid, signal.SIGCONT)

        async def back() -> bool:
            return (await rut.status())[a.address].health == "SERVING"

        await wait_for(back, timeout=10)
        await asyncio.sleep(0.6)  # let a circuit opened by the failure reach half-open
        _, final = await rut.generate(prompt, 2)
        assert final.served_by.worker_id == "fz-a"
    finally:
        await rut.close()


async def test_sigstop_while_idle_is_noticed(two_zone_workers: list[TierProcess]) -> None:
    a, b = two_zone_workers
    rut = await start_router([(a.address, "zone-a"), (b.address, "zone-b")])
    try:
        os.kill(a.pid, signal.SIGSTOP)
        await wait_for(lambda: not rut.router.registry.workers[a.address].healthy, timeout=5)
        _, final = await rut.generate([1, 2], 3)
        assert final.served_by.zone == "zone-b" and final.retries == 0
        os.kill(a.pid, signal.SIGCONT)
        await wait_for(lambda: rut.router.registry.workers[a.address].healthy, timeout=10)
    finally:
        await rut.close()


def test_llmesh_router_process_with_workers_file(tmp_path, two_zone_workers: list[TierProcess]) -> None:  # type: ignore[no-untyped-def]
    """`llmesh router --workers-file` serves, lists workers, generates, and stops cleanly."""
    import grpc

    from llmesh.procs import free_port, spawn_tier
    from llmesh.router.v1 import router_pb2, router_pb2_grpc
    from tests.router.procs import LOG_DIR

    a, b = two_zone_workers
    workers_file = tmp_path / "workers.yaml"
    workers_file.write_text(
        f"workers:\n  - address: {a.address}\n    zone: zone-a\n"
        f"  - address: {b.address}\n    zone: zone-b\n    device: npu\n"
    )
    port = free_port()
    proc = spawn_tier(
        "router-cli", "router", ["--port", str(port), "--workers-file", str(workers_file),
                                 "--log-format", "text"],
        address=f"127.0.0.1:{port}", service="llmesh.router.v1.RouterService", log_dir=LOG_DIR,
        env={"LLMESH_ROUTER_ZONES": '["zone-b", "zone-a"]'},
    )
    try:
        proc.wait_serving(30)
        with grpc.insecure_channel(proc.address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            deadline = time.monotonic() + 10
            while True:
                reply = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
                if all(w.health == "SERVING" for w in reply.workers) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert list(reply.zone_ladder) == ["zone-b", "zone-a"]  # from the environment
            by_zone = {w.zone: w for w in reply.workers}
            assert by_zone["zone-b"].device == "npu" and by_zone["zone-a"].pid == a.pid
            responses = list(stub.Generate(request([1, 2, 3], 4), timeout=10))
            finals = [r.final for r in responses if r.HasField("final")]
            assert finals[0].served_by.zone == "zone-b"
        assert proc.stop(10) == 0
    finally:
        proc.kill()


def test_llmesh_router_rejects_bad_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    bad = tmp_path / "workers.json"
    bad.write_text('[{"zone": "zone-a"}]')  # no address
    run = subprocess.run([sys.executable, "-m", "llmesh.cli", "router", "--workers-file", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "address" in run.stderr
    run = subprocess.run([sys.executable, "-m", "llmesh.cli", "router", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "--batch-max-wait-ms" in run.stdout and "LLMESH_ROUTER_ZONES" in run.stdout


async def test_batches_to_a_real_worker_process_are_exact(two_zone_workers: list[TierProcess]) -> None:
    """Batch calls (GenerateBatch) to a real worker process: every stream gets exactly its
    own tokens (the fake engine's greedy output for its prompt)."""
    from prometheus_client import REGISTRY

    from services.worker.fake_engine import FakeModel, fake_greedy
    from tests.router.procs import ensure_model

    a, _ = two_zone_workers
    model = FakeModel.from_dir(ensure_model("tiny-deepseek", quiet=True))

    def batched() -> float:
        count = REGISTRY.get_sample_value("llmesh_router_batch_size_count") or 0.0
        singles = REGISTRY.get_sample_value("llmesh_router_batch_size_bucket", {"le": "1.0"}) or 0.0
        return count - singles

    before = batched()
    rut = await start_router([(a.address, "zone-a")], batch_max_wait_ms=30, batch_max_size=8,
                             worker_capacity=4, max_queue=64)
    try:
        prompts = [[700 + i, 800 + i, 900 + i] for i in range(24)]
        results = await asyncio.gather(*(_collect(rut, p, 8) for p in prompts))
        for prompt, tokens in zip(prompts, results, strict=True):
            assert tokens == fake_greedy(prompt, 8, model)
        assert batched() > before, "no request went in a batch call: the window never opened"
    finally:
        await rut.close()


async def _collect(rut: RouterUnderTest, prompt: list[int], n: int) -> list[int]:
    tokens: list[int] = []
    async for response in rut.stub.Generate(request(prompt, n), timeout=60):
        tokens.extend(response.delta.token_ids)
    return tokens

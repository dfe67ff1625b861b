"""RouterService over real channels, with in-process WorkerService doubles."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llmesh.router.v1 import router_pb2
from services.router.breaker import Circuit
from services.router.core import Router
from services.router.workerapi import WorkerCallError
from tests.router.fakeworker import FakeWorker, RunningFake, next_token, start_fake
from tests.router.helpers import request, start_router, wait_for

TRANSPORTS = ["session", "calls"]
"""Tests of what crosses the worker hop run over both transports (session is the default)."""


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


async def fakes(*zones: str, **kwargs) -> list[RunningFake]:  # type: ignore[no-untyped-def]
    return [await start_fake(FakeWorker(zone=z, worker_id=f"{z}-{i}", **kwargs)) for i, z in enumerate(zones)]


async def stop_all(rut, workers: list[RunningFake]) -> None:  # type: ignore[no-untyped-def]
    await rut.close()
    for worker in workers:
        await worker.stop()


def details(err: grpc.aio.AioRpcError) -> list[object]:
    status = rpc_status.from_call(err)
    out: list[object] = []
    for any_detail in status.details if status else []:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if any_detail.Is(cls.DESCRIPTOR):
                msg = cls()
                any_detail.Unpack(msg)
                out.append(msg)
    return out


async def test_generate_streams_tokens_with_served_by() -> None:
    workers = await fakes("zone-a", "zone-b")
    rut = await start_router([(w.address, w.worker.zone) for w in workers])
    try:
        tokens, final = await rut.generate([1, 2, 3], 6)
        assert tokens == expected_tokens([1, 2, 3], 6)
        assert final.served_by.zone == "zone-a" and final.served_by.worker_id == "zone-a-0"
        assert not final.served_by.degraded and final.served_by.resumed == 0 and final.retries == 0
        assert final.final.completion_tokens == 6 and final.final.prompt_tokens == 3
        assert final.final.finish_reason == 2  # LENGTH
        assert final.final.total_ms >= final.final.ttft_ms > 0
    finally:
        await stop_all(rut, workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_failover_before_first_token_goes_to_next_worker(transport: str) -> None:
    workers = await fakes("zone-a", "zone-b")
    workers[0].worker.fail_before_first = 3
    rut = await start_router([(w.address, w.worker.zone) for w in workers], worker_transport=transport)
    try:
        tokens, final = await rut.generate([5, 6], 5)
        assert tokens == expected_tokens([5, 6], 5)
        assert final.retries == 1 and final.served_by.resumed == 0
        assert final.served_by.zone == "zone-b"
        status = await rut.status()
        # One failure of a worker whose health and load polls still answer: it stays in.
        assert status[workers[0].address].circuit == router_pb2.CIRCUIT_STATE_CLOSED
        for _ in range(2):
            tokens, final = await rut.generate([5, 6], 2)
            assert final.retries == 1 and final.served_by.zone == "zone-b"
        status = await rut.status()
        assert status[workers[0].address].circuit == router_pb2.CIRCUIT_STATE_OPEN
        # After the backoff the circuit half-opens and a trial closes it again.
        breaker = rut.router.registry.workers[workers[0].address].breaker
        await wait_for(lambda: breaker.state is Circuit.HALF_OPEN, timeout=5.0)
        tokens, final = await rut.generate([5, 6], 2)
        assert final.served_by.zone == "zone-a"
        status = await rut.status()
        assert status[workers[0].address].circuit == router_pb2.CIRCUIT_STATE_CLOSED
    finally:
        await stop_all(rut, workers)


async def test_degraded_zone_serves_with_degraded_flag_and_no_zone_is_unavailable() -> None:
    workers = await fakes("zone-a", "kunpeng")
    rut = await start_router([(w.address, w.worker.zone) for w in workers])
    try:
        await workers[0].set_serving(False)
        await wait_for(lambda: not rut.router.registry.workers[workers[0].address].healthy)
        tokens, final = await rut.generate([9], 3)
        assert tokens == expected_tokens([9], 3)
        assert final.served_by.zone == "kunpeng" and final.served_by.degraded
        assert final.served_by.device == "cpu"
        await workers[1].set_serving(False)
        await wait_for(lambda: not rut.router.registry.workers[workers[1].address].healthy)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([9], 3)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        await workers[0].set_serving(True)
        await wait_for(lambda: rut.router.registry.workers[workers[0].address].healthy)
        _, final = await rut.generate([9], 3)
        assert final.served_by.zone == "zone-a"
    finally:
        await stop_all(rut, workers)


async def test_bad_requests_get_clear_errors() -> None:
    workers = await fakes("zone-a")
    rut = await start_router([(workers[0].address, "zone-a")])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([], 3)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        (bad,) = details(err.value)
        assert isinstance(bad, error_details_pb2.BadRequest)
        assert bad.field_violations[0].field == "request.prompt_token_ids"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([1], 3, model="no-such-model")
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.stub.Abort(router_pb2.AbortRequest())
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        # The router is still fine.
        tokens, _ = await rut.generate([1], 2, model="fake-model")
        assert len(tokens) == 2
    finally:
        await stop_all(rut, workers)


async def test_tokenizer_mismatch_is_refused_loudly(caplog: pytest.LogCaptureFixture) -> None:
    workers = await fakes("zone-a", "zone-b")
    workers[1].worker.checksum = "sha256:different"
    with caplog.at_level("ERROR"):
        rut = await start_router(
            [(w.address, w.worker.zone) for w in workers], healthy=1,
            model_checksums={"fake-model": "sha256:fake"},
        )
    try:
        await wait_for(lambda: rut.router.registry.workers[workers[1].address].refused)
        status = await rut.status()
        assert status[workers[1].address].health == "REFUSED"
        assert status[workers[0].address].health == "SERVING"
        assert any("REFUSING" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
        for _ in range(3):
            _, final = await rut.generate([1, 2], 2)
            assert final.served_by.zone == "zone-a"
        await workers[0].set_serving(False)
        await wait_for(lambda: not rut.router.registry.workers[workers[0].address].healthy)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([1, 2], 2)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_all(rut, workers)


async def test_list_workers_reports_everything() -> None:
    workers = await fakes("zone-a", "kunpeng")
    rut = await start_router([(w.address, w.worker.zone) for w in workers])
    try:
        reply = await rut.stub.ListWorkers(router_pb2.ListWorkersRequest())
        assert list(reply.zone_ladder) == ["zone-a", "zone-b", "kunpeng"]
        assert [w.zone for w in reply.workers] == ["zone-a", "kunpeng"]
        a, k = reply.workers
        assert a.worker_id == "zone-a-0" and a.health == "SERVING" and a.pid > 0
        assert a.circuit == router_pb2.CIRCUIT_STATE_CLOSED and a.device == "cpu"
        assert list(a.models) == ["fake-model"] and not a.degraded and k.degraded
    finally:
        await stop_all(rut, workers)


async def test_resume_token_ids_from_upstream_are_not_resent() -> None:
    workers = await fakes("zone-a")
    rut = await start_router([(workers[0].address, "zone-a")])
    try:
        full = expected_tokens([4, 4, 4], 8)
        tokens, final = await rut.generate([4, 4, 4], 8, resume=full[:3], resumed=1)
        assert tokens == full[3:]
        assert final.served_by.resumed == 1
        assert final.final.completion_tokens == 8 and final.final.prompt_tokens == 3
        seen = workers[0].worker.requests[-1]
        # Delivered tokens go to the worker as forced replay steps, not in the prompt.
        assert list(seen.prompt_token_ids) == [4, 4, 4]
        assert list(seen.replay_token_ids) == full[:3]
        assert seen.sampling.max_tokens == 5
    finally:
        await stop_all(rut, workers)


async def test_a_failure_after_upstream_delivered_tokens_is_a_resume() -> None:
    """The retry policy's rule: once the caller has tokens (here from an earlier router),
    the next attempt continues from them and counts as a resume, even if the attempt that
    failed had produced nothing itself."""
    workers = await fakes("zone-a", "zone-b")
    workers[0].worker.fail_before_first = 1
    rut = await start_router([(w.address, w.worker.zone) for w in workers])
    try:
        full = expected_tokens([4, 4, 4], 8)
        tokens, final = await rut.generate([4, 4, 4], 8, resume=full[:3], resumed=1)
        assert tokens == full[3:]
        assert final.served_by.zone == "zone-b"
        assert final.served_by.resumed == 2 and final.retries == 0
        assert list(workers[1].worker.requests[-1].replay_token_ids) == full[:3]
    finally:
        await stop_all(rut, workers)


async def test_max_retries_bounds_the_moves_then_unavailable() -> None:
    from prometheus_client import REGISTRY

    workers = await fakes("zone-a", "zone-a", "zone-b")
    for w in workers:
        w.worker.fail_before_first = 5
    rut = await start_router([(w.address, w.worker.zone) for w in workers], max_retries=1)
    retries = REGISTRY.get_sample_value("llmesh_router_retries_total") or 0.0
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([1, 2], 2)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "failed on 2 attempts" in (err.value.details() or "")
        # One move (counted), then the second failure spends the budget (not a move).
        assert sum(5 - w.worker.fail_before_first for w in workers) == 2
        assert REGISTRY.get_sample_value("llmesh_router_retries_total") == retries + 1
    finally:
        await stop_all(rut, workers)


def _every_worker_out_for_a_moment(rut, workers: list[RunningFake]) -> None:  # type: ignore[no-untyped-def]
    """Open every worker's circuit (as one missed load poll of a silent worker does) and
    fail the requests running on the first one, as when it stops answering."""
    for w in workers:
        rut.router.registry.workers[w.address].breaker.record_failure(answering=False)
    rut.router._dispatchers[workers[0].address].fail_all(
        WorkerCallError("transport", "UNAVAILABLE", "worker stopped answering load polls"))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_moving_request_waits_for_a_worker_to_come_back(transport: str) -> None:
    """No routable worker left while a request must move (its worker failed and the other
    one is out for a moment): it waits (failover_wait_ms) and resumes, losing nothing."""
    workers = await fakes("zone-a", "zone-b", token_delay_s=0.01)
    rut = await start_router([(w.address, w.worker.zone) for w in workers], worker_transport=transport,
                             breaker_base_backoff_s=0.3)
    try:
        tokens: list[int] = []
        final = None
        async for response in rut.stub.Generate(request([5, 6, 7], 30), timeout=30):
            if response.HasField("delta"):
                tokens.extend(response.delta.token_ids)
                if len(tokens) >= 5 and not rut.router.resume_log and all(
                    rut.router.registry.workers[w.address].routable() for w in workers
                ):
                    _every_worker_out_for_a_moment(rut, workers)
            else:
                final = response.final
        assert final is not None and final.served_by.resumed == 1
        assert tokens == expected_tokens([5, 6, 7], 30)
        # A new request while every worker is out fails at once (nothing to wait for).
        _every_worker_out_for_a_moment(rut, workers)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([1, 2], 4)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "no zone can serve" in (err.value.details() or "")
        assert time.monotonic() - started < 0.3  # before any circuit half-opens
    finally:
        await stop_all(rut, workers)


async def test_the_wait_for_a_worker_is_bounded_by_failover_wait_ms() -> None:
    workers = await fakes("zone-a", "zone-b", token_delay_s=0.01)
    rut = await start_router([(w.address, w.worker.zone) for w in workers], failover_wait_ms=0,
                             breaker_base_backoff_s=5.0)
    try:
        tokens: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for response in rut.stub.Generate(request([5, 6, 7], 30), timeout=30):
                tokens.extend(response.delta.token_ids)
                if len(tokens) >= 5 and all(
                    rut.router.registry.workers[w.address].routable() for w in workers
                ):
                    _every_worker_out_for_a_moment(rut, workers)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "no zone can serve" in (err.value.details() or "")
    finally:
        await stop_all(rut, workers)


async def test_a_backoff_past_the_deadline_fails_deadline_exceeded_at_once() -> None:
    workers = await fakes("zone-a", "zone-b")
    workers[0].worker.fail_before_first = 1
    rut = await start_router([(w.address, w.worker.zone) for w in workers],
                             retry_base_backoff_ms=20_000, retry_max_backoff_ms=20_000)
    # No jitter, so the pause is surely 20 s (full jitter could draw a short one).
    rut.router.retry_policy = dataclasses.replace(rut.router.retry_policy, jitter=0.0)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([1, 2], 2, timeout=5)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "while retrying" in (err.value.details() or "")
        assert time.monotonic() - started < 4
    finally:
        await stop_all(rut, workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_client_cancel_aborts_worker_request(transport: str) -> None:
    workers = await fakes("zone-a", token_delay_s=0.05)
    rut = await start_router([(workers[0].address, "zone-a")], worker_transport=transport)
    try:
        call = rut.stub.Generate(request([1, 2], 100, "cancel-me"))
        got = 0
        async for response in call:
            got += len(response.delta.token_ids)
            if got >= 2:
                break
        call.cancel()
        await wait_for(lambda: not workers[0].worker.running, timeout=3)
        await wait_for(lambda: rut.router.registry.workers[workers[0].address].in_flight == 0)
    finally:
        await stop_all(rut, workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_deadline_passes_through(transport: str) -> None:
    workers = await fakes("zone-a", token_delay_s=0.05)
    rut = await start_router([(workers[0].address, "zone-a")], worker_transport=transport)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([1], 100, timeout=0.3)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: not workers[0].worker.running, timeout=3)
    finally:
        await stop_all(rut, workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_abort_rpc_stops_a_running_request(transport: str) -> None:
    workers = await fakes("zone-a", token_delay_s=0.05)
    rut = await start_router([(workers[0].address, "zone-a")], worker_transport=transport)
    try:
        task = asyncio.ensure_future(rut.generate([3], 200, request_id="abort-me"))
        await wait_for(lambda: "abort-me" in workers[0].worker.running)
        await rut.stub.Abort(router_pb2.AbortRequest(request_id="abort-me"))
        tokens, final = await asyncio.wait_for(task, 5)
        assert final.final.finish_reason == 3  # ABORT
        assert len(tokens) < 200
        await wait_for(lambda: not workers[0].worker.running, timeout=3)
    finally:
        await stop_all(rut, workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_batching_window_batches_and_demultiplexes_and_cancels_one(transport: str) -> None:
    """A window's requests go out together (one GenerateBatch call, or one Session message
    of submissions); each gets its own tokens back, and cancelling one aborts only it (an
    Abort call, or an abort by handle)."""
    workers = await fakes("zone-a", token_delay_s=0.02)
    rut = await start_router(
        [(workers[0].address, "zone-a")], batch_max_wait_ms=30, batch_max_size=8, worker_capacity=4,
        max_queue=64, worker_transport=transport,
    )
    try:
        prompts = [[i, i + 1] for i in range(24)]
        # Keep the worker busy so the window opens.
        results = await asyncio.gather(*(rut.generate(p, 6) for p in prompts))
        for p, (tokens, _) in zip(prompts, results, strict=True):
            assert tokens == expected_tokens(p, 6)
        assert max(workers[0].worker.batch_sizes) > 1
        assert rut.router.registry.workers[workers[0].address].in_flight == 0

        # Cancelling one request of a batch aborts only that one.
        fake = workers[0].worker
        fake.batch_sizes.clear()
        fake.batched_ids.clear()
        calls = {f"b{i}": rut.stub.Generate(request([50 + i], 30, f"b{i}")) for i in range(12)}
        tasks = {rid: asyncio.ensure_future(_drain(call)) for rid, call in calls.items()}
        await wait_for(lambda: any(rid in fake.running for rid in fake.batched_ids))
        victim = next(rid for rid in fake.batched_ids if rid in fake.running)
        calls[victim].cancel()
        others = [task for rid, task in tasks.items() if rid != victim]
        outs = await asyncio.gather(*others)
        assert all(len(tokens) == 30 for tokens in outs)
        assert fake.aborted == [victim]
        await asyncio.gather(tasks[victim], return_exceptions=True)
    finally:
        await stop_all(rut, workers)


async def _drain(call) -> list[int]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    async for response in call:
        tokens.extend(response.delta.token_ids)
    return tokens


async def test_overload_is_resource_exhausted_with_retry_info() -> None:
    workers = await fakes("zone-a", token_delay_s=0.05)
    rut = await start_router([(workers[0].address, "zone-a")], worker_capacity=1, max_queue=1)
    try:
        running = asyncio.ensure_future(rut.generate([1], 20))
        await wait_for(lambda: rut.router.registry.workers[workers[0].address].in_flight == 1)
        from prometheus_client import REGISTRY

        state = rut.router.registry.workers[workers[0].address]
        labels = {"worker": state.worker_id, "zone": state.zone}
        # The gauge follows dispatch at once, not at the next load poll.
        assert REGISTRY.get_sample_value("llmesh_router_worker_in_flight", labels) == 1
        queued = asyncio.ensure_future(rut.generate([2], 2))
        await wait_for(lambda: rut.router.admission.depth() == 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([3], 2)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        (retry,) = details(err.value)
        assert isinstance(retry, error_details_pb2.RetryInfo)
        assert retry.retry_delay.ToMilliseconds() >= 100
        assert REGISTRY.get_sample_value("llmesh_router_queue_depth", {"priority": "0"}) == 1
        assert (REGISTRY.get_sample_value("llmesh_router_rejected_total") or 0) >= 1
        assert REGISTRY.get_sample_value(
            "llmesh_router_admission_refused_total", {"reason": "queue_full"}) >= 1
        # One queue for every priority: a higher one displaces the queued lower one.
        other = asyncio.ensure_future(rut.generate([4], 2, priority=1))
        with pytest.raises(grpc.aio.AioRpcError) as displaced:
            await queued
        assert displaced.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "displaced" in (displaced.value.details() or "")
        (t1, _), (t4, _) = await asyncio.gather(running, other)
        assert len(t1) == 20 and len(t4) == 2
    finally:
        await stop_all(rut, workers)


async def test_prefix_affinity_keeps_a_prefix_on_one_worker() -> None:
    workers = await fakes("zone-a", "zone-a", "zone-a")
    rut = await start_router([(w.address, "zone-a") for w in workers], affinity_prefix_tokens=3)
    try:
        homes = set()
        for i in range(4):
            # Same first 3 tokens (a shared system prompt), different tails.
            _, final = await rut.generate([77, 78, 79, i], 1)
            homes.add(final.served_by.worker_id)
        assert len(homes) == 1
        spread = set()
        for i in range(30):
            _, final = await rut.generate([i, 1000 + i, 5], 1)
            spread.add(final.served_by.worker_id)
        assert len(spread) == 3
    finally:
        await stop_all(rut, workers)


async def test_dns_targets_add_and_remove_workers() -> None:
    workers = await fakes("zone-b", "zone-b")
    answers = {"addresses": [workers[0].address]}

    async def resolver(host: str, port: int) -> list[str]:
        assert host == "workers.llmesh.svc" and port == 7000
        return list(answers["addresses"])

    from tests.router.helpers import settings

    router = Router(
        settings([], dns_targets=[{"name": "workers.llmesh.svc:7000", "zone": "zone-b"}],
                 dns_interval_s=0.05),
        connect=_grpc_connect, resolver=resolver,
    )
    try:
        await router.start()
        assert [w.address for w in router.registry] == [workers[0].address]
        answers["addresses"] = [w.address for w in workers]
        await wait_for(lambda: len(router.registry) == 2)
        await wait_for(lambda: all(w.healthy for w in router.registry))
        assert {w.zone for w in router.registry} == {"zone-b"}
        answers["addresses"] = [workers[1].address]
        await wait_for(lambda: [w.address for w in router.registry] == [workers[1].address])
    finally:
        await router.close()
        for worker in workers:
            await worker.stop()


def _grpc_connect(address: str):  # type: ignore[no-untyped-def]
    from services.router.workerclient import GrpcWorkerClient

    return GrpcWorkerClient(address)


async def test_expected_checksum_comes_from_the_tokenizer_tier() -> None:
    from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

    class Tokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
        async def ListModels(self, request, context):  # type: ignore[no-untyped-def]
            return tokenizer_pb2.ListModelsResponse(models=[
                tokenizer_pb2.TokenizerModel(model="fake-model", tokenizer_checksum="sha256:tok")])

    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(Tokenizer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    workers = await fakes("zone-a", "zone-b")
    workers[1].worker.checksum = "sha256:tok"  # zone-a keeps the default, which differs
    rut = await start_router([(w.address, w.worker.zone) for w in workers], healthy=1,
                             tokenizer_target=f"127.0.0.1:{port}")
    try:
        await wait_for(lambda: rut.router.registry.workers[workers[0].address].refused)
        status = await rut.status()
        assert status[workers[0].address].health == "REFUSED"
        _, final = await rut.generate([1], 2)
        assert final.served_by.zone == "zone-b"
    finally:
        await stop_all(rut, workers)
        await server.stop(0)


async def test_metrics_count_retries_resumes_and_batches() -> None:
    from prometheus_client import REGISTRY

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    before = (value("llmesh_router_retries_total"), value("llmesh_router_batch_size_count"),
              value("llmesh_router_routed_requests_total", {"zone": "zone-b", "degraded": "false"}))
    workers = await fakes("zone-a", "zone-b")
    workers[0].worker.fail_before_first = 3
    rut = await start_router([(w.address, w.worker.zone) for w in workers], breaker_base_backoff_s=30)
    try:
        for _ in range(3):  # three transport failures in a row open the circuit
            await rut.generate([5, 6], 2)
        assert value("llmesh_router_retries_total") == before[0] + 3
        assert value("llmesh_router_batch_size_count") >= before[1] + 2
        assert value("llmesh_router_routed_requests_total",
                     {"zone": "zone-b", "degraded": "false"}) == before[2] + 3
        assert value("llmesh_router_worker_circuit_state", {"worker": "zone-a-0", "zone": "zone-a"}) == 1
        assert value("llmesh_router_worker_healthy", {"worker": "zone-b-1", "zone": "zone-b"}) == 1
    finally:
        await stop_all(rut, workers)


async def test_abort_while_queued_finishes_without_running() -> None:
    workers = await fakes("zone-a", token_delay_s=0.05)
    rut = await start_router([(workers[0].address, "zone-a")], worker_capacity=1)
    try:
        running = asyncio.ensure_future(rut.generate([1], 10, request_id="first"))
        await wait_for(lambda: "first" in workers[0].worker.running)
        queued = asyncio.ensure_future(rut.generate([2], 10, request_id="queued"))
        await wait_for(lambda: rut.router.admission.depth() == 1)
        await rut.stub.Abort(router_pb2.AbortRequest(request_id="queued"))
        await running
        tokens, final = await asyncio.wait_for(queued, 5)
        assert tokens == [] and final.final.finish_reason == 3  # ABORT
        assert all(r.request_id != "queued" for r in workers[0].worker.requests)
    finally:
        await stop_all(rut, workers)


# ---- request faults are the request's, not the worker's -------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_burst_of_rejected_requests_never_takes_a_worker_out(transport: str) -> None:
    """Poison requests (a temperature the engine refuses) interleaved with normal ones:
    the poison gets INVALID_ARGUMENT naming the field, every normal one is served, and
    no worker's circuit moves (issue 16: one such request used to eject every worker)."""
    workers = await fakes("zone-a", "zone-b")
    rut = await start_router([(w.address, w.worker.zone) for w in workers], batch_max_wait_ms=30,
                             batch_max_size=8, worker_capacity=8, worker_transport=transport)
    try:
        async def poison(i: int) -> grpc.aio.AioRpcError:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rut.generate([1, i], 2, temperature=5.0)
            return err.value

        results = await asyncio.gather(*(
            poison(i) if i % 2 else rut.generate([2, i], 3) for i in range(40)
        ))
        bad = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(bad) == 20
        for err in bad:
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
            (violations,) = details(err)
            assert isinstance(violations, error_details_pb2.BadRequest)
            assert violations.field_violations[0].field.endswith("sampling.temperature")
        for i in range(0, 40, 2):  # every normal request got exactly its own tokens
            result = results[i]
            assert not isinstance(result, grpc.aio.AioRpcError)
            assert result[0] == expected_tokens([2, i], 3)
        # Some arrived in batches with poison in them: the batch-mates were still served.
        assert max(workers[0].worker.batch_sizes) > 1
        status = await rut.status()
        for w in workers:
            assert status[w.address].circuit == router_pb2.CIRCUIT_STATE_CLOSED
            assert status[w.address].health == "SERVING"
    finally:
        await stop_all(rut, workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_engine_failure_of_one_request_is_retried_without_blaming_the_worker(transport: str) -> None:
    workers = await fakes("zone-a", "zone-b")
    workers[0].worker.internal_errors = 1
    rut = await start_router([(w.address, w.worker.zone) for w in workers], worker_transport=transport)
    try:
        tokens, final = await rut.generate([5, 6], 4)
        assert tokens == expected_tokens([5, 6], 4)
        assert final.retries == 1 and final.served_by.zone == "zone-b"
        breaker = rut.router.registry.workers[workers[0].address].breaker
        assert breaker.state is Circuit.CLOSED and breaker.failures == 0
        _, final = await rut.generate([5, 6], 2)
        assert final.served_by.zone == "zone-a"
    finally:
        await stop_all(rut, workers)


async def _silence(rut, worker: RunningFake, silent_for_s: float):  # type: ignore[no-untyped-def]
    """Stop watching ``worker`` and mark it silent (streams open, no reports) since
    ``silent_for_s`` ago, as its monitor would after a missed load poll."""
    await rut.router._monitors[worker.address].stop()
    state = rut.router.registry.workers[worker.address]
    state.reachable = False
    state.load_failures = 1
    state.silent_since = asyncio.get_running_loop().time() - silent_for_s
    return state


async def test_a_new_request_waits_for_a_worker_that_fell_silent_a_moment_ago() -> None:
    """The only worker missed a load poll (busy, not gone): a new request waits for it
    (failover_wait_ms from the start of the silence) instead of failing."""
    workers = await fakes("zone-a")
    rut = await start_router([(w.address, w.worker.zone) for w in workers])
    try:
        state = await _silence(rut, workers[0], 0.0)
        call = asyncio.ensure_future(rut.generate([1, 2], 4))
        await asyncio.sleep(0.3)
        assert not call.done()
        state.reachable, state.load_failures, state.silent_since = True, 0, None
        tokens, final = await call
        assert tokens == expected_tokens([1, 2], 4) and final.final.queue_ms >= 250
    finally:
        await stop_all(rut, workers)


async def test_a_new_request_fails_at_once_when_the_worker_has_been_silent_long() -> None:
    workers = await fakes("zone-a")
    rut = await start_router([(w.address, w.worker.zone) for w in workers], failover_wait_ms=2000)
    try:
        await _silence(rut, workers[0], 2.5)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rut.generate([1, 2], 4)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 0.5
    finally:
        await stop_all(rut, workers)


async def test_readiness_follows_a_circuit_that_half_opens_with_time_without_polling() -> None:
    """An idle router re-reads its readiness only when a worker changes or a circuit is
    due to half-open: the worker's only circuit opening turns it NOT_SERVING at once, and
    the backoff ending turns it SERVING again when due, though nothing else happens and
    the periodic re-read is far off."""
    from services.router.server import READINESS_RECHECK_S, SERVICE_NAME

    assert READINESS_RECHECK_S >= 1.0  # not a per-load-poll re-read any more
    workers = await fakes("zone-a")
    rut = await start_router([(w.address, w.worker.zone) for w in workers], breaker_base_backoff_s=0.4)
    handle = rut.server.handle
    handle.readiness_interval_s = 60.0  # only the signals and the due time can move it now
    follower = asyncio.ensure_future(handle.follow_readiness())  # as serve() runs it
    try:
        await wait_for(lambda: handle.followed.get(SERVICE_NAME) is True)
        state = rut.router.registry.workers[workers[0].address]
        state.breaker.record_failure(answering=False)  # a silent worker trips it at once
        rut.router._on_worker_change(state)
        await wait_for(lambda: handle.followed.get(SERVICE_NAME) is False, timeout=1.0)
        due = rut.router.readiness_due()
        assert due is not None and 0.0 <= due <= 0.4
        await wait_for(lambda: handle.followed.get(SERVICE_NAME) is True, timeout=5.0)
        assert rut.router.readiness_due() is None
        # The half-open trial, then its success: the circuit closes and stays ready.
        tokens, final = await rut.generate([5, 6], 2)
        assert tokens == expected_tokens([5, 6], 2) and final.served_by.zone == "zone-a"
        assert state.breaker.state is Circuit.CLOSED
        await wait_for(lambda: handle.followed.get(SERVICE_NAME) is True, timeout=1.0)
    finally:
        follower.cancel()
        await stop_all(rut, workers)

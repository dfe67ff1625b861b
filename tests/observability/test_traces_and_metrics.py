"""One trace per request across every tier, and Prometheus counters that move right.

The test starts its own OTLP/gRPC trace receiver, points every process of a real mesh
(fake engine workers) at it, sends one GenerateStream carrying a client traceparent,
and checks the spans; then it scrapes every process's /metrics.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from llmesh.meshconfig import MeshConfig, OtelConfig, RouterConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from tests.gateway.helpers import request, stream_request, stub

TIERS = ("gateway", "tokenizer", "router", "worker", "postprocessor")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace collector that keeps every span in memory."""

    def __init__(self) -> None:
        self.spans: list[dict[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes
                     if a.key == "service.name"), "",
                )
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append({
                            "service": service, "name": span.name,
                            "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "attributes": {a.key: a.value for a in span.attributes},
                        })
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(0)


def _running_mesh(receiver: tuple[Receiver, int], model_dir: Path, log_dir: Path,
                  mesh_type: type[Mesh] = Mesh) -> Iterator[Mesh]:
    """A fake-engine mesh whose processes export their spans to ``receiver``."""
    _, port = receiver
    config = MeshConfig(
        model=str(model_dir),
        gateway={"port": free_port(), "http_port": free_port(), "settings": {"drain_seconds": 0}},
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 2})],
        otel=OtelConfig(exporter="otlp", endpoint=f"http://127.0.0.1:{port}"),
    )
    os.environ["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    mesh = mesh_type(config, log_dir=log_dir)
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def traced_mesh(receiver, tiny_deepseek_dir: Path, tmp_path_factory) -> Iterator[Mesh]:
    yield from _running_mesh(receiver, tiny_deepseek_dir, tmp_path_factory.mktemp("traced-mesh"))


def _address(mesh: Mesh) -> str:
    return f"{mesh.config.gateway.host}:{mesh.config.gateway.port}"


async def test_one_trace_spans_every_tier_and_continues_the_client(receiver, traced_mesh):
    rec, _ = receiver
    trace_id = os.urandom(16).hex()
    client_span = os.urandom(8).hex()
    traceparent = f"00-{trace_id}-{client_span}-01"
    async with grpc.aio.insecure_channel(_address(traced_mesh)) as channel:
        async for _ in stub(channel).GenerateStream(
            stream_request(prompt="trace me", sampling={"max_tokens": 8}),
            metadata=(("traceparent", traceparent),),
        ):
            pass
    deadline = time.monotonic() + 20
    services: set[str] = set()
    while time.monotonic() < deadline:
        with rec.lock:
            mine = [s for s in rec.spans if s["trace_id"] == trace_id]
        services = {str(s["service"]) for s in mine}
        span_ids = {s["span_id"] for s in mine}
        linked = all(s["parent"] in span_ids or s["parent"] == client_span for s in mine)
        if linked and all(f"llmesh-{t}" in services for t in TIERS):
            break
        # Client spans of long streams end (and are exported) after the server spans.
        await asyncio.sleep(0.5)
    assert services >= {f"llmesh-{t}" for t in TIERS}, services
    ids = {s["span_id"] for s in mine}
    roots = [s for s in mine if s["parent"] == client_span]
    assert roots and all(s["service"] == "llmesh-gateway" for s in roots)
    for span in mine:
        # Every span hangs off another span of this trace or off the client's span.
        assert span["parent"] in ids or span["parent"] == client_span, span
    by_id = {s["span_id"]: s for s in mine}

    def ancestors(span: dict[str, object]) -> list[str]:
        chain = []
        while span["parent"] in by_id:
            span = by_id[span["parent"]]
            chain.append(str(span["service"]))
        return chain

    worker_spans = [s for s in mine if s["service"] == "llmesh-worker"]
    assert any("llmesh-router" in ancestors(s) and "llmesh-gateway" in ancestors(s) for s in worker_spans)
    generate = [s for s in mine if s["name"] == "gateway.generate"]
    assert generate
    gateway_attrs = generate[0]["attributes"]
    for key in ("llmesh.model", "llmesh.tenant", "llmesh.prompt_tokens", "llmesh.completion_tokens",
                "llmesh.worker_id", "llmesh.zone", "llmesh.queue_ms", "llmesh.ttft_ms"):
        assert key in gateway_attrs, key
    assert gateway_attrs["llmesh.completion_tokens"].int_value == 8
    routed = [s["attributes"] for s in mine if s["service"] == "llmesh-router"
              and "llmesh.router.worker" in s["attributes"]]
    assert routed, "no router span carries the routing decision"
    for key in ("llmesh.router.zone", "llmesh.router.retries", "llmesh.router.resumes",
                "llmesh.router.batch_size", "llmesh.router.window_wait_ms", "llmesh.router.queue_ms",
                "llmesh.router.ttft_ms"):
        assert key in routed[0], key
    engine = [s["attributes"] for s in worker_spans if "llmesh.worker.completion_tokens" in s["attributes"]]
    assert engine, "no worker span carries the engine's account of the request"
    assert engine[0]["llmesh.worker.completion_tokens"].int_value == 8
    for key in ("llmesh.worker.prompt_tokens", "llmesh.worker.queue_ms", "llmesh.worker.ttft_ms",
                "llmesh.worker.finish_reason"):
        assert key in engine[0], key


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = re.match(r"^(\S+?)(\{.*\})?\s+(\S+)$", line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def _sum(samples: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in samples.items():
        if not key.startswith(name + "{") and key != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


class _OnlyWorkersExport(Mesh):
    """A mesh whose workers export spans and whose other tiers have no exporter."""

    def _env(self, tier: str) -> dict[str, str]:
        env = super()._env(tier)
        if tier != "worker":
            env["OTEL_TRACES_EXPORTER"] = "none"
        return env


@pytest.fixture(scope="module")
def worker_traced_mesh(receiver, tiny_deepseek_dir: Path, tmp_path_factory) -> Iterator[Mesh]:
    yield from _running_mesh(receiver, tiny_deepseek_dir, tmp_path_factory.mktemp("worker-traced-mesh"),
                             _OnlyWorkersExport)


async def test_tiers_without_an_exporter_pass_the_clients_trace_on(receiver, worker_traced_mesh):
    """The gateway, tokenizer, router and postprocessor record nothing without an exporter
    (services/common/tracing.py LeanTracerProvider), yet the trace they pass on is the
    client's: the worker, which exports, records its span in the client's trace, under a
    span id the router gave it (not recorded anywhere), with the client's sampled flag."""
    rec, _ = receiver
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    async with grpc.aio.insecure_channel(_address(worker_traced_mesh)) as channel:
        async for _ in stub(channel).GenerateStream(
            stream_request(prompt="trace me", sampling={"max_tokens": 8}),
            metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),),
        ):
            pass
    deadline = time.monotonic() + 20
    mine: list[dict[str, object]] = []
    while time.monotonic() < deadline and not mine:
        with rec.lock:
            mine = [s for s in rec.spans if s["trace_id"] == trace_id]
        await asyncio.sleep(0.2)
    assert mine, "the worker recorded no span in the client's trace"
    await asyncio.sleep(1.0)  # anything else of this trace would be exported by now
    with rec.lock:
        mine = [s for s in rec.spans if s["trace_id"] == trace_id]
    assert {s["service"] for s in mine} == {"llmesh-worker"}, mine
    generate = [s for s in mine if s["name"] == "llmesh.worker/Session.generate"]
    assert generate, mine
    for span in generate:
        # Its parent is the router's span: unrecorded, but a span id of its own.
        assert span["parent"] not in ("", client_span, "0" * 16)
        assert span["parent"] not in {s["span_id"] for s in mine}


async def test_http_requests_continue_the_clients_trace(receiver, traced_mesh):
    """The OpenAI-compatible surface continues a traceparent header like the gRPC API."""
    import json

    rec, _ = receiver
    url = traced_mesh.http_url() + "/v1/completions"
    for stream in (False, True):
        trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
        body = json.dumps({"model": "", "prompt": "trace me over http", "max_tokens": 4,
                           "stream": stream}).encode()
        req = urllib.request.Request(url, data=body, method="POST", headers={
            "content-type": "application/json", "traceparent": f"00-{trace_id}-{client_span}-01",
        })

        def send(req: urllib.request.Request = req) -> int:
            with urllib.request.urlopen(req, timeout=30) as reply:
                reply.read()
                return int(reply.status)

        assert await asyncio.to_thread(send) == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with rec.lock:
                mine = [s for s in rec.spans if s["trace_id"] == trace_id]
            if {str(s["service"]) for s in mine} >= {f"llmesh-{t}" for t in TIERS} and any(
                s["name"] == "POST /v1/completions" for s in mine
            ):
                break
            await asyncio.sleep(0.5)
        services = {str(s["service"]) for s in mine}
        assert services >= {f"llmesh-{t}" for t in TIERS}, (stream, services)
        (root,) = [s for s in mine if s["name"] == "POST /v1/completions"]
        assert root["parent"] == client_span and root["service"] == "llmesh-gateway"
        assert root["attributes"]["http.response.status_code"].int_value == 200
        generate = [s for s in mine if s["name"] == "gateway.generate"]
        assert generate and generate[0]["parent"] == root["span_id"]


async def test_metrics_move_by_the_right_amounts(traced_mesh):
    procs = {p.tier: p for p in traced_mesh.procs}
    for proc in traced_mesh.procs:
        assert proc.metrics_port > 0
    before = {tier: _scrape(p.metrics_port) for tier, p in procs.items()}
    n, max_tokens = 4, 6
    async with grpc.aio.insecure_channel(_address(traced_mesh)) as channel:
        for i in range(n):
            reply = await stub(channel).Generate(
                request(prompt=f"count {i}", sampling={"max_tokens": max_tokens})
            )
            assert reply.usage.completion_tokens == max_tokens
    await asyncio.sleep(0.5)
    after = {tier: _scrape(p.metrics_port) for tier, p in procs.items()}

    def moved(process: str, name: str, **labels: str) -> float:
        return _sum(after[process], name, **labels) - _sum(before[process], name, **labels)

    assert moved("gateway", "llmesh_rpc_requests_total", tier="gateway", method="Generate", code="OK") == n
    assert moved("tokenizer", "llmesh_rpc_requests_total", tier="tokenizer", method="Encode", code="OK") == n
    assert moved("postprocessor", "llmesh_rpc_requests_total", tier="postprocessor", method="Process") == n
    assert moved("router", "llmesh_rpc_requests_total", tier="router", method="Generate") == n
    # ... carried by the gateway's router Session, not as calls of their own.
    assert moved("router", "llmesh_rpc_requests_total", tier="router", method="Generate",
                 transport="session") == n
    assert moved("gateway", "llmesh_gateway_completion_tokens_total") == n * max_tokens
    assert moved("gateway", "llmesh_gateway_requests_total", finish_reason="length") == n
    assert moved("gateway", "llmesh_gateway_request_duration_seconds_count") == n
    assert moved("gateway", "llmesh_gateway_time_to_first_token_seconds_count") == n
    worker_rpcs = moved("worker", "llmesh_rpc_requests_total", tier="worker", method="Generate") + moved(
        "worker", "llmesh_rpc_requests_total", tier="worker", method="GenerateBatch"
    )
    # Under the default transports every request crosses the internal hops inside one
    # long-lived Session; each is still counted once as the per-request RPC it stands for.
    assert worker_rpcs == n
    # The worker's own counters (canary generations are not requests and do not count).
    assert moved("worker", "llmesh_worker_generated_tokens_total") == n * max_tokens
    assert moved("worker", "llmesh_worker_requests_total", finish_reason="length") == n
    # Engine gauges: KV usage and the prefix cache hit rate (the prompts share a prefix).
    # The worker exports them from its engine check loop (every engine_check_interval_s).
    worker = after["worker"]
    for _ in range(50):
        if worker.get("llmesh_worker_prefix_cache_hit_rate", 0.0) > 0.0:
            break
        await asyncio.sleep(0.1)
        worker = _scrape(procs["worker"].metrics_port)
    assert "llmesh_worker_kv_cache_usage" in worker
    assert 0.0 < worker["llmesh_worker_prefix_cache_hit_rate"] <= 1.0


def test_every_tier_froze_its_startup_heap_and_times_full_collections(traced_mesh):
    """Each tier process, once warmed up, froze what startup allocated out of the garbage
    collector (its log says how much) and exports how long its full collections take."""
    for proc in traced_mesh.procs:
        tier = proc.tier.split("-")[0]
        samples = _scrape(proc.metrics_port)
        key = f'llmesh_gc_full_collection_seconds_count{{tier="{tier}"}}'
        assert key in samples, (proc.tier, sorted(k for k in samples if "gc" in k))
        log_text = Path(proc.log_path).read_text()
        stages = re.findall(rf"{tier}: (\d+) startup objects frozen out of the garbage collector "
                            r"after the (imports|warm-up)", log_text)
        assert [stage for _, stage in stages] == ["imports", "warm-up"], (proc.tier, stages)
        assert 10_000 < int(stages[0][0]) <= int(stages[1][0]), (proc.tier, stages)

"""Small helpers for calling the public API in tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llmesh.v1 import inference_pb2, inference_pb2_grpc


def stub(channel: grpc.aio.Channel) -> inference_pb2_grpc.InferenceServiceStub:
    return inference_pb2_grpc.InferenceServiceStub(channel)


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def request(**kwargs: Any) -> inference_pb2.GenerateRequest:
    sampling = kwargs.pop("sampling", None) or {}
    messages = kwargs.pop("messages", None) or []
    return inference_pb2.GenerateRequest(
        sampling=inference_pb2.SamplingParams(**sampling),
        messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in messages],
        **kwargs,
    )


def stream_request(**kwargs: Any) -> inference_pb2.GenerateStreamRequest:
    unary = request(**kwargs)
    out = inference_pb2.GenerateStreamRequest()
    out.ParseFromString(unary.SerializeToString())
    return out


def violations(err: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(err)
    fields: list[str] = []
    if status is None:
        return fields
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields


def retry_delay_ms(err: grpc.aio.AioRpcError) -> int | None:
    status = rpc_status.from_call(err)
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return int(info.retry_delay.ToMilliseconds())
    return None


async def collect_stream(stub_: inference_pb2_grpc.InferenceServiceStub, req: Any,
                         **kwargs: Any) -> tuple[str, inference_pb2.GenerateResponse, int]:
    text = []
    final = None
    deltas = 0
    async for item in stub_.GenerateStream(req, **kwargs):
        if item.HasField("delta"):
            text.append(item.delta.text)
            deltas += 1
        else:
            final = item.final
    assert final is not None, "stream ended without a final message"
    return "".join(text), final, deltas


_SERVES_FRAMES = re.compile(r'"msg": "(\w+) serves Session frames on port (\d+)"')
_CALLS_FRAMES = re.compile(r'"msg": "\S+ serves Session frames on port (\d+): Session calls go there"')


def session_frame_ports(log_dir: Path) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """From a mesh's logs (``llmesh up``'s, one file per process): the framed Session
    listener ports each tier serves, and the listener ports each tier's Session calls
    went to (services/common/sessionwire.py logs both)."""
    served: dict[str, set[int]] = {}
    called: dict[str, set[int]] = {}
    for path in log_dir.glob("*.log"):
        tier = path.stem.split("-")[0]
        text = path.read_text(errors="replace")
        for name, port in _SERVES_FRAMES.findall(text):
            served.setdefault(name, set()).add(int(port))
        called.setdefault(tier, set()).update(int(p) for p in _CALLS_FRAMES.findall(text))
    return served, called


@contextlib.asynccontextmanager
async def gateway_in_process(settings: Any) -> AsyncIterator[str]:
    """A gateway server built from ``settings`` (GatewaySettings) in this process, serving
    until the block ends; yields its address. With router_transport local, its router
    runs in this event loop too, as in the gateway's process."""
    from gateway.server import create_gateway, with_local_router
    from tests.tokenizer.helpers import running_server

    gateway = None

    async with with_local_router(settings) as served:

        async def build() -> tuple[Any, Any]:
            nonlocal gateway
            gateway = await create_gateway(served.settings, local_router=served.router)
            return gateway.handle, gateway

        async with running_server(build, tier="gateway") as (handle, _, _):
            yield f"127.0.0.1:{handle.port}"
        assert gateway is not None
        await gateway.close()


async def concurrent_streams(address: str, requests: list[Any], timeout: float = 60) -> list[tuple[str, Any]]:
    """Every GenerateStream request at once over one channel: (text, final) of each."""
    async with grpc.aio.insecure_channel(address) as channel:
        results = await asyncio.gather(*(collect_stream(stub(channel), r, timeout=timeout) for r in requests))
    return [(text, final) for text, final, _ in results]


async def same_streams(reference: str, address: str, prompts: list[str],
                       request: Callable[..., Any]) -> list[tuple[str, Any]]:
    """Each prompt as ``request(prompt)``, then as ``request(prompt, stop=[...])`` with a
    stop string from the middle of its reference text, all at once through the gateway at
    ``reference`` and then at ``address``: both give the same text, finish reason,
    matched stop and token count. Returns ``address``'s (text, final), plain ones first."""
    plain = [request(p) for p in prompts]
    want = await concurrent_streams(reference, plain)
    stops = [text[len(text) // 2:len(text) // 2 + 4] for text, _ in want]
    stopped = [request(p, stop=[s]) for p, s in zip(prompts, stops, strict=True)]
    want += await concurrent_streams(reference, stopped)
    got = await concurrent_streams(address, plain + stopped)
    for (want_text, want_final), (text, final) in zip(want, got, strict=True):
        assert text == want_text
        assert (final.finish_reason, final.matched_stop, final.usage.completion_tokens) == (
            want_final.finish_reason, want_final.matched_stop, want_final.usage.completion_tokens)
    return got


def metric_total(proc: Any, name: str) -> float:
    """The sum of every sample of metric ``name`` on a tier process's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(m.group(2)) for line in text.splitlines()
               if (m := re.match(rf"^{name}(\{{.*\}})?\s+(\S+)$", line)))


async def stream_and_kill(channel: grpc.aio.Channel, request: Any, pick_victim: Callable[[], Any],
                          after_deltas: int = 5) -> tuple[str, Any, Any]:
    """Stream ``request``; after ``after_deltas`` deltas kill -9 the process
    ``pick_victim`` names (called off the event loop). Returns (text, final, victim)."""
    parts: list[str] = []
    final = None
    victim = None
    async for item in stub(channel).GenerateStream(request, timeout=60):
        if item.HasField("delta"):
            parts.append(item.delta.text)
            if victim is None and len(parts) == after_deltas:
                victim = await asyncio.to_thread(pick_victim)
                os.kill(victim.pid, signal.SIGKILL)
        else:
            final = item.final
    assert final is not None and victim is not None
    return "".join(parts), final, victim

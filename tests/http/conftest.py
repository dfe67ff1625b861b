"""Meshes for the OpenAI-compatible HTTP tests, started with the same code as ``llmesh up``.

``http_fake_mesh``: every tier real, one worker on the deterministic fake engine, the
gateway's HTTP listener on an ephemeral port, and tenants with keys (secure mode).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from llmesh.meshconfig import GatewayConfig, MeshConfig, RouterConfig, TenantConfig, TierConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh

DEMO_KEY = "http-demo-key"
LIMITED_KEY = "http-limited-key"
LIMITED_RPM = 3


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@contextlib.contextmanager
def running_mesh(config: MeshConfig, log_dir: Path) -> Iterator[Mesh]:
    mesh = Mesh(config, log_dir=log_dir)
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


def http_base(mesh: Mesh) -> str:
    return f"http://{mesh.config.gateway.host}:{mesh.config.gateway.http_port}/v1"


def stream_events(mesh: Mesh) -> dict[str, float]:
    """The gateway's streamed HTTP text events so far, by how they went out (direct,
    awaited): from its /metrics."""
    [gateway] = [p for p in mesh.procs if p.tier == "gateway"]
    url = f"http://127.0.0.1:{gateway.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    counts = {"direct": 0.0, "awaited": 0.0}
    for line in text.splitlines():
        match = re.match(r'^llmesh_gateway_http_stream_events_total\{path="(\w+)"\} (\S+)$', line)
        if match:
            counts[match.group(1)] = float(match.group(2))
    return counts


def client(mesh: Mesh, key: str = DEMO_KEY) -> openai.OpenAI:
    """The official client; no retries, so a 429 or 503 reaches the test as it was sent."""
    return openai.OpenAI(base_url=http_base(mesh), api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http_fake_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    audit = tmp_path_factory.mktemp("http-audit") / "audit.jsonl"
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), audit_log=str(audit),
                              settings={"drain_seconds": 0}),
        router=RouterConfig(zones=["zone-a"]),
        tokenizer=TierConfig(),
        workers=[WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 2})],
        tenants=[
            TenantConfig(name="demo", key_sha256=key_hash(DEMO_KEY)),
            TenantConfig(name="limited", key_sha256=key_hash(LIMITED_KEY), requests_per_minute=LIMITED_RPM),
        ],
    )
    with running_mesh(config, tmp_path_factory.mktemp("http-fake-mesh")) as mesh:
        yield mesh

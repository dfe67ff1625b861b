"""``llmesh up``'s Mesh: a tier that loses the race for its port is restarted elsewhere."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import llmesh.up as up
from llmesh.meshconfig import MeshConfig, RouterConfig, WorkerConfig
from llmesh.procs import check_health, free_port


def test_a_tier_whose_port_was_taken_is_restarted_on_another(
    tiny_deepseek_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    handed_out: list[int] = []

    def racy_free_port(host: str = "127.0.0.1") -> int:
        # The first port handed out (the tokenizer's gRPC port) is already bound.
        port = taken if not handed_out else free_port(host)
        handed_out.append(port)
        return port

    monkeypatch.setattr(up, "free_port", racy_free_port)
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway={"port": free_port(), "http_port": -1, "settings": {"drain_seconds": 0}},
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake")],
    )
    mesh = up.Mesh(config, log_dir=tmp_path)
    try:
        mesh.start()
        tokenizers = [p for p in mesh.procs if p.tier == "tokenizer"]
        assert len(tokenizers) == 1
        assert tokenizers[0].address != f"127.0.0.1:{taken}"
        assert check_health(f"127.0.0.1:{config.gateway.port}", "llmesh.v1.InferenceService") == "SERVING"
    finally:
        mesh.stop()
        squatter.close()

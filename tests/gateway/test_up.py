"""``llmesh up``'s Mesh: a tier that loses the race for its port is restarted elsewhere."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def _llmesh_up(tiny_deepseek_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int,
                                                                        dict[str, str], list[str]]]:
    """`llmesh up` on a fake-engine mesh, as a user starts it, once it printed its endpoints:
    the process, the gateway port, its environment and what it printed; killed if still
    running at the end."""
    import yaml

    llmesh = shutil.which("llmesh", path=str(Path(sys.executable).parent)) or shutil.which("llmesh")
    assert llmesh
    port = free_port()
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump({
        "model": str(tiny_deepseek_dir),
        "gateway": {"port": port, "http_port": -1, "settings": {"drain_seconds": 0}},
        "workers": [{"zone": "zone-a", "engine": "fake", "settings": {"fake_token_delay_ms": 2}}],
    }))
    env = {**os.environ, "LLMESH_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([llmesh, "up", "--config", str(tmp_path / "mesh.yaml")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("status:"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(180), f"llmesh up did not come up: {''.join(lines)}"
        yield proc, port, env, lines
    finally:
        if proc.poll() is None:
            # A test that failed with `llmesh up` still running: its tiers go too, not
            # only the process that would have stopped them.
            for state in (tmp_path / "home" / "run").glob("*.json"):
                for entry in json.loads(state.read_text()).get("processes", []):
                    with contextlib.suppress(ProcessLookupError, ValueError, KeyError):
                        os.kill(int(entry["pid"]), signal.SIGKILL)
            proc.kill()
            proc.wait(10)


def _tier_pids(env: dict[str, str]) -> list[int]:
    llmesh = shutil.which("llmesh", path=str(Path(sys.executable).parent)) or shutil.which("llmesh")
    assert llmesh
    status = subprocess.run([llmesh, "status"], env=env, capture_output=True, text=True, timeout=60,
                            check=True)
    return [int(p["pid"]) for p in json.loads(status.stdout)["processes"]]


def _all_gone(pids: list[int]) -> list[int]:
    """The pids of ``pids`` still running after up to 20 s."""
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.2)
    return alive


def test_llmesh_up_process_serves_reports_status_and_stops_on_ctrl_c(tiny_deepseek_dir: Path,
                                                                      tmp_path: Path) -> None:
    """`make run`'s last step as a user runs it: `llmesh up`, wait for the endpoints, ask
    `llmesh status`, generate, then Ctrl-C (SIGINT): exit 0 and no tier left running."""
    from llmesh.client import Client

    with _llmesh_up(tiny_deepseek_dir, tmp_path) as (proc, port, env, lines):
        assert any(f"gateway 127.0.0.1:{port} (plaintext)" in line for line in lines)
        llmesh = shutil.which("llmesh", path=str(Path(sys.executable).parent)) or shutil.which("llmesh")
        assert llmesh
        status = subprocess.run([llmesh, "status"], env=env, capture_output=True, text=True, timeout=60,
                                check=True)
        state = json.loads(status.stdout)
        tiers = {p["tier"] for p in state["processes"]}
        assert tiers == {"gateway", "tokenizer", "router", "postprocessor", "worker"}
        assert all(p["health"] == "SERVING" for p in state["processes"]), state
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            done = client.generate("hello", max_tokens=3)
        assert done.usage.completion_tokens == 3
        pids = [int(p["pid"]) for p in state["processes"]]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        assert _all_gone(pids) == [], "tiers still running after Ctrl-C"
        state_file = tmp_path / "home" / "run"
        assert not any(state_file.glob("*.json")), "llmesh up left its state file behind"


def test_llmesh_up_stops_on_a_burst_of_signals(tiny_deepseek_dir: Path, tmp_path: Path) -> None:
    """SIGTERM after SIGTERM (pkill, then a supervisor's timeout; Ctrl-C pressed again):
    `llmesh up` still stops the mesh and exits. Setting a threading.Event from the signal
    handler deadlocked when a second signal interrupted the first handler."""
    with _llmesh_up(tiny_deepseek_dir, tmp_path) as (proc, _, env, _):
        pids = _tier_pids(env)
        for _ in range(2000):
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        assert _all_gone(pids) == [], "tiers still running after SIGTERM"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; it only waits to be reaped by its parent.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

"""services/common/processes.py: N processes of a CPU tier on one port, and their supervisor.

The supervisor forks, so every test runs it in a process of its own (never in pytest's).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmesh.procs import check_health, spawn_tier
from llmesh.status import tier_processes

# A stand-in tier: each child writes what it was given and waits for SIGTERM.
CHILD = """
import json, os, signal, sys, time
from services.common.processes import run_processes
from services.common.settings import ServerSettings

out = sys.argv[1]

def serve(settings):
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
        json.dump({"port": settings.port, "metrics_port": settings.metrics_port}, f)
    while not stop:
        time.sleep(0.01)
    return 0

settings = ServerSettings(processes=int(sys.argv[2]), port=0, metrics_port=int(sys.argv[3]))
sys.exit(run_processes(settings, tier="tokenizer", serve=serve))
"""


def _wait_for(condition, timeout: float = 30.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); its state says it has exited
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return status != "Z"


def _start(tmp_path: Path, processes: int, metrics_port: int = 7000) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(processes), str(metrics_port)],
                            stderr=subprocess.PIPE)


def _children(tmp_path: Path, count: int) -> dict[int, dict[str, int]]:
    def read() -> dict[int, dict[str, int]] | None:
        files = list(tmp_path.glob("*.json"))
        if len(files) < count:
            return None
        try:
            return {int(f.stem): json.loads(f.read_text()) for f in files}
        except json.JSONDecodeError:  # written but not flushed yet
            return None

    return _wait_for(read, what=f"{count} children")  # type: ignore[no-any-return]


def test_children_share_one_port_chosen_once_and_stop_on_sigterm(tmp_path: Path) -> None:
    sup = _start(tmp_path, 3)
    children = _children(tmp_path, 3)
    ports = {c["port"] for c in children.values()}
    assert len(ports) == 1 and ports != {0}, "port 0 is resolved once, by the supervisor"
    assert sorted(c["metrics_port"] for c in children.values()) == [7000, 7001, 7002]
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(30) == 0
    assert not any(_alive(pid) for pid in children)


def test_a_killed_child_is_not_restarted_and_the_others_keep_running(tmp_path: Path) -> None:
    sup = _start(tmp_path, 2)
    children = _children(tmp_path, 2)
    victim, survivor = sorted(children)
    os.kill(victim, signal.SIGKILL)
    _wait_for(lambda: not _alive(victim), what="the victim's exit")
    # The supervisor reaps and logs it, and nothing takes its place.
    assert sup.poll() is None and _alive(survivor)
    assert len(list(tmp_path.glob("*.json"))) == 2
    sup.send_signal(signal.SIGINT)  # Ctrl-C: forwarded as SIGTERM
    assert sup.wait(30) == 128 + signal.SIGKILL, "the lost process is the exit code"
    assert not _alive(survivor)
    log = sup.stderr.read().decode() if sup.stderr else ""
    assert f"pid {victim}) exited unexpectedly" in log and "not restarted" in log


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    sup = _start(tmp_path, 2)
    children = _children(tmp_path, 2)
    sup.kill()
    sup.wait(10)
    _wait_for(lambda: not any(_alive(pid) for pid in children), what="orphans to die")


def test_only_cpu_tiers_run_several_processes() -> None:
    from services.common.processes import run_processes
    from services.common.settings import ServerSettings

    with pytest.raises(ValueError, match="router: processes must be 1"):
        run_processes(ServerSettings(processes=2), tier="router", serve=lambda _s: 0)
    with pytest.raises(ValueError):
        ServerSettings(processes=0)


def test_two_tokenizer_processes_serve_one_port_and_ctrl_c_stops_both(
    tiny_deepseek_dir: Path, tmp_path: Path
) -> None:
    """The real tier: `llmesh tokenizer --processes 2 --port 0`, both answer on the one
    port, each on its own metrics port with its pid; Ctrl-C (SIGINT) stops them all."""
    from llmesh.up import free_port_block

    metrics = free_port_block("127.0.0.1", 2)
    proc = spawn_tier("tokenizer", "tokenizer", [
        "--port", "0", "--processes", "2", "--metrics-port", str(metrics), "--drain-seconds", "0",
        "--models", json.dumps([f"tiny={tiny_deepseek_dir}"]),
    ], address="", log_dir=tmp_path)
    try:
        def listening() -> list[dict[str, object]] | None:
            found = tier_processes("127.0.0.1", metrics, 2, timeout=0.5)
            return found if all(p["alive"] for p in found) else None

        members = _wait_for(listening, timeout=120, what="both processes' metrics")
        pids = {int(str(p["pid"])) for p in members}
        assert len(pids) == 2 and proc.pid not in pids
        assert proc.log_path is not None
        log_path = proc.log_path

        def lines() -> list[dict[str, object]]:
            return [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]

        _wait_for(lambda: {line["pid"] for line in lines() if line["msg"] == "tokenizer ready"} == pids,
                  timeout=120, what="both processes ready")
        port = int(log_path.read_text().split("sharing port ")[1].split('"')[0])
        proc.address = f"127.0.0.1:{port}"
        assert check_health(proc.address, "llmesh.tokenizer.v1.TokenizerService") == "SERVING"
        proc.popen.send_signal(signal.SIGINT)
        assert proc.popen.wait(30) == 0
        assert not any(_alive(pid) for pid in pids)
        assert {line["pid"] for line in lines() if line["msg"] == "tokenizer stopping"} == pids
    finally:
        proc.kill()

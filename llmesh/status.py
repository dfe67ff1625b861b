"""``llmesh status``: the running local mesh as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc

from llmesh.home import run_dir
from llmesh.procs import check_health
from llmesh.up import STATE_FILE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _credentials(state: dict[str, object]) -> grpc.ChannelCredentials | None:
    if not state.get("tls"):
        return None
    d = Path(str(state["certs_dir"]))
    mutual = bool(state.get("mutual_tls"))
    return grpc.ssl_channel_credentials(
        root_certificates=(d / "ca.pem").read_bytes(),
        private_key=(d / "client-key.pem").read_bytes() if mutual else None,
        certificate_chain=(d / "client.pem").read_bytes() if mutual else None,
    )


def collect(state_path: Path) -> dict[str, object]:
    state = json.loads(state_path.read_text())
    creds = _credentials(state)
    for proc in state["processes"]:
        proc["alive"] = _alive(int(proc["pid"]))
        proc["health"] = (
            check_health(proc["address"], proc["service"], credentials=creds) if proc["alive"] else "DEAD"
        )
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmesh status",
        description="Print the mesh started by `llmesh up` as JSON: every process with tier, zone, "
        "address, pid, metrics port and health.",
    )
    parser.add_argument("--state", help=f"state file (default ${{LLMESH_HOME}}/run/{STATE_FILE})")
    args = parser.parse_args(argv)
    path = Path(args.state) if args.state else run_dir() / STATE_FILE
    if not path.exists():
        print(f"llmesh status: no running mesh ({path} not found); start one with `llmesh up`",
              file=sys.stderr)
        return 1
    print(json.dumps(collect(path), indent=2))
    return 0

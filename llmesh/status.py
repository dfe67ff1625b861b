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
    """TLS credentials for the mesh in ``state``. Under mutual TLS this is the operator's
    certificate (operator.pem, identity spiffe://llmesh.local/operator): internal tiers
    allow it health checks and read-only introspection such as the router's ListWorkers,
    and nothing that serves or aborts requests (client.pem opens no internal tier)."""
    if not state.get("tls"):
        return None
    d = Path(str(state["certs_dir"]))
    mutual = bool(state.get("mutual_tls"))
    return grpc.ssl_channel_credentials(
        root_certificates=(d / "ca.pem").read_bytes(),
        private_key=(d / "operator-key.pem").read_bytes() if mutual else None,
        certificate_chain=(d / "operator.pem").read_bytes() if mutual else None,
    )


def router_view(address: str, credentials: grpc.ChannelCredentials | None,
                timeout: float = 3.0) -> dict[str, object]:
    """One router's ListWorkers: its zone ladder and every worker it knows, with health,
    circuit state, load and (for local workers) pid. ``{"error": ...}`` if it does not answer."""
    from google.protobuf.json_format import MessageToDict

    from llmesh.router.v1 import router_pb2, router_pb2_grpc

    channel = (grpc.secure_channel(address, credentials) if credentials is not None
               else grpc.insecure_channel(address))
    try:
        reply = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=timeout
        )
    except grpc.RpcError as err:
        return {"error": f"{err.code().name}: {err.details()}"}  # type: ignore[attr-defined]
    finally:
        channel.close()
    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def tier_processes(host: str, metrics_port: int, count: int, timeout: float = 2.0) -> list[dict[str, object]]:
    """Each process of a tier run with --processes: process ``i`` serves /metrics on
    ``metrics_port + i`` and names its pid in ``llmesh_process_info``. A process that does
    not answer is listed with pid None (a lost process is not restarted)."""
    import re
    import urllib.request

    out: list[dict[str, object]] = []
    for index in range(count):
        port = metrics_port + index
        entry: dict[str, object] = {"index": index, "metrics_port": port, "pid": None, "alive": False}
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as reply:
                text = reply.read().decode("utf-8", "replace")
        except OSError as exc:
            entry["metrics"] = f"UNREACHABLE: {exc}"
        else:
            found = re.search(r'^llmesh_process_info\{[^}]*pid="(\d+)"', text, re.MULTILINE)
            if found:
                entry["pid"] = int(found.group(1))
                entry["alive"] = _alive(int(found.group(1)))
            entry["metrics"] = "UP"
        out.append(entry)
    return out


def collect(state_path: Path) -> dict[str, object]:
    state = json.loads(state_path.read_text())
    creds = _credentials(state)
    for proc in state["processes"]:
        proc["alive"] = _alive(int(proc["pid"]))
        proc["health"] = (
            check_health(proc["address"], proc["service"], credentials=creds) if proc["alive"] else "DEAD"
        )
        if int(proc.get("process_count", 1)) > 1 and proc["alive"]:
            # pid above is the supervisor's; health above is whichever process answered.
            host = str(proc["address"]).rsplit(":", 1)[0]
            proc["processes"] = tier_processes(host, int(proc["metrics_port"]), int(proc["process_count"]))
        if proc["tier"] == "router" and proc["alive"]:
            # The router's own view of the workers: what routing decisions are made from.
            proc["workers"] = router_view(proc["address"], creds)
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmesh status",
        description="Print the mesh started by `llmesh up` as JSON: every process with tier, zone, "
        "address, pid, metrics port and health (a tier run with several processes lists each one "
        "with its pid and metrics port); each router adds its view of the workers "
        "(zone ladder, health, circuit state, load, pid). In a mutual-TLS mesh it connects with "
        "the operator certificate (operator.pem in the mesh's certs directory), which internal "
        "tiers allow read-only calls only.",
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

"""The router's core modules work on domain types: no generated proto module, no grpc.

Protos are converted at the edges only (``servicer.py`` / ``convert.py`` for the
RouterService, ``workerclient.py`` for the worker), as in the other tiers' cores.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import services.router

ROUTER = Path(services.router.__file__).parent
CORE_MODULES = ("core", "batching", "session", "workerapi", "admission", "routing", "registry", "health")
FORBIDDEN_PREFIXES = ("grpc", "google.protobuf", "google.rpc")


def imported_names(path: Path) -> list[str]:
    """Every module a file imports, and every name it imports from a module (dotted)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def is_generated_or_grpc(name: str) -> bool:
    parts = name.split(".")
    return (
        any(part.endswith(("_pb2", "_pb2_grpc")) for part in parts)
        or name.startswith(FORBIDDEN_PREFIXES)
        # the generated stubs' packages (llmesh.<area>.v1)
        or (parts[0] == "llmesh" and len(parts) >= 3 and parts[2] == "v1")
    )


@pytest.mark.parametrize("module", CORE_MODULES)
def test_router_core_module_imports_no_proto(module: str) -> None:
    path = ROUTER / f"{module}.py"
    offending = [name for name in imported_names(path) if is_generated_or_grpc(name)]
    assert not offending, f"services/router/{module}.py imports {offending}"


def test_the_check_sees_a_proto_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from llmesh.common.v1 import common_pb2\n"
        "import llmesh.worker.v1.worker_pb2\n"
        "def f():\n    from google.protobuf import message\n"
    )
    assert [n for n in imported_names(sample) if is_generated_or_grpc(n)] == [
        "llmesh.common.v1", "llmesh.common.v1.common_pb2", "llmesh.worker.v1.worker_pb2",
        "google.protobuf", "google.protobuf.message",
    ]

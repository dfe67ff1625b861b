"""Fixtures for the deployment tests: the kustomizations and their rendered output."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from deploy.tools import render

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"

# The Kubernetes version whose schemas the manifests must satisfy (kubernetes-validate
# ships strict schemas up to its own version; 1.33 has the native preStop sleep action).
K8S_VERSION = "1.33"


def kustomization_dirs() -> list[Path]:
    """Every buildable kustomization (components are built through the overlays)."""
    found = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if "kind: Component" not in path.read_text(encoding="utf-8"):
            found.append(path.parent)
    return found


def overlay_dirs() -> list[Path]:
    return sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every kustomization rendered once by the Python renderer, by relative path."""
    return {rel(d): render.build(d) for d in kustomization_dirs()}


@pytest.fixture(scope="session")
def kubectl() -> str:
    """``kubectl`` (its built-in kustomize is the reference implementation)."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: the cross-check against real kustomize needs it")
    return path


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]

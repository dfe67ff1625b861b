"""Render kustomizations with the real kustomize: the one built into kubectl (v5.5 in
kubectl 1.32, Debian's ``kubectl`` package), as platform teams, Argo CD and Flux do.

``kustomization_dirs`` finds every buildable kustomization under a tree (components are
built through the kustomizations that use them), so a new directory is covered by the
tests and ``python -m deploy.tools.validate`` without being listed anywhere.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


class KustomizeError(RuntimeError):
    """kubectl is missing, or kustomize refused a kustomization (its message included)."""


def kubectl() -> str:
    """Path of ``kubectl``; a KustomizeError saying how to install it when missing."""
    path = shutil.which("kubectl")
    if path is None:
        raise KustomizeError(
            "kubectl is not installed; it carries the kustomize that renders deploy/k8s "
            "(Debian/Ubuntu: apt-get install kubectl; see README, Development)"
        )
    return path


def kustomization_file(directory: Path) -> Path | None:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    return None


def is_component(directory: Path) -> bool:
    path = kustomization_file(directory)
    return path is not None and (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get(
        "kind"
    ) == "Component"


def kustomization_dirs(root: Path = K8S) -> list[Path]:
    """Every buildable kustomization under ``root`` (not components), sorted."""
    found = {p.parent for name in KUSTOMIZATION_FILES for p in root.rglob(name)}
    return sorted(d for d in found if not is_component(d))


def build_text(directory: Path) -> str:
    """``kubectl kustomize DIRECTORY``'s YAML stream."""
    run = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    if run.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {directory}: {run.stderr.strip()}")
    return run.stdout


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize DIRECTORY`` renders, in its order."""
    return [doc for doc in yaml.safe_load_all(build_text(directory)) if doc]

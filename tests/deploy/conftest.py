"""Fixtures for the deployment tests: every kustomization, rendered by the real kustomize
(``kubectl kustomize``), and the tiers' settings as each container builds them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.tools import consistency, kustomize
from deploy.tools.validate import K8S_VERSION

REPO = kustomize.REPO
K8S = kustomize.K8S
__all__ = ["K8S", "K8S_VERSION", "REPO"]


def kustomization_dirs() -> list[Path]:
    """Every buildable kustomization (components are built through the overlays)."""
    return kustomize.kustomization_dirs(K8S)


def overlay_dirs() -> list[Path]:
    return consistency.overlay_dirs()


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every kustomization rendered once by ``kubectl kustomize``, by relative path. A
    missing kubectl fails (not skips): `.ci/run` installs it, README says how."""
    try:
        return {rel(d): kustomize.build(d) for d in kustomization_dirs()}
    except kustomize.KustomizeError as err:
        pytest.fail(str(err))


@contextlib.contextmanager
def built_settings(objects: list[dict[str, Any]], where: str = "test") -> Iterator[dict[str, Any]]:
    """Each Deployment's tier settings, built by the tier's own CLI code from its container
    arguments and the llmesh.yaml its pod mounts (as the process would), by name."""
    report = consistency.Report()
    runs = consistency.invocations(objects, where, report)
    with contextlib.ExitStack() as stack:
        for inv in runs:
            consistency.check_invocation(inv, report, stack)
        assert not report.problems, report.problems
        yield {inv.workload["metadata"]["name"]: inv.settings for inv in runs}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]

"""Fixtures for the deployment tests: every kustomization, rendered by the real kustomize
(``kubectl kustomize``), the tiers' settings as each container builds them, and what
NetworkPolicies let through."""

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


selector_matches = consistency.label_selector_matches
"""A Kubernetes LabelSelector (matchLabels and matchExpressions); {} matches all."""


def ingress_allowed(
    policies: list[dict[str, Any]],
    namespace: str,
    src: dict[str, str],
    src_ns: dict[str, str],
    src_ns_name: str,
    dst: dict[str, str],
    port: int,
) -> bool:
    """Whether NetworkPolicies let a pod (labels src, in a namespace) reach dst:port."""
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], dst)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                pod_ok = "podSelector" not in peer or selector_matches(peer["podSelector"], src)
                if "namespaceSelector" in peer:
                    ns_ok = selector_matches(peer["namespaceSelector"], src_ns)
                else:
                    ns_ok = src_ns_name == namespace
                if pod_ok and ns_ok:
                    return True
    return False

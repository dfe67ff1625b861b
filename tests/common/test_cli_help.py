"""Every ``llmesh`` command answers ``--help`` through the installed console script."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmesh.cli import COMMANDS


def _llmesh() -> str:
    found = shutil.which("llmesh") or shutil.which("llmesh", path=str(Path(sys.executable).parent))
    assert found, "the llmesh console script must be installed"
    return found


def test_top_level_help_lists_every_command() -> None:
    out = subprocess.run([_llmesh(), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    for name in COMMANDS:
        assert f"  {name} " in out, name
    unknown = subprocess.run([_llmesh(), "no-such-command"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command: str) -> None:
    run = subprocess.run([_llmesh(), command, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout.lower() and len(run.stdout) > 100

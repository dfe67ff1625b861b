"""Where llmesh keeps models, certificates and run state: ${LLMESH_HOME:-~/.cache/llmesh}."""

from __future__ import annotations

import os
from pathlib import Path


def llmesh_home() -> Path:
    return Path(os.environ.get("LLMESH_HOME") or Path.home() / ".cache" / "llmesh")


def models_dir() -> Path:
    return llmesh_home() / "models"


def certs_dir() -> Path:
    return llmesh_home() / "certs"


def run_dir() -> Path:
    return llmesh_home() / "run"

"""Facts about a model directory that every tier must agree on.

The tokenizer checksum is how the gateway and router refuse a tier that loaded a
different tokenizer from the workers': every tier computes it with this one function.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# Files that determine how text maps to token ids and how chats are rendered, in a
# fixed order. Missing files are skipped (and the skip is part of the hash).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def tokenizer_checksum(model_dir: str | Path) -> str:
    """SHA-256 over the tokenizer files of ``model_dir``, as ``sha256:<hex>``."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = root / name
        digest.update(name.encode() + b"\0")
        if path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        else:
            digest.update(b"-")
    return "sha256:" + digest.hexdigest()


def engine_dtype(setting: str, model_dir: str | Path, device: str) -> str:
    """The dtype an engine runs ``model_dir`` in: ``auto`` on a CPU keeps a float32
    checkpoint in float32 (vLLM's own ``auto`` turns it into bf16 there, and on a CPU with
    AMX that changes the default model's greedy answer); anything else is the setting,
    ``auto`` left to vLLM."""
    if setting != "auto" or device != "cpu":
        return setting
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return setting
    stored = config.get("dtype") or config.get("torch_dtype")
    return "float32" if stored == "float32" else setting


def served_model_name(model_dir: str | Path, override: str = "") -> str:
    """The model id clients use: an explicit name, else the directory's name."""
    return override or Path(model_dir).resolve().name


def max_context_length(model_dir: str | Path, override: int = 0) -> int:
    """Context length from config.json (``max_position_embeddings``), unless overridden."""
    if override > 0:
        return override
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return 2048
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def parse_model_spec(spec: str) -> tuple[str, Path]:
    """``name=path`` or ``path`` -> (served name, path)."""
    if "=" in spec:
        name, _, raw = spec.partition("=")
        return name.strip(), Path(raw.strip()).expanduser()
    path = Path(spec).expanduser()
    return served_model_name(path), path

"""Load a model directory's tokenizer with HF ``tokenizers`` and its chat template.

Shared by the tokenizer and postprocessor tiers. Production CPU hosts (Kunpeng) run
without torch or transformers, so this reads ``tokenizer.json``, ``tokenizer_config.json``
and ``generation_config.json`` directly. No grpc import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.common.modelinfo import max_context_length, parse_model_spec, tokenizer_checksum


class ModelLoadError(RuntimeError):
    """A model directory lacks a usable tokenizer; the message names the file."""


@dataclass(frozen=True)
class LoadedTokenizer:
    """One model's tokenizer and the facts every tier must agree on."""

    name: str
    path: Path
    tokenizer: Tokenizer
    checksum: str
    """``services.common.modelinfo.tokenizer_checksum`` of ``path``."""
    max_context_length: int
    vocab_size: int
    """Size of the id space the tokenizer can produce or decode (added tokens included)."""
    eos_token_ids: tuple[int, ...]
    special_tokens: dict[str, str] = field(default_factory=dict)
    """``bos_token``, ``eos_token``, ... as strings: the template variables transformers passes."""
    chat_template: str | None = None
    special_ids: frozenset[int] = frozenset()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as serialized
    # AddedToken objects ({"content": ..., "lstrip": ...}).
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        # Named templates ([{"name": "default", "template": ...}, ...]): use "default".
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return str(entry.get("template", ""))
    return None


def load_tokenizer(name: str, model_dir: str | Path) -> LoadedTokenizer:
    """Load ``model_dir/tokenizer.json`` and the surrounding config files."""
    root = Path(model_dir)
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{tokenizer_file}: not found (the tokenizer tier needs a fast tokenizer)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:
        raise ModelLoadError(f"{tokenizer_file}: cannot load ({exc})") from exc
    config = _read_json(root / "tokenizer_config.json")
    special_map = _read_json(root / "special_tokens_map.json")
    special: dict[str, str] = {}
    for source in (special_map, config):
        for key, value in source.items():
            text = _token_text(value)
            if key.endswith("_token") and text is not None:
                special[key] = text
    eos_ids: list[int] = []
    generation = _read_json(root / "generation_config.json")
    gen_eos = generation.get("eos_token_id")
    for value in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if isinstance(value, int) and value not in eos_ids:
            eos_ids.append(value)
    eos_text = special.get("eos_token")
    if eos_text is not None:
        eos_id = tokenizer.token_to_id(eos_text)
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
    special_ids = frozenset(
        idx for idx, added in tokenizer.get_added_tokens_decoder().items() if added.special
    )
    return LoadedTokenizer(
        name=name,
        path=root,
        tokenizer=tokenizer,
        checksum=tokenizer_checksum(root),
        max_context_length=max_context_length(root),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        eos_token_ids=tuple(eos_ids),
        special_tokens=special,
        chat_template=_chat_template(root, config),
        special_ids=special_ids,
    )


def load_models(specs: list[str]) -> dict[str, LoadedTokenizer]:
    """Load every ``name=dir`` / ``dir`` spec, in order (the first is the default)."""
    models: dict[str, LoadedTokenizer] = {}
    for spec in specs:
        name, path = parse_model_spec(spec)
        if name in models:
            raise ModelLoadError(f"model name {name!r} is given twice")
        models[name] = load_tokenizer(name, path)
    if not models:
        raise ModelLoadError("no models configured")
    return models

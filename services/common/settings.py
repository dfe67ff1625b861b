"""Settings: one frozen pydantic-settings object per tier.

Every field carries a docstring under it; that text becomes the ``--help`` of the
derived CLI flag. Precedence: CLI flag > environment (``LLMESH_<TIER>_<FIELD>``) >
default. Nothing is parsed at import time.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TlsSettings(BaseModel):
    """TLS material for one endpoint; all paths are PEM files."""

    model_config = {"frozen": True}

    cert: str = ""
    """Certificate chain presented by this side."""
    key: str = ""
    """Private key of ``cert``."""
    ca: str = ""
    """CA bundle used to verify the peer."""


class ServerSettings(BaseSettings):
    """Fields every tier's server shares."""

    model_config = SettingsConfigDict(
        frozen=True, use_attribute_docstrings=True, extra="ignore", env_nested_delimiter="__"
    )

    host: str = "127.0.0.1"
    """Address to bind the gRPC server to."""
    port: int = 0
    """gRPC port; 0 picks a free port (printed at start)."""
    metrics_port: int = -1
    """Prometheus /metrics port; 0 picks a free port, -1 disables it."""
    tls_cert: str = ""
    """Server certificate (PEM). Empty serves plaintext."""
    tls_key: str = ""
    """Server private key (PEM)."""
    tls_client_ca: str = ""
    """CA (PEM) that client certificates must chain to; set to require mutual TLS."""
    downstream_tls_ca: str = ""
    """CA (PEM) used to verify the servers this process calls; empty calls in plaintext."""
    downstream_tls_cert: str = ""
    """Client certificate (PEM) presented to downstream servers (mutual TLS)."""
    downstream_tls_key: str = ""
    """Client private key (PEM) for downstream calls."""
    authorize_callers: bool = True
    """With mutual TLS (--tls-client-ca), allow each method of an internal tier only to the
    roles its policy names (routers, tokenizers, postprocessors: the gateway; workers: the
    router; read-only introspection also the operator), recognised by a URI SAN of the
    caller's certificate (services/common/authz.py). Health and reflection stay open."""
    caller_identities: dict[str, list[str]] = Field(default_factory=dict)
    """Identities (certificate URI SANs, e.g. SPIFFE IDs) per caller role (gateway, router,
    operator, ...); a role not named keeps spiffe://llmesh.local/tier/<role>
    (operator: spiffe://llmesh.local/operator), as issued by `llmesh certs`."""
    grace_seconds: float = 5.0
    """On SIGTERM, how long in-flight calls may take to finish before they are cancelled."""
    drain_seconds: float = 1.0
    """On SIGTERM, how long to keep serving while reporting NOT_SERVING, so callers move away."""
    processes: int = Field(default=1, ge=1)
    """Processes serving this tier's port together (SO_REUSEPORT), forked by a supervisor
    that forwards SIGTERM and restarts nothing; each serves /metrics on --metrics-port +
    its index. Gateway, tokenizer and postprocessor only (services/common/processes.py)."""
    log_level: str = "INFO"
    """Log level (DEBUG, INFO, WARNING, ERROR). Prompt and output text never log at INFO."""
    log_format: str = "json"
    """Log format: json (one object per line) or text."""
    service_name: str = ""
    """OpenTelemetry service.name; empty uses OTEL_SERVICE_NAME or llmesh-<tier>."""

    @field_validator("caller_identities", mode="before")
    @classmethod
    def _one_identity_is_a_list(cls, value: Any) -> Any:
        # {"gateway": "spiffe://..."} is the common case; accept it for a one-item list.
        if isinstance(value, dict):
            return {role: [ids] if isinstance(ids, str) else ids for role, ids in value.items()}
        return value

    @property
    def mutual_tls(self) -> bool:
        """The server requires client certificates (so callers have an identity)."""
        return bool(self.tls_cert and self.tls_client_ca)

    @property
    def server_tls(self) -> TlsSettings | None:
        if not self.tls_cert:
            return None
        return TlsSettings(cert=self.tls_cert, key=self.tls_key, ca=self.tls_client_ca)

    @property
    def client_tls(self) -> TlsSettings | None:
        if not self.downstream_tls_ca:
            return None
        return TlsSettings(
            cert=self.downstream_tls_cert, key=self.downstream_tls_key, ca=self.downstream_tls_ca
        )


S = TypeVar("S", bound=BaseSettings)

_SCALARS = (str, int, float)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """Add one flag per settings field, with the field's docstring as help."""
    prefix = cls.model_config.get("env_prefix", "")
    for name, info in cls.model_fields.items():
        annotation = _unwrap_optional(info.annotation)
        env = f"{prefix}{name}".upper()
        default = info.default if info.default is not None else ""
        help_text = f"{info.description or ''} [env {env}; default {default!r}]"
        help_text = help_text.replace("%", "%%")
        if annotation is bool:
            parser.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction,
                default=None, help=help_text,
            )
        elif annotation in _SCALARS:
            parser.add_argument(
                _flag(name), dest=name, type=annotation, default=None, help=help_text,
                metavar=name.upper(),
            )
        else:
            parser.add_argument(
                _flag(name), dest=name, type=str, default=None, metavar="JSON",
                help=help_text + " (JSON, or comma-separated for lists of strings)",
            )


def _parse_complex(value: str, annotation: Any) -> Any:
    text = value.strip()
    if text[:1] in "[{\"" or text in ("null", "true", "false") or text[:1].isdigit():
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def settings_from_args(cls: type[S], args: argparse.Namespace, **overrides: Any) -> S:
    """Build settings: explicit CLI values win over the environment and defaults."""
    values: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        annotation = _unwrap_optional(info.annotation)
        if isinstance(value, str) and annotation not in _SCALARS:
            value = _parse_complex(value, annotation)
        values[name] = value
    values.update(overrides)
    return cls(**values)

"""Structured logging: one JSON object per line, with trace and request ids.

Prompt and output text must never be logged at INFO; log sizes and hashes instead.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class JsonFormatter(logging.Formatter):
    def __init__(self, tier: str) -> None:
        super().__init__()
        self.tier = tier

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "tier": self.tier,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        trace_id, span_id = _current_trace_ids()
        if trace_id:
            entry["trace_id"] = trace_id
            entry["span_id"] = span_id
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            entry.update(extra)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _current_trace_ids() -> tuple[str, str]:
    try:
        from opentelemetry import trace
    except ImportError:  # pragma: no cover - opentelemetry is a base dependency
        return "", ""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def setup_logging(tier: str, level: str = "INFO", fmt: str = "json") -> None:
    """Configure the root logger once per process."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(tier))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {tier} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # vLLM and grpc are chatty at INFO; keep their warnings.
    for noisy in ("grpc", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

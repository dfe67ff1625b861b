"""Audit log: one JSON line per request, with hashes and sizes but never raw text.

Events: ``request`` (every generate call, whatever its outcome) and ``auth_failure``
(a refused credential: surface, peer, reason and a hashed key prefix, never the key).
Every client-controlled value in a record is bounded before it gets here.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO


class AuditLog:
    def __init__(self, path: str | None) -> None:
        self._lock = threading.Lock()
        self._stream: TextIO | None = None
        if path == "-":
            self._stream = sys.stderr
        elif path:
            target = Path(path).expanduser()
            target.parent.mkdir(parents=True, exist_ok=True)
            self._stream = open(target, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, entry: dict[str, Any], event: str = "request") -> None:
        if self._stream is None:
            return
        record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **entry}
        line = json.dumps(record, sort_keys=True, default=str)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()

    def close(self) -> None:
        if self._stream is not None and self._stream is not sys.stderr:
            self._stream.close()
        self._stream = None

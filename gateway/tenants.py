"""Tenants, API keys (stored only as SHA-256) and per-tenant rate limits."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.common.errors import InvalidArgument, ResourceExhausted, Unauthenticated

FILTER_MODES = ("off", "redact", "block")


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: str = ""
    requests_per_minute: int = 0
    """0 means unlimited."""
    tokens_per_minute: int = 0
    """Prompt plus completion tokens; 0 means unlimited."""
    filter_mode: str = "off"


ANONYMOUS = Tenant(name="anonymous")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class AuthenticationFailed(Unauthenticated):
    """A refused credential, with what may be recorded about it (never the key itself)."""

    def __init__(self, message: str, *, reason: str, key_sha256_prefix: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        """missing, malformed or unknown_key (a bounded set: it labels a metric)."""
        self.key_sha256_prefix = key_sha256_prefix
        """The first 12 hex digits of the presented key's SHA-256: repeated attempts with one
        key can be told apart from many keys, and the key cannot be recovered."""


def load_tenants(path: str | Path) -> list[Tenant]:
    text = Path(path).read_text()
    data = yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else json.loads(text)
    if isinstance(data, dict):
        data = data.get("tenants", [])
    return parse_tenants(data or [])


def parse_tenants(entries: list[dict[str, object]]) -> list[Tenant]:
    tenants = []
    for i, entry in enumerate(entries):
        key_hash = str(entry.get("key_sha256", "")).lower()
        if len(key_hash) != 64 or any(c not in "0123456789abcdef" for c in key_hash):
            raise InvalidArgument(f"tenants[{i}].key_sha256", "must be a hex SHA-256 of the API key")
        mode = str(entry.get("filter_mode", "off"))
        if mode not in FILTER_MODES:
            raise InvalidArgument(f"tenants[{i}].filter_mode", f"must be one of {FILTER_MODES}")
        tenants.append(Tenant(
            name=str(entry["name"]),
            key_sha256=key_hash,
            requests_per_minute=int(entry.get("requests_per_minute", 0) or 0),  # type: ignore[call-overload]
            tokens_per_minute=int(entry.get("tokens_per_minute", 0) or 0),  # type: ignore[call-overload]
            filter_mode=mode,
        ))
    return tenants


class TenantRegistry:
    """Maps bearer keys to tenants. With no tenants configured, everyone is anonymous."""

    def __init__(self, tenants: list[Tenant], default_filter_mode: str = "off") -> None:
        self.tenants = tenants
        self._by_hash = {t.key_sha256: t for t in tenants}
        self.anonymous = Tenant(name="anonymous", filter_mode=default_filter_mode)

    @property
    def secure(self) -> bool:
        return bool(self.tenants)

    def authenticate(self, authorization: str | None) -> Tenant:
        if not self.secure:
            return self.anonymous
        if not authorization:
            raise AuthenticationFailed("missing 'authorization: Bearer <key>' metadata", reason="missing")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationFailed("authorization metadata must be 'Bearer <key>'", reason="malformed")
        digest = hash_key(key.strip())
        for known, tenant in self._by_hash.items():
            # Constant-time comparison against every configured hash.
            if hmac.compare_digest(known, digest):
                return tenant
        raise AuthenticationFailed("unknown API key", reason="unknown_key", key_sha256_prefix=digest[:12])


class SlidingWindow:
    """Amounts spent in the last ``window`` seconds."""

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def _expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - self.window:
            _, amount = self.events.popleft()
            self.total -= amount

    def used(self, now: float) -> int:
        self._expire(now)
        return self.total

    def add(self, now: float, amount: int) -> None:
        if amount <= 0:
            return
        self.events.append((now, amount))
        self.total += amount

    def wait_until_below(self, now: float, limit: int, need: int) -> float:
        """Seconds until ``used + need <= limit`` (at least a small positive delay)."""
        self._expire(now)
        excess = self.total + need - limit
        for ts, amount in self.events:
            excess -= amount
            if excess <= 0:
                return max(0.05, ts + self.window - now)
        return self.window


class RateLimiter:
    """Per-tenant requests-per-minute and tokens-per-minute limits."""

    def __init__(self, clock: object = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, SlidingWindow] = {}
        self._tokens: dict[str, SlidingWindow] = {}
        self._lock = threading.Lock()

    def _now(self) -> float:
        return float(self._clock())  # type: ignore[operator]

    def admit(self, tenant: Tenant) -> None:
        """Count one request; raise ResourceExhausted (with a retry delay) when over."""
        with self._lock:
            now = self._now()
            if tenant.requests_per_minute > 0:
                window = self._requests.setdefault(tenant.name, SlidingWindow())
                if window.used(now) + 1 > tenant.requests_per_minute:
                    delay = window.wait_until_below(now, tenant.requests_per_minute, 1)
                    raise ResourceExhausted(
                        f"tenant {tenant.name!r} is over its limit of "
                        f"{tenant.requests_per_minute} requests per minute",
                        retry_after_s=math.ceil(delay * 10) / 10,
                    )
            if tenant.tokens_per_minute > 0:
                tokens = self._tokens.setdefault(tenant.name, SlidingWindow())
                if tokens.used(now) >= tenant.tokens_per_minute:
                    delay = tokens.wait_until_below(now, tenant.tokens_per_minute, 1)
                    raise ResourceExhausted(
                        f"tenant {tenant.name!r} is over its limit of "
                        f"{tenant.tokens_per_minute} tokens per minute",
                        retry_after_s=math.ceil(delay * 10) / 10,
                    )
            if tenant.requests_per_minute > 0:
                self._requests[tenant.name].add(now, 1)

    def charge_tokens(self, tenant: Tenant, tokens: int) -> None:
        if tenant.tokens_per_minute <= 0:
            return
        with self._lock:
            self._tokens.setdefault(tenant.name, SlidingWindow()).add(self._now(), tokens)

"""Client channels with keepalive, TLS and deadline propagation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from services.common.settings import TlsSettings

# Keepalive pings every 2 s with a 2 s timeout (the Sessions give a silent peer 2 s too),
# and only while a call is open: a peer that stops answering under an open call (a unary
# call in flight) is noticed within about 4 s. Faster signals sit above this one: the
# Sessions ping while a request awaits an answer (services/common/sessionwire.py), and the
# router's load stream from every worker misses its deadline (load_timeout_ms) first. A
# channel with no call sends nothing: every ping wakes gRPC's event-engine threads in both
# processes and keeps their idle back-off short, which an idle mesh paid in every tier
# (docs/benchmarks.md, 6 December 2026). Calls held open for as long as the mesh runs (the
# health Watches) ping more rarely: see create_channel's keepalive_time_ms.
KEEPALIVE_TIME_MS = 2000
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 2000),
    # grpcio 1.85 times an unanswered keepalive ping out with the transport's ping
    # timeout (60 s unless set), not keepalive_timeout_ms: without this a frozen peer
    # held an open call for a minute (tests/common/test_idle_wakeups.py).
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect quickly after a peer comes back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

IDLE_TIMEOUT_MS = 60_000
"""A channel without a call for this long closes its connection (gRPC's default: 30
minutes) and opens one again at its next call, a millisecond or two on loopback. The
keepalive timer of a connected transport fires every ``keepalive_time_ms`` whether or not
a call is open, and each firing wakes gRPC's event-engine threads: a channel used once (a
Session endpoint lookup, a start-up check) cost its process about 0.5 ms of CPU per
second for good. Above the gateway's 30 s model-list refresh, so a serving gateway keeps
its tokenizer channel connected."""

LOOKUP_IDLE_TIMEOUT_MS = 5_000
"""The idle timeout of a channel that only asks a peer where its framed Session listener
is (``SessionOpener``): asked once when a session opens (again after one broke), so the
connection is closed 5 s after, not held for a minute. Connected, a channel re-arms its
keepalive timer every ``keepalive_time_ms`` even without a call, and each firing wakes
gRPC's event-engine threads (about a dozen wake-ups with their idle back-off): the three
lookup channels of a gateway and one per worker in a router cost that for the first
minute of every session, under load included. Over gRPC (a peer without a listener) the
Session itself runs on the channel and keeps it open."""

# Servers must accept those frequent pings instead of answering GOAWAY too_many_pings.
SERVER_KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
    ("grpc.http2.min_ping_interval_without_data_ms", 100),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
)

# Internal hops (token ids, frames of many requests). A public server sizes what it
# receives from its request limits instead: see server_message_options.
MESSAGE_SIZE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


def server_message_options(max_receive_bytes: int = 0) -> list[tuple[str, int]]:
    """Message size options of a server; ``max_receive_bytes`` > 0 caps what it accepts.

    grpc refuses a bigger message (RESOURCE_EXHAUSTED) from its length prefix, before
    receiving or parsing it.
    """
    options = dict(MESSAGE_SIZE_OPTIONS)
    if max_receive_bytes > 0:
        options["grpc.max_receive_message_length"] = max_receive_bytes
    return list(options.items())


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def client_credentials(tls: TlsSettings) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key),
        certificate_chain=_read(tls.cert),
    )


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """TLS for a server; with ``tls.ca`` set, clients must present a certificate."""
    key, cert = _read(tls.key), _read(tls.cert)
    assert key is not None and cert is not None
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=_read(tls.ca),
        require_client_auth=bool(tls.ca),
    )


def create_channel(
    target: str,
    *,
    tls: TlsSettings | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
    keepalive: bool = True,
    keepalive_time_ms: int = KEEPALIVE_TIME_MS,
    idle_timeout_ms: int = IDLE_TIMEOUT_MS,
    server_name_override: str = "",
    extra_options: Sequence[tuple[str, object]] = (),
) -> grpc.aio.Channel:
    """An aio channel to ``target`` (host:port, or dns:///name:port for re-resolution).

    ``keepalive_time_ms`` spaces the pings under an open call (the timeout stays 2 s). A
    call held open all the time, a health Watch, pings for as long as the mesh runs, and
    each ping costs both processes a burst of event-engine wakeups (about 1.5 ms of CPU
    per second per call): such a channel pings more rarely when something else notices
    its peer first, or when its bound only has to beat a slower probe.
    """
    options: list[tuple[str, object]] = [
        *MESSAGE_SIZE_OPTIONS, ("grpc.client_idle_timeout_ms", idle_timeout_ms),
    ]
    if keepalive:
        options += [(name, keepalive_time_ms if name == "grpc.keepalive_time_ms" else value)
                    for name, value in KEEPALIVE_OPTIONS]
    if server_name_override:
        options.append(("grpc.ssl_target_name_override", server_name_override))
    if target.startswith("dns:"):
        # A DNS name of a headless Service resolves to every pod: spread calls over all
        # of them instead of pinning the first address (gRPC's default pick_first).
        options.append(("grpc.lb_policy_name", "round_robin"))
    options += list(extra_options)
    if interceptors is None:
        from services.common.tracing import client_interceptors

        interceptors = client_interceptors()
    if tls is not None:
        return grpc.aio.secure_channel(
            target, client_credentials(tls), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def downstream_timeout(context: grpc.aio.ServicerContext, cap: float | None = None) -> float | None:
    """The caller's remaining deadline, to pass on as the next hop's ``timeout=``."""
    remaining = context.time_remaining()
    if remaining is None:
        return cap
    remaining = max(0.0, remaining)
    return min(remaining, cap) if cap is not None else remaining


BROKEN_LINK_HINTS = ("RST_STREAM", "Stream removed", "Socket closed", "Connection reset", "GOAWAY",
                     "Failed to connect")
"""How grpc words a connection that broke under a call (its code may be INTERNAL or UNKNOWN)."""


def broken_link(details: str) -> bool:
    """Whether a failed call's details say the connection broke, not the peer's handler."""
    return any(hint in details for hint in BROKEN_LINK_HINTS)

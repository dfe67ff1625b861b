"""Who may call an internal tier: caller identity from the mTLS peer certificate.

A client certificate proves only that its holder was issued one by the mesh CA. Without
this check the certificate handed to gateway clients also opened the router (Generate
with no tenant, Abort of anyone's request) and the workers. Here each internal server
allows a method only to the *roles* its policy names, and a role is recognised by an
identity in the caller's certificate: a URI SAN, SPIFFE-style, e.g.
``spiffe://llmesh.local/tier/gateway``.

The policy (which role may call which method) is code, in :data:`TIER_POLICIES`, so it
is reviewed and tested in one place; which identity stands for each role is deployment
configuration (``caller_identities``), so a Kubernetes service mesh's SPIFFE IDs
(``spiffe://cluster.local/ns/llmesh/sa/llmesh-gateway``) can replace the development
ones issued by ``llmesh certs``.

================  ==============================  =========================================
tier              every method                    read-only introspection
================  ==============================  =========================================
router            gateway                         ListWorkers: operator
worker            router                          GetLoad, WatchLoad, GetModelInfo: operator
tokenizer         gateway                         ListModels: router (checksums), operator
postprocessor     gateway                         (none)
================  ==============================  =========================================

``grpc.health.v1.Health`` and server reflection stay open to every caller that passed
the TLS handshake, so probes and ``grpcurl`` describe/health work with any mesh
certificate. The gateway has no identity policy: its callers are authenticated by API key.
The check runs only where the server requires client certificates (mutual TLS); with
server-only TLS or plaintext there is no peer identity to check.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import grpc

from services.common.errors import PermissionDenied

log = logging.getLogger(__name__)

TRUST_DOMAIN = "llmesh.local"
"""Trust domain of the development identities ``llmesh certs`` issues."""

ROLES = ("gateway", "router", "worker", "tokenizer", "postprocessor", "operator")
"""Every role a policy can name: the five tiers plus the human/automation operator."""

OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
    "llmesh.common.v1.SessionTransportService",
)
"""Services every authenticated peer may call (probes, grpcurl describe, where the
framed Session listener is: its connections are checked as the gRPC port's calls are)."""


def tier_identity(tier: str) -> str:
    """The development identity of a tier: ``spiffe://llmesh.local/tier/<tier>``."""
    return f"spiffe://{TRUST_DOMAIN}/tier/{tier}"


OPERATOR_IDENTITY = f"spiffe://{TRUST_DOMAIN}/operator"
"""The development identity of the operator (``llmesh status``)."""


def client_identity(common_name: str) -> str:
    """The development identity of a public client: ``spiffe://llmesh.local/client/<cn>``
    (the common name percent-encoded to one path segment)."""
    return f"spiffe://{TRUST_DOMAIN}/client/{quote(common_name, safe='')}"


def default_identity(role: str) -> str:
    """The identity that stands for ``role`` unless ``caller_identities`` says otherwise."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    return OPERATOR_IDENTITY if role == "operator" else tier_identity(role)


@dataclass(frozen=True)
class TierPolicy:
    """Which roles may call which methods of one tier's service."""

    service: str
    """Full name of the tier's service, e.g. ``llmesh.router.v1.RouterService``."""
    all_methods: tuple[str, ...]
    """Roles allowed to call every method of ``service``."""
    methods: Mapping[str, tuple[str, ...]]
    """Method short name -> further roles allowed to call just that method."""

    def roles_for(self, method: str) -> frozenset[str]:
        """Roles allowed to call ``method`` (a full path ``/pkg.Service/Method``)."""
        service, _, short = method.lstrip("/").partition("/")
        if service != self.service:
            return frozenset()
        return frozenset(self.all_methods) | frozenset(self.methods.get(short, ()))


TIER_POLICIES: Mapping[str, TierPolicy] = {
    "router": TierPolicy(
        "llmesh.router.v1.RouterService", ("gateway",), {"ListWorkers": ("operator",)},
    ),
    "worker": TierPolicy(
        "llmesh.worker.v1.WorkerService", ("router",),
        {"GetLoad": ("operator",), "WatchLoad": ("operator",), "GetModelInfo": ("operator",)},
    ),
    "tokenizer": TierPolicy(
        # The router reads the tokenizer checksums to refuse mismatched workers.
        "llmesh.tokenizer.v1.TokenizerService", ("gateway",), {"ListModels": ("router", "operator")},
    ),
    "postprocessor": TierPolicy("llmesh.postprocess.v1.PostprocessService", ("gateway",), {}),
}
"""The internal tiers' policies; a tier not listed here (the gateway) checks no identity."""


def is_open(method: str) -> bool:
    """Health and reflection: open to every peer that completed the handshake."""
    return method.lstrip("/").partition("/")[0] in OPEN_SERVICES


@dataclass(frozen=True)
class CallerAuthorizer:
    """A tier's policy resolved against the identities configured for each role."""

    tier: str
    policy: TierPolicy
    identities: Mapping[str, frozenset[str]]
    """Role -> identities (URI SANs) that stand for it."""

    @classmethod
    def build(cls, tier: str, caller_identities: Mapping[str, Sequence[str]] | None = None
              ) -> CallerAuthorizer:
        """The authorizer of ``tier`` (one of :data:`TIER_POLICIES`); roles missing from
        ``caller_identities`` keep their :func:`default_identity`."""
        if tier not in TIER_POLICIES:
            raise ValueError(f"no caller policy for tier {tier!r}")
        overrides = dict(caller_identities or {})
        unknown = sorted(set(overrides) - set(ROLES))
        if unknown:
            raise ValueError(
                f"caller_identities: unknown role(s) {', '.join(unknown)}; expected {', '.join(ROLES)}"
            )
        identities = {
            role: frozenset(overrides[role]) if role in overrides else frozenset({default_identity(role)})
            for role in ROLES
        }
        return cls(tier, TIER_POLICIES[tier], identities)

    def roles_of(self, peer: Iterable[str]) -> frozenset[str]:
        """The roles a caller holding identities ``peer`` plays."""
        held = set(peer)
        return frozenset(role for role, ids in self.identities.items() if held & ids)

    def check(self, method: str, peer: Sequence[str]) -> None:
        """Return if a caller with identities ``peer`` may call ``method``; else raise
        :class:`PermissionDenied` naming the method and the identity (never a secret)."""
        if is_open(method):
            return
        if self.roles_of(peer) & self.policy.roles_for(method):
            return
        who = ", ".join(peer) if peer else "a certificate without a URI identity"
        raise PermissionDenied(f"{method} on the {self.tier} tier is not allowed for {who}")


# -- peer identity from the TLS handshake ------------------------------------------------


@functools.lru_cache(maxsize=256)
def _uris_from_pem(pem: bytes) -> tuple[str, ...]:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return ()
    return tuple(san.get_values_for_type(x509.UniformResourceIdentifier))


@functools.lru_cache(maxsize=256)
def peer_identities_from_der(der: bytes) -> tuple[str, ...]:
    """URI SANs of a peer certificate in DER (as ``ssl.SSLObject.getpeercert(True)`` gives it)."""
    from cryptography import x509

    try:
        cert = x509.load_der_x509_certificate(der)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return ()
    return tuple(san.get_values_for_type(x509.UniformResourceIdentifier))


def peer_identities(auth_context: Mapping[str, Sequence[bytes]]) -> tuple[str, ...]:
    """URI SANs of the peer certificate, from a ``context.auth_context()`` mapping.

    grpc lists them under ``peer_uri``; where a grpc build does not, they are read from
    the peer's PEM certificate (``x509_pem_cert``).
    """
    uris = auth_context.get("peer_uri")
    if uris is not None:
        return tuple(u.decode("utf-8", "replace") for u in uris)
    pem = auth_context.get("x509_pem_cert")
    return _uris_from_pem(pem[0]) if pem else ()


class CallerAuthzInterceptor(grpc.aio.ServerInterceptor):
    """Refuse with PERMISSION_DENIED every call the tier's policy does not allow the
    caller's certificate identity. Install it inside the error-mapping interceptor so the
    refusal is mapped and counted like any other status.

    The check runs before the handler: for a client-streaming method no request message
    is read; for a unary request grpc has parsed the message already (within the
    server's message-size limit).
    """

    def __init__(self, authorizer: CallerAuthorizer) -> None:
        self.authorizer = authorizer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_open(method):
            return handler
        authorizer = self.authorizer

        def authorize(context: grpc.aio.ServicerContext) -> None:
            peer = peer_identities(context.auth_context())
            try:
                authorizer.check(method, peer)
            except PermissionDenied:
                log.warning("refused %s to %s", method, ", ".join(peer) or "a peer without identity")
                raise

        if handler.unary_unary or handler.stream_unary:
            inner_unary = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                authorize(context)
                return await inner_unary(request, context)

            factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                       else grpc.stream_unary_rpc_method_handler)
            return factory(unary, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)

        inner_stream = handler.unary_stream or handler.stream_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            authorize(context)
            result = inner_stream(request, context)
            if inspect.isawaitable(result):
                await result  # a handler that writes with context.write()
            else:
                async for item in result:
                    yield item

        factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                   else grpc.stream_stream_rpc_method_handler)
        return factory(stream, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


def caller_authz_interceptors(
    tier: str, *, mutual_tls: bool, enabled: bool,
    caller_identities: Mapping[str, Sequence[str]] | None = None,
) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor for ``tier``, or none: without mutual TLS there is no identity to
    check, the gateway has no identity policy, and ``enabled=False`` turns the check off."""
    if not (mutual_tls and enabled and tier in TIER_POLICIES):
        return []
    return [CallerAuthzInterceptor(CallerAuthorizer.build(tier, caller_identities))]

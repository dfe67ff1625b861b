#!/usr/bin/env python3
"""llmesh-healthcheck: ask a container's llmesh server for its gRPC health.

Used by Docker HEALTHCHECK and by Kubernetes exec probes when the mesh runs with TLS
(kubelet's native gRPC probes cannot speak TLS). It reads the serving process's own
command line and environment (PID 1 by default), so one command works for every tier:
the tier gives the readiness service name, ``--port`` the port and ``--tls-*`` the
credentials. Exit status 0 when the service is SERVING, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Readiness service per tier (liveness is always the empty service name).
SERVICES = {
    "gateway": "llmesh.v1.InferenceService",
    "tokenizer": "llmesh.tokenizer.v1.TokenizerService",
    "postprocessor": "llmesh.postprocess.v1.PostprocessService",
    "router": "llmesh.router.v1.RouterService",
    "worker": "llmesh.worker.v1.WorkerService",
}
DEFAULT_PORTS = {"gateway": 50051, "tokenizer": 50061, "postprocessor": 50062,
                 "router": 50053, "worker": 0}


def process_args(pid: int) -> tuple[str, dict[str, str], dict[str, str]]:
    """(tier, flags, environment) of the process running ``llmesh <tier> ...``."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        if "=" in item
    )
    tier = ""
    for i, word in enumerate(argv):
        if Path(word).name == "llmesh" and i + 1 < len(argv):
            tier = argv[i + 1]
            break
        if word.endswith("-m") and i + 1 < len(argv) and argv[i + 1] == "llmesh.cli" and i + 2 < len(argv):
            tier = argv[i + 2]
            break
    flags: dict[str, str] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            if "=" in word:
                key, value = word[2:].split("=", 1)
            else:
                key = word[2:]
                value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "true"
            flags[key.replace("-", "_")] = value
    return tier, flags, environ


def setting(name: str, tier: str, flags: dict[str, str], environ: dict[str, str], default: str = "") -> str:
    """A settings value as the tier resolves it: flag, then LLMESH_<TIER>_<NAME>, then default."""
    return flags.get(name) or environ.get(f"LLMESH_{tier.upper()}_{name.upper()}") or default


def first_dns_name(cert_pem: bytes) -> str:
    """The certificate's first DNS subject alternative name (to verify it by name)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ""
    dns = names.get_values_for_type(x509.DNSName)
    return dns[0] if dns else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmesh-healthcheck", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--liveness", action="store_true", help="check service \"\" (default)")
    mode.add_argument("--readiness", action="store_true", help="check the tier's full service name")
    parser.add_argument("--pid", type=int, default=1, help="process to read flags from (default 1)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        tier, flags, environ = process_args(args.pid)
    except OSError as err:
        print(f"llmesh-healthcheck: cannot read process {args.pid}: {err}", file=sys.stderr)
        return 1
    if tier not in SERVICES:
        print(f"llmesh-healthcheck: process {args.pid} is not an llmesh tier", file=sys.stderr)
        return 1
    def get(name: str, default: str = "") -> str:
        return setting(name, tier, flags, environ, default)

    port = get("port", str(DEFAULT_PORTS[tier]))
    service = SERVICES[tier] if args.readiness else ""
    target = f"127.0.0.1:{port}"
    cert = get("tls_cert")
    if cert:
        # Verify the server with the mesh CA; present the downstream client certificate
        # (or the server's own, which the mesh issues for client auth too) for mutual TLS.
        ca = get("downstream_tls_ca") or get("tls_client_ca")
        client_cert = get("downstream_tls_cert") or cert
        client_key = get("downstream_tls_key") or get("tls_key")
        cert_pem = Path(cert).read_bytes()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=Path(ca).read_bytes() if ca else cert_pem,
            private_key=Path(client_key).read_bytes() if client_key else None,
            certificate_chain=Path(client_cert).read_bytes() if client_key else None,
        )
        options = [("grpc.ssl_target_name_override", first_dns_name(cert_pem) or "localhost")]
        channel = grpc.secure_channel(target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(target)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=args.timeout
        )
    except grpc.RpcError as err:
        print(f"llmesh-healthcheck: {tier} {service or '(liveness)'}: {err.code().name}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{tier} {service or '(liveness)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.exit(main())

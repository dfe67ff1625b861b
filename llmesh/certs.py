"""``llmesh certs``: a development CA with one certificate per tier, client and operator.

Writes to ``${LLMESH_HOME:-~/.cache/llmesh}/certs/`` (or ``--out``):

- ``ca.pem`` - the self-signed CA (give it to clients as ``--ca`` and to servers as the
  client CA for mutual TLS);
- ``<tier>.pem`` / ``<tier>-key.pem`` for gateway, router, worker, tokenizer and
  postprocessor - each serves (serverAuth, for ``localhost``, ``127.0.0.1``, ``::1`` and
  every ``--san``) and dials (clientAuth) as that tier, with the tier's identity as a URI
  SAN, ``spiffe://llmesh.local/tier/<tier>``: internal servers allow a caller by it (only
  gateways call routers, tokenizers and postprocessors; only routers call workers);
- ``client.pem`` / ``client-key.pem`` - clientAuth certificate for the gateway's clients,
  CN ``--client-cn``, identity ``spiffe://llmesh.local/client/<cn>``: it opens the gateway
  (which still wants an API key) and no internal tier;
- ``operator.pem`` / ``operator-key.pem`` - clientAuth, identity
  ``spiffe://llmesh.local/operator``: ``llmesh status`` and other read-only introspection
  (router ListWorkers, worker GetLoad/GetModelInfo, tokenizer ListModels), never Generate;
- ``server.pem`` / ``server-key.pem`` - a serverAuth certificate with no tier identity, for
  a single server outside the mesh (kept for setups made before per-tier certificates).

Keys are EC P-256 (``--key-type rsa`` for RSA 2048), written with mode 0600. Existing
files are never overwritten without ``--force``. For development only: the CA key is not
kept, so nothing else can be signed with it later.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmesh.home import certs_dir
from services.common.authz import OPERATOR_IDENTITY, client_identity, tier_identity

TIERS: tuple[str, ...] = ("gateway", "router", "worker", "tokenizer", "postprocessor")
"""Tiers that get a certificate of their own."""

CERT_FILES: dict[str, str] = {
    "ca": "ca.pem",
    "server_cert": "server.pem",
    "server_key": "server-key.pem",
    "client_cert": "client.pem",
    "client_key": "client-key.pem",
    "operator_cert": "operator.pem",
    "operator_key": "operator-key.pem",
    **{f"{tier}_{kind}": f"{tier}{suffix}.pem"
       for tier in TIERS for kind, suffix in (("cert", ""), ("key", "-key"))},
}
"""Key in the returned mapping -> file name."""

DEFAULT_SANS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def identity_files(paths: dict[str, Path], identity: str) -> tuple[Path, Path]:
    """``(certificate, key)`` of ``identity`` (a tier, ``client`` or ``operator``)."""
    return paths[f"{identity}_cert"], paths[f"{identity}_key"]


class CertificatesExistError(FileExistsError):
    """Some of the files are already there and ``force`` was not given."""

    def __init__(self, existing: list[Path], missing: list[Path] | None = None) -> None:
        self.existing = existing
        self.missing = missing or []
        names = ", ".join(p.name for p in existing)
        message = f"{existing[0].parent} already holds {names}; not overwriting"
        if self.missing:
            # Typically a set made before per-tier certificates existed.
            message += (f" although {', '.join(p.name for p in self.missing)} are missing"
                        " (an older or partial set)")
        super().__init__(f"{message} (use --force to replace them)")


def dev_cert_paths(out_dir: str | Path | None = None) -> dict[str, Path]:
    """Where :func:`write_dev_certs` puts each file (``out_dir`` defaults to the llmesh home)."""
    base = Path(out_dir) if out_dir is not None else certs_dir()
    return {name: base / filename for name, filename in CERT_FILES.items()}


def _new_key(key_type: str) -> PrivateKey:
    if key_type == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    raise ValueError(f"key_type: expected 'ec' or 'rsa', got {key_type!r}")


def _san_entry(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_usage(*, cert_sign: bool = False, key_encipherment: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _leaf(
    *,
    common_name: str,
    key: PrivateKey,
    ca_key: PrivateKey,
    ca_cert: x509.Certificate,
    eku: Sequence[x509.ObjectIdentifier],
    sans: Sequence[str],
    uris: Sequence[str] = (),
    not_before: dt.datetime,
    not_after: dt.datetime,
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmesh development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage(key_encipherment=isinstance(key, rsa.RSAPrivateKey)), critical=True
        )
        .add_extension(x509.ExtendedKeyUsage(list(eku)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    names = [*(_san_entry(s) for s in sans), *(x509.UniformResourceIdentifier(u) for u in uris)]
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _write(path: Path, data: bytes, mode: int) -> None:
    # Create with the final mode so a key is never readable by others, even briefly;
    # chmod as well because O_CREAT's mode does not apply to a file that already exists.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    path.chmod(mode)


def write_dev_certs(
    out_dir: str | Path | None = None,
    *,
    sans: Sequence[str] = (),
    client_cn: str = "llmesh-client",
    days: int = 30,
    force: bool = False,
    key_type: str = "ec",
) -> dict[str, Path]:
    """Write a development CA and its certificates; return their paths.

    Keys of the result: ``ca``; ``<name>_cert`` and ``<name>_key`` for ``server``,
    ``client``, ``operator`` and each tier of :data:`TIERS` (see the module docstring for
    what each certificate is for). Server certificates cover localhost, 127.0.0.1, ::1 and
    ``sans`` (IP addresses become IP SANs, anything else DNS SANs). Raises
    :class:`CertificatesExistError` (a ``FileExistsError``) before touching anything if
    any of the files exists and ``force`` is false.
    """
    if days < 1:
        raise ValueError(f"days: must be at least 1, got {days}")
    if not client_cn:
        raise ValueError("client_cn: must not be empty")
    paths = dev_cert_paths(out_dir)
    existing = [p for p in paths.values() if p.exists()]
    if existing and not force:
        raise CertificatesExistError(existing)
    base = paths["ca"].parent
    base.mkdir(parents=True, exist_ok=True, mode=0o700)

    now = dt.datetime.now(dt.UTC)
    not_before = now - dt.timedelta(minutes=5)  # tolerate small clock skew between hosts
    not_after = now + dt.timedelta(days=days)

    ca_key = _new_key(key_type)
    ca_name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmesh development"),
        x509.NameAttribute(NameOID.COMMON_NAME, "llmesh development CA"),
    ])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    server_sans = list(dict.fromkeys([*DEFAULT_SANS, *(s.strip() for s in sans if s.strip())]))
    serve = ExtendedKeyUsageOID.SERVER_AUTH
    dial = ExtendedKeyUsageOID.CLIENT_AUTH
    # name -> (common name, extended key usages, DNS/IP SANs, URI SANs)
    leaves: dict[str, tuple[str, list[x509.ObjectIdentifier], list[str], list[str]]] = {
        "server": ("localhost", [serve], server_sans, []),
        "client": (client_cn, [dial], [], [client_identity(client_cn)]),
        "operator": ("llmesh-operator", [dial], [], [OPERATOR_IDENTITY]),
        # A tier serves its callers and dials the tiers below with the same certificate.
        **{tier: (f"llmesh-{tier}", [serve, dial], server_sans, [tier_identity(tier)])
           for tier in TIERS},
    }

    def pem_key(key: PrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    _write(paths["ca"], ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    for name, (common_name, eku, dns_ip, uris) in leaves.items():
        key = _new_key(key_type)
        cert = _leaf(
            common_name=common_name, key=key, ca_key=ca_key, ca_cert=ca_cert, eku=eku,
            sans=dns_ip, uris=uris, not_before=not_before, not_after=not_after,
        )
        cert_path, key_path = identity_files(paths, name)
        _write(key_path, pem_key(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return paths


def ensure_dev_certs(
    out_dir: str | Path | None = None,
    *,
    sans: Sequence[str] = (),
    client_cn: str = "llmesh-client",
    days: int = 30,
    key_type: str = "ec",
) -> dict[str, Path]:
    """Return the existing certificate set, writing a new one only if none is there.

    Meant for ``llmesh up``: a second start reuses the certificates clients already trust.
    An existing set is returned as is (its SANs are not compared with ``sans``). A partial
    set (some files missing, e.g. one written before per-tier certificates) raises
    :class:`CertificatesExistError` naming the missing files rather than mixing old and
    new material; fix it with ``llmesh certs --force``.
    """
    paths = dev_cert_paths(out_dir)
    existing = [p for p in paths.values() if p.exists()]
    if len(existing) == len(paths):
        return paths
    if existing:
        raise CertificatesExistError(existing, [p for p in paths.values() if not p.exists()])
    return write_dev_certs(out_dir, sans=sans, client_cn=client_cn, days=days, key_type=key_type)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmesh certs",
        description=(
            "Write a development CA and certificates: one per tier (gateway.pem, router.pem, "
            "worker.pem, tokenizer.pem, postprocessor.pem, each with its identity "
            "spiffe://llmesh.local/tier/<tier> as a URI SAN), client.pem for the gateway's "
            "clients (opens no internal tier), operator.pem for `llmesh status`, and "
            "server.pem (no identity); keys in <name>-key.pem. For development and tests only."
        ),
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="directory to write to (default: ${LLMESH_HOME:-~/.cache/llmesh}/certs)",
    )
    parser.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME",
        help="extra server name or IP address for every serving certificate (repeatable; "
        "localhost, 127.0.0.1, ::1 are always in)",
    )
    parser.add_argument(
        "--client-cn", default="llmesh-client", help="common name of the client certificate"
    )
    parser.add_argument("--days", type=int, default=30, help="validity in days (default 30)")
    parser.add_argument(
        "--key-type", choices=("ec", "rsa"), default="ec", help="EC P-256 (default) or RSA 2048 keys"
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sans = [part for item in args.san for part in item.split(",")]
    try:
        paths = write_dev_certs(
            args.out,
            sans=sans,
            client_cn=args.client_cn,
            days=args.days,
            force=args.force,
            key_type=args.key_type,
        )
    except CertificatesExistError as exc:
        print(f"llmesh certs: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"llmesh certs: error: {exc}", file=sys.stderr)
        return 1
    width = max(len(k) for k in paths)
    for name, path in paths.items():
        print(f"{name.ljust(width)}  {path}")
    print(
        f"\nclient:  llmesh generate --ca {paths['ca']} "
        f"--cert {paths['client_cert']} --key {paths['client_key']} 'Hello'",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

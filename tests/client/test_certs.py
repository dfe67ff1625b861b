"""``llmesh certs`` and ``write_dev_certs``: contents, permissions, refusal to overwrite."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmesh import certs
from llmesh.certs import CertificatesExistError, ensure_dev_certs, write_dev_certs

TIERS = ["gateway", "router", "worker", "tokenizer", "postprocessor"]
FILES = [
    "ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem", "operator.pem",
    "operator-key.pem", *(f"{tier}{suffix}.pem" for tier in TIERS for suffix in ("", "-key")),
]


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in FILES}


def test_writes_a_ca_server_and_client_certificate(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path / "c", sans=["gw.internal", "10.1.2.3"], client_cn="backend-7", days=3)
    assert sorted(p.name for p in paths.values()) == sorted(FILES)
    for key in ("server_key", "client_key"):
        assert stat.S_IMODE(paths[key].stat().st_mode) == 0o600
    ca, server, client = _cert(paths["ca"]), _cert(paths["server_cert"]), _cert(paths["client_cert"])

    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (server, client):
        assert leaf.issuer == ca.subject
        leaf.verify_directly_issued_by(ca)
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        lifetime = leaf.not_valid_after_utc - dt.datetime.now(dt.UTC)
        assert dt.timedelta(days=2, hours=23) < lifetime <= dt.timedelta(days=3)
        assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
        assert leaf.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]

    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "gw.internal"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"), ipaddress.ip_address("10.1.2.3"),
    ]
    server_eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(server_eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    client_eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(client_eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "backend-7"


def _uris(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


def test_one_certificate_per_tier_with_its_identity(tmp_path: Path) -> None:
    """Each tier serves and dials with its own certificate, named by a SPIFFE-style URI
    SAN; the client and operator certificates only dial, with identities of their own."""
    paths = write_dev_certs(tmp_path, sans=["mesh.internal"], client_cn="backend-7")
    ca = _cert(paths["ca"])
    for tier in TIERS:
        cert = _cert(paths[f"{tier}_cert"])
        cert.verify_directly_issued_by(ca)
        assert stat.S_IMODE(paths[f"{tier}_key"].stat().st_mode) == 0o600
        assert _uris(cert) == [f"spiffe://llmesh.local/tier/{tier}"]
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == ["localhost", "mesh.internal"]
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"llmesh-{tier}"
    for name, identity in (("client", "spiffe://llmesh.local/client/backend-7"),
                           ("operator", "spiffe://llmesh.local/operator")):
        cert = _cert(paths[f"{name}_cert"])
        assert _uris(cert) == [identity]
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # server.pem keeps its old shape: serving only, no identity.
    server = _cert(paths["server_cert"])
    assert _uris(server) == []
    assert certs.identity_files(paths, "router") == (tmp_path / "router.pem", tmp_path / "router-key.pem")


def test_ensure_refuses_an_older_set_without_tier_certificates(tmp_path: Path) -> None:
    """A directory written before per-tier certificates: not silently mixed with new ones."""
    write_dev_certs(tmp_path)
    for tier in TIERS:
        (tmp_path / f"{tier}.pem").unlink()
    with pytest.raises(CertificatesExistError, match=r"router\.pem") as info:
        ensure_dev_certs(tmp_path)
    assert "--force" in str(info.value)
    assert tmp_path / "gateway.pem" in info.value.missing


def test_rsa_keys(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path, key_type="rsa")
    key = _cert(paths["server_cert"]).public_key()
    assert isinstance(key, rsa.RSAPublicKey) and key.key_size == 2048


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    write_dev_certs(tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(CertificatesExistError, match="--force") as info:
        write_dev_certs(tmp_path)
    assert len(info.value.existing) == len(FILES)
    assert _snapshot(tmp_path) == before
    # Even one stray file blocks a fresh write into that directory.
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "server.pem").write_text("keep me")
    with pytest.raises(FileExistsError):
        write_dev_certs(partial)
    assert (partial / "server.pem").read_text() == "keep me"
    assert not (partial / "ca.pem").exists()

    write_dev_certs(tmp_path, force=True)
    after = _snapshot(tmp_path)
    assert all(after[name] != before[name] for name in FILES)
    assert stat.S_IMODE((tmp_path / "client-key.pem").stat().st_mode) == 0o600


def test_ensure_reuses_an_existing_set(tmp_path: Path) -> None:
    first = ensure_dev_certs(tmp_path)
    before = _snapshot(tmp_path)
    assert ensure_dev_certs(tmp_path) == first
    assert _snapshot(tmp_path) == before


def test_default_location_is_under_llmesh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMESH_HOME", str(tmp_path))
    paths = write_dev_certs()
    assert paths["ca"] == tmp_path / "certs" / "ca.pem"


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="days"):
        write_dev_certs(tmp_path, days=0)
    with pytest.raises(ValueError, match="key_type"):
        write_dev_certs(tmp_path, key_type="dsa")
    assert not (tmp_path / "ca.pem").exists()


def test_cli_writes_then_refuses_then_forces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "certs"
    assert certs.main(["--out", str(out), "--san", "a.example,b.example", "--client-cn", "cli-user"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "ca.pem") in printed
    san = _cert(out / "server.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"a.example", "b.example"} <= set(san.get_values_for_type(x509.DNSName))
    before = _snapshot(out)

    assert certs.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "not overwriting" in err and "--force" in err
    assert _snapshot(out) == before

    assert certs.main(["--out", str(out), "--force", "--days", "1"]) == 0
    assert _snapshot(out)["ca.pem"] != before["ca.pem"]


def test_cli_through_the_llmesh_command(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "llmesh.cli", "certs", "--help"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and "--client-cn" in run.stdout and "--force" in run.stdout
    assert "operator.pem" in run.stdout and "spiffe://llmesh.local/tier/" in run.stdout
    run = subprocess.run(
        [sys.executable, "-m", "llmesh.cli", "certs", "--out", str(tmp_path), "--days", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 1 and "days" in run.stderr

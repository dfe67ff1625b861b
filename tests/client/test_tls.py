"""TLS and mutual TLS between the client and a server using ``write_dev_certs`` material."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmesh.certs import write_dev_certs
from llmesh.client import AsyncClient, Client, UnavailableError

from .fake_gateway import FakeGateway


def test_tls_with_ca(tls_gateway: FakeGateway, dev_certs: dict[str, Path]) -> None:
    with Client(tls_gateway.address, ca=dev_certs["ca"], timeout=10) as client:
        assert client.generate("secure").text == "echo: secure"
    # The extra SAN is in the certificate too: verify against it by name.
    with Client(
        tls_gateway.address, ca=dev_certs["ca"], server_name="llmesh.test", timeout=10
    ) as client:
        assert client.list_models()


def test_plaintext_client_cannot_talk_to_tls_server(tls_gateway: FakeGateway) -> None:
    with Client(tls_gateway.address, timeout=3, max_attempts=1) as client, pytest.raises(UnavailableError):
        client.generate("x")


def test_wrong_ca_or_name_is_refused(
    tls_gateway: FakeGateway, tmp_path: Path, dev_certs: dict[str, Path]
) -> None:
    other = write_dev_certs(tmp_path / "other")
    with (
        Client(tls_gateway.address, ca=other["ca"], timeout=3, max_attempts=1) as client,
        pytest.raises(UnavailableError),
    ):
        client.generate("x")
    with Client(
        tls_gateway.address, ca=dev_certs["ca"], server_name="not-in-the-cert", timeout=3, max_attempts=1
    ) as client, pytest.raises(UnavailableError):
        client.generate("x")


def test_mtls_requires_a_client_certificate(mtls_gateway: FakeGateway, dev_certs: dict[str, Path]) -> None:
    with (
        Client(mtls_gateway.address, ca=dev_certs["ca"], timeout=3, max_attempts=1) as client,
        pytest.raises(UnavailableError),
    ):
        client.generate("x")
    with Client(
        mtls_gateway.address,
        ca=dev_certs["ca"],
        cert=dev_certs["client_cert"],
        key=dev_certs["client_key"],
        timeout=10,
    ) as client:
        assert client.generate("mutual").text == "echo: mutual"


def test_mtls_refuses_a_certificate_from_another_ca(
    mtls_gateway: FakeGateway, dev_certs: dict[str, Path], tmp_path: Path
) -> None:
    other = write_dev_certs(tmp_path / "other")
    with Client(
        mtls_gateway.address,
        ca=dev_certs["ca"],
        cert=other["client_cert"],
        key=other["client_key"],
        timeout=3,
        max_attempts=1,
    ) as client, pytest.raises(UnavailableError):
        client.generate("x")


async def test_async_mtls(mtls_gateway: FakeGateway, dev_certs: dict[str, Path]) -> None:
    async with AsyncClient(
        mtls_gateway.address,
        ca=dev_certs["ca"],
        cert=dev_certs["client_cert"],
        key=dev_certs["client_key"],
        timeout=10,
    ) as client:
        stream = client.stream("both ways")
        assert (await stream.completion()).text == "echo: both ways"


def test_rsa_certificates_work_too(tmp_path: Path) -> None:
    certs = write_dev_certs(tmp_path, key_type="rsa")
    server = FakeGateway(
        tls_cert=str(certs["server_cert"]), tls_key=str(certs["server_key"]), tls_client_ca=str(certs["ca"])
    ).start()
    try:
        with Client(
            server.address, ca=certs["ca"], cert=certs["client_cert"], key=certs["client_key"], timeout=10
        ) as client:
            assert client.generate("rsa").text == "echo: rsa"
    finally:
        server.stop()


def test_missing_ca_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot read CA file"):
        Client("127.0.0.1:1", ca=tmp_path / "nope.pem")

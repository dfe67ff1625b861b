"""Fixtures: a fake public gateway (plaintext, TLS, mutual TLS) and development certificates."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmesh.certs import write_dev_certs

from .fake_gateway import FakeGateway


@pytest.fixture(scope="session")
def gateway() -> Iterator[FakeGateway]:
    server = FakeGateway().start()
    yield server
    server.stop()


@pytest.fixture
def fake(gateway: FakeGateway) -> FakeGateway:
    """The shared plaintext fake with its state reset for this test."""
    gateway.reset()
    return gateway


@pytest.fixture(scope="session")
def dev_certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_dev_certs(tmp_path_factory.mktemp("certs"), sans=["llmesh.test"])


@pytest.fixture(scope="session")
def tls_gateway(dev_certs: dict[str, Path]) -> Iterator[FakeGateway]:
    server = FakeGateway(tls_cert=str(dev_certs["server_cert"]), tls_key=str(dev_certs["server_key"]))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mtls_gateway(dev_certs: dict[str, Path]) -> Iterator[FakeGateway]:
    """Requires a client certificate signed by the development CA."""
    server = FakeGateway(
        tls_cert=str(dev_certs["server_cert"]),
        tls_key=str(dev_certs["server_key"]),
        tls_client_ca=str(dev_certs["ca"]),
    )
    server.start()
    yield server
    server.stop()

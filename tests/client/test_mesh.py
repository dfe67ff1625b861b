"""The client and ``llmesh generate``/``chat`` against a real local mesh (no vLLM).

Every tier is the real process started the way ``llmesh up`` starts it, over mutual TLS
with certificates from ``write_dev_certs`` and a tenant API key; the worker runs the
deterministic fake engine, so this needs no lock and starts in a few seconds.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmesh.client import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from llmesh.meshconfig import (
    GatewayConfig,
    MeshConfig,
    RouterConfig,
    TenantConfig,
    TlsConfig,
    WorkerConfig,
)
from llmesh.procs import free_port
from llmesh.up import Mesh

API_KEY = "client-tests-key"
REPO = Path(__file__).resolve().parents[2]


class MeshEndpoint:
    def __init__(self, address: str, certs: Path, http_url: str = "") -> None:
        self.address = address
        self.http_url = http_url
        self.ca = certs / "ca.pem"
        self.cert = certs / "client.pem"
        self.key = certs / "client-key.pem"

    def client(self, **kwargs: object) -> Client:
        options: dict[str, object] = {
            "api_key": API_KEY, "ca": self.ca, "cert": self.cert, "key": self.key, "timeout": 30,
        }
        options.update(kwargs)
        return Client(self.address, **options)  # type: ignore[arg-type]

    def tls_flags(self) -> list[str]:
        return ["--target", self.address, "--ca", str(self.ca), "--cert", str(self.cert),
                "--key", str(self.key)]


@pytest.fixture(scope="module")
def mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshEndpoint]:
    base = tmp_path_factory.mktemp("client-mesh")
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), settings={"drain_seconds": 0}),
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 5})],
        tls=TlsConfig(enabled=True, mutual=True, certs_dir=str(base / "certs")),
        tenants=[TenantConfig(name="client-tests", key_sha256=hashlib.sha256(API_KEY.encode()).hexdigest())],
    )
    running = Mesh(config, log_dir=base / "logs")
    try:
        running.start()
        yield MeshEndpoint(f"{config.gateway.host}:{config.gateway.port}", base / "certs", running.http_url())
    finally:
        running.stop()


def test_generate_stream_tokenize_list(mesh: MeshEndpoint) -> None:
    with mesh.client() as client:
        models = client.list_models()
        assert len(models) == 1 and models[0].is_default
        model = models[0]

        done = client.generate("Hello", max_tokens=6, temperature=0)
        assert done.finish_reason == "length"
        assert done.usage.completion_tokens == 6
        assert done.model == model.id
        assert done.served_by.zone == "zone-a" and done.served_by.worker_id
        assert done.request_id

        stream = client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
        deltas = list(stream)
        assert deltas and stream.final.text == "".join(deltas)
        assert stream.final.usage.completion_tokens == 5
        assert stream.final.timing.ttft_ms > 0

        toks = client.tokenize("Hello world")
        assert toks.count == len(toks.token_ids) > 0
        assert toks.tokenizer_checksum == model.tokenizer_checksum


def test_errors_from_the_real_gateway(mesh: MeshEndpoint) -> None:
    with mesh.client() as client:
        with pytest.raises(InvalidArgumentError) as info:
            client.generate("x", temperature=-1)
        assert info.value.field_violations[0].field == "sampling.temperature"
        with pytest.raises(NotFoundError):
            client.generate("x", model="no-such-model")
    with mesh.client(api_key=None) as anonymous, pytest.raises(UnauthenticatedError):
        anonymous.generate("x")
    with (
        mesh.client(cert=None, key=None, timeout=5, max_attempts=1) as no_cert,
        pytest.raises(UnavailableError),
    ):
        no_cert.generate("x")


async def test_async_client(mesh: MeshEndpoint) -> None:
    async with AsyncClient(
        mesh.address, api_key=API_KEY, ca=mesh.ca, cert=mesh.cert, key=mesh.key, timeout=30
    ) as client:
        stream = client.stream("Once", max_tokens=4, temperature=0)
        done = await stream.completion()
        assert done.usage.completion_tokens == 4
        again = await client.generate("Once", max_tokens=4, temperature=0)
        assert again.text == done.text  # greedy on the deterministic engine


def _llmesh(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMESH_")}
    env["LLMESH_API_KEY"] = API_KEY
    return subprocess.run(
        [sys.executable, "-m", "llmesh.cli", *args], input=stdin, capture_output=True, text=True,
        timeout=60, cwd=REPO, env=env,
    )


def test_cli_generate_and_chat(mesh: MeshEndpoint) -> None:
    run = _llmesh("generate", "Hello", "--max-tokens", "5", "--temperature", "0", *mesh.tls_flags())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    assert "finish=length" in run.stderr and "tokens=" in run.stderr and "served_by=" in run.stderr

    run = _llmesh("chat", "--max-tokens", "4", "--summary", *mesh.tls_flags(), stdin="hi\nand again\n")
    assert run.returncode == 0, run.stderr
    summaries = [line for line in run.stderr.splitlines() if line.startswith("[finish=")]
    assert len(summaries) == 2
    # The second turn carries the first exchange: its prompt is longer.
    prompt_tokens = [int(s.split("tokens=")[1].split("+")[0]) for s in summaries]
    assert prompt_tokens[1] > prompt_tokens[0]


def test_mutual_tls_refuses_clients_without_a_certificate(mesh: MeshEndpoint) -> None:
    """The secure mesh refuses plaintext and certificate-less TLS, at the gateway and at
    every internal hop."""
    import grpc

    from llmesh.procs import check_health

    with pytest.raises(UnavailableError), mesh.client(cert=None, key=None, max_attempts=1) as client:
        client.generate("hello", max_tokens=2)
    assert check_health(mesh.address) == "UNREACHABLE"  # plaintext
    no_cert = grpc.ssl_channel_credentials(root_certificates=mesh.ca.read_bytes())
    assert check_health(mesh.address, credentials=no_cert) == "UNREACHABLE"
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=mesh.ca.read_bytes(), private_key=mesh.key.read_bytes(),
        certificate_chain=mesh.cert.read_bytes(),
    )
    assert check_health(mesh.address, credentials=with_cert) == "SERVING"


def test_http_surface_is_https_with_client_certificates_in_a_tls_mesh(mesh: MeshEndpoint) -> None:
    """Plaintext gRPC refused means plaintext HTTP refused too; mutual TLS holds on HTTP."""
    import ssl

    import httpx
    import openai

    assert mesh.http_url.startswith("https://")
    plain = mesh.http_url.replace("https://", "http://", 1)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/v1/models", headers={"authorization": f"Bearer {API_KEY}"}, timeout=5)
    no_cert = ssl.create_default_context(cafile=str(mesh.ca))
    with pytest.raises(httpx.HTTPError):
        # TLS 1.3 reports a missing client certificate after the handshake, on first read.
        httpx.get(f"{mesh.http_url}/v1/models", headers={"authorization": f"Bearer {API_KEY}"},
                  verify=no_cert, timeout=5)
    with_cert = ssl.create_default_context(cafile=str(mesh.ca))
    with_cert.load_cert_chain(str(mesh.cert), str(mesh.key))
    with httpx.Client(verify=with_cert, timeout=30) as http:
        api = openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key=API_KEY, http_client=http,
                            max_retries=0)
        reply = api.completions.create(model="tiny-deepseek", prompt="hello", max_tokens=4)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="wrong", http_client=http,
                          max_retries=0).models.list()

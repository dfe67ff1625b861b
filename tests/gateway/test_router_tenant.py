"""The authenticated tenant reaches the router (its admission gives each tenant a queue share)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.core import Deadline, GatewayCore
from gateway.tenants import Tenant, TenantRegistry
from gateway.tiers import GrpcRouterTier
from gateway.types import ChatTurn, Encoded, GenerateCall, ModelMeta, Sampling, TokenGeneration
from llmesh.router.v1 import router_pb2, router_pb2_grpc
from services.common.errors import ResourceExhausted


class _Tokenizer:
    async def list_models(self, *, timeout: float | None) -> list[ModelMeta]:
        return [ModelMeta(id="m", max_context_length=2048, tokenizer_checksum="sha", is_default=True)]

    async def encode(self, model: str, prompt: str, messages: list[ChatTurn], *,
                     add_generation_prompt: bool | None, timeout: float | None) -> Encoded:
        return Encoded(model=model, token_ids=[1, 2, 3], tokenizer_checksum="sha")


class _RecordingRouter:
    """Records what the core asks for, then refuses it as a full router would."""

    replicas = 1

    def __init__(self) -> None:
        self.generations: list[TokenGeneration] = []

    def generate(self, replica: int, request: TokenGeneration, **kwargs: object) -> object:
        self.generations.append(request)
        raise ResourceExhausted("router queue full", retry_after_s=2.0)

    async def abort(self, *args: object, **kwargs: object) -> None:
        return None


class _IdleSession:
    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def send_tokens(self, token_ids: list[int]) -> None:
        return None

    async def send_end(self, finish_reason: str) -> None:
        return None

    async def read(self) -> None:
        await self.closed.wait()

    async def close(self, graceful: bool = False) -> None:
        self.closed.set()


class _Post:
    replicas = 1

    async def open(self, *args: object, **kwargs: object) -> _IdleSession:
        return _IdleSession()


async def test_the_gateway_core_names_the_tenant_in_the_router_request() -> None:
    router = _RecordingRouter()
    core = GatewayCore(_Tokenizer(), router, _Post(),  # type: ignore[arg-type]
                       tenants=TenantRegistry([]))
    with pytest.raises(ResourceExhausted):
        await core.generate(Tenant(name="acme"), GenerateCall(prompt="hi", priority=3), Deadline.after(10))
    (generation,) = router.generations
    assert generation.tenant == "acme" and generation.priority == 3


class _CapturingRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        yield router_pb2.GenerateResponse()  # pragma: no cover


async def test_the_router_tier_sends_the_tenant_on_the_wire() -> None:
    servicer = _CapturingRouter()
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port
    await server.start()
    tier = GrpcRouterTier([f"127.0.0.1:{port}"])
    try:
        generation = TokenGeneration(request_id="r1", model="m", prompt_token_ids=[1, 2],
                                     sampling=Sampling(max_tokens=2), priority=5, tenant="acme")
        with pytest.raises(ResourceExhausted):
            async for _ in tier.generate(0, generation, resume_token_ids=[], resumed=0, timeout=5):
                pass
        (sent,) = servicer.requests
        assert sent.tenant == "acme" and sent.request.priority == 5
    finally:
        await tier.close()
        await server.stop(0)

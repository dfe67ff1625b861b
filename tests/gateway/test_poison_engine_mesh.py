"""Issue 16, finding 1, through the real vLLM CPU engine: a burst of requests the engine
refuses, interleaved with normal ones, never takes the worker out of routing.

The poison goes both through the public API and straight to a router (as the original
probe did: one every 0.5 s to the router failed 166 of 180 other requests), with values
vLLM refuses (temperature 5, logprobs beyond the engine's max_logprobs, a penalty out of
range). Each gets INVALID_ARGUMENT naming the public field; every normal request is
served; the router still lists the worker SERVING with a closed circuit.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from llmesh.common.v1 import common_pb2
from llmesh.router.v1 import router_pb2, router_pb2_grpc
from llmesh.v1 import inference_pb2
from tests.gateway.helpers import request, stub, violations

pytestmark = pytest.mark.engine

POISON = [("temperature", 5.0), ("logprobs", 50), ("presence_penalty", 3.0), ("temperature", 100.0)]


async def test_engine_rejections_never_eject_the_worker(engine_mesh) -> None:  # type: ignore[no-untyped-def]
    gateway = f"{engine_mesh.config.gateway.host}:{engine_mesh.config.gateway.port}"
    # The HA tests share this mesh and may have killed a router replica.
    routers = [p.address for p in engine_mesh.procs if p.tier == "router" and p.alive()]
    async with grpc.aio.insecure_channel(gateway) as gw_channel:
        api = stub(gw_channel)
        tokens = await api.Tokenize(inference_pb2.TokenizeRequest(prompt="The capital of France is"),
                                    timeout=30)
        prompt = list(tokens.token_ids)

        async def normal(i: int) -> str:
            reply = await api.Generate(request(prompt=f"Count to {i}:", sampling={"max_tokens": 4}),
                                       timeout=120)
            assert reply.usage.completion_tokens >= 1
            return str(reply.finish_reason)

        async def poison_via_gateway(name: str, value: float) -> list[str]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await api.Generate(request(prompt="x", sampling={name: value, "max_tokens": 4}), timeout=60)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value
            return violations(err.value)

        async def poison_via_router(address: str, name: str, value: float) -> list[str]:
            async with grpc.aio.insecure_channel(address) as channel:
                token_request = common_pb2.TokenRequest(prompt_token_ids=prompt)
                token_request.sampling.max_tokens = 4
                setattr(token_request.sampling, name, value)
                call = router_pb2_grpc.RouterServiceStub(channel).Generate(
                    router_pb2.GenerateRequest(request=token_request), timeout=60)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value
                return violations(err.value)

        jobs = []
        for i in range(12):
            name, value = POISON[i % len(POISON)]
            jobs.append(normal(i))
            jobs.append(poison_via_router(routers[i % len(routers)], name, value))
            jobs.append(poison_via_gateway(name, value))
        results = await asyncio.gather(*jobs)
        normals, via_router, via_gateway = results[0::3], results[1::3], results[2::3]
        assert len(normals) == 12  # every normal request served (each asserted above)
        for i, fields in enumerate(via_router):
            assert fields == [f"request.sampling.{POISON[i % len(POISON)][0]}"]
        for i, fields in enumerate(via_gateway):
            assert fields == [f"sampling.{POISON[i % len(POISON)][0]}"]  # public paths only

        for address in routers:
            async with grpc.aio.insecure_channel(address) as channel:
                listing = await router_pb2_grpc.RouterServiceStub(channel).ListWorkers(
                    router_pb2.ListWorkersRequest(), timeout=10)
            (worker,) = listing.workers
            assert worker.health == "SERVING"
            assert worker.circuit == router_pb2.CIRCUIT_STATE_CLOSED
        # And the mesh still serves.
        assert await normal(99)

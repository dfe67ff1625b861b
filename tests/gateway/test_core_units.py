"""The gateway core without servers: sampling defaults, and refusing a tokenizer replica
whose checksum is not the model's."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core import Deadline, GatewayCore, _to_engine_sampling
from gateway.server import build_core
from gateway.settings import GatewaySettings
from gateway.tenants import Tenant, TenantRegistry
from gateway.types import ChatTurn, Encoded, GenerateCall, ModelMeta, Sampling
from services.common.errors import Internal, Unavailable


def test_unset_temperature_takes_the_default_and_stops_are_left_to_the_postprocessor() -> None:
    call = GenerateCall(prompt="x", sampling=Sampling(stop=["END"]))
    out = _to_engine_sampling(call, 16, 0.0)
    assert out.sampling.temperature == 0.0
    assert out.sampling.max_tokens == 16
    assert out.sampling.stop == []
    assert call.sampling.temperature is None  # the caller's call is not modified


def test_an_explicit_temperature_is_kept() -> None:
    call = GenerateCall(prompt="x", sampling=Sampling(temperature=0.7))
    assert _to_engine_sampling(call, 16, 0.0).sampling.temperature == 0.7


def test_no_default_leaves_temperature_to_the_engine() -> None:
    call = GenerateCall(prompt="x")
    assert _to_engine_sampling(call, 16, None).sampling.temperature is None


async def test_settings_map_a_negative_default_temperature_to_the_engines() -> None:
    for value, expected in ((None, 0.0), (-1.0, None), (0.8, 0.8)):
        settings = GatewaySettings() if value is None else GatewaySettings(default_temperature=value)
        core, tiers, _ = build_core(settings)
        try:
            assert core.config.default_temperature == expected
        finally:
            for tier in tiers:
                await tier.close()


class _TokenizerReplicas:
    """A tokenizer tier whose replica that encodes loaded another tokenizer than the one
    that listed the models (a half-finished rollout)."""

    def __init__(self, listed: str, encoding: str, *, turns: int = 0) -> None:
        self.listed, self.encoding = listed, encoding
        self.turns = turns
        """Event-loop turns the answer takes (a real tier's takes a round trip)."""

    async def list_models(self, *, timeout: float | None) -> list[ModelMeta]:
        return [ModelMeta(id="m", max_context_length=2048, tokenizer_checksum=self.listed, is_default=True)]

    async def encode(self, model: str, prompt: str, messages: list[ChatTurn], *,
                     add_generation_prompt: bool | None, timeout: float | None) -> Encoded:
        for _ in range(self.turns):
            await asyncio.sleep(0)
        return Encoded(model=model, token_ids=[1, 2, 3], tokenizer_checksum=self.encoding)


class _UnusedPostSession:
    """A postprocessor request that must get no tokens, only its close."""

    def __init__(self) -> None:
        self.closed = False

    async def send_tokens(self, token_ids: list[int]) -> None:
        raise AssertionError("a request with a mismatched tokenizer must not reach the postprocessor")

    async def send_end(self, finish_reason: str) -> None:
        raise AssertionError("a request with a mismatched tokenizer must not reach the postprocessor")

    async def read(self) -> None:
        await asyncio.Event().wait()  # nothing comes back for a request that got nothing

    async def close(self, graceful: bool = False) -> None:
        self.closed = True


class _NoTier:
    replicas = 1

    def __init__(self) -> None:
        self.sessions: list[_UnusedPostSession] = []

    def generate(self, *args: object, **kwargs: object) -> object:
        # An error of the request's own (not a transport failure): the gateway passes it on.
        raise Unavailable("reached the router")

    async def open(self, *args: object, **kwargs: object) -> _UnusedPostSession:
        self.sessions.append(_UnusedPostSession())
        return self.sessions[-1]

    async def abort(self, *args: object, **kwargs: object) -> None:
        return None


async def test_a_tokenizer_replica_with_another_checksum_is_refused() -> None:
    """Token ids from a tokenizer other than the model's would make the workers generate
    garbage: the gateway answers UNAVAILABLE before anything reaches the router."""
    post = _NoTier()
    core = GatewayCore(_TokenizerReplicas("sha-a", "sha-b", turns=5), _NoTier(), post,  # type: ignore[arg-type]
                       tenants=TenantRegistry([]))
    with pytest.raises(Unavailable, match="checksum"):
        await core.generate(Tenant(name="t"), GenerateCall(prompt="hello"), Deadline.after(10))
    # Nor the postprocessor: its request opens only once the router has the request's.
    await asyncio.sleep(0.01)
    assert post.sessions == []
    same = GatewayCore(_TokenizerReplicas("sha-a", "sha-a"), _NoTier(), _NoTier(),  # type: ignore[arg-type]
                       tenants=TenantRegistry([]))
    # The control: with matching checksums the same request goes on to the tiers.
    with pytest.raises(Unavailable, match="reached the router"):
        await same.generate(Tenant(name="t"), GenerateCall(prompt="hello"), Deadline.after(10))


class _BuggyTier(_NoTier):
    """A tier client with a bug: it raises what no tier should (not an llmesh error)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def generate(self, *args: object, **kwargs: object) -> object:
        if self.where == "router":
            raise RuntimeError("bug in the router client")
        return self._silent_router()

    async def _silent_router(self):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()  # the router sends nothing: only the bug ends it
        yield

    async def open(self, *args: object, **kwargs: object) -> _UnusedPostSession:
        session = await super().open(*args, **kwargs)
        if self.where == "postprocessor":
            async def read() -> None:
                raise RuntimeError("bug in the postprocessor client")
            session.read = read  # type: ignore[method-assign]
        return session


@pytest.mark.parametrize("where", ["router", "postprocessor"])
async def test_a_bug_on_one_side_ends_the_request_internal_at_once(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Not an llmesh error (a bug): the caller gets INTERNAL now, not a wait until its
    deadline, and the traceback is logged."""
    buggy = _BuggyTier(where)
    core = GatewayCore(_TokenizerReplicas("sha-a", "sha-a"), buggy, buggy,  # type: ignore[arg-type]
                       tenants=TenantRegistry([]))
    with pytest.raises(Internal, match=f"{where} side: RuntimeError"):
        await asyncio.wait_for(
            core.generate(Tenant(name="t"), GenerateCall(prompt="hello"), Deadline.after(600)), 30)
    assert f"bug in the {where} client" in caplog.text

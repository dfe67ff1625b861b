"""The gateway core's failover across router and postprocessor replicas under the shared
retry policy, without servers: which replica each attempt goes to, what it resumes from,
when the budget or the deadline ends the request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import REGISTRY

from gateway.core import Deadline, GatewayConfig, GatewayCore, TierUnavailable
from gateway.tenants import Tenant, TenantRegistry
from gateway.types import (
    ChatTurn,
    Encoded,
    Final,
    FinishReason,
    GenerateCall,
    ModelMeta,
    PostConfig,
    PostDelta,
    PostFinal,
    RouterDelta,
    RouterFinal,
    Sampling,
    TextDelta,
    TokenGeneration,
)
from services.common.errors import DeadlineExceeded, InvalidArgument
from services.common.retry import RetryPolicy

MAX_TOKENS = 6
FAST = RetryPolicy(max_failovers=1, count_replicas=True, base_backoff_s=0.001, max_backoff_s=0.002)


class _Tokenizer:
    async def list_models(self, *, timeout: float | None) -> list[ModelMeta]:
        return [ModelMeta(id="m", max_context_length=2048, tokenizer_checksum="", is_default=True)]

    async def encode(self, model: str, prompt: str, messages: list[ChatTurn], *,
                     add_generation_prompt: bool | None, timeout: float | None) -> Encoded:
        return Encoded(model=model, token_ids=[1, 2, 3], tokenizer_checksum="")


class _Router:
    """Two replicas; attempt i delivers ``plan[i]`` tokens then breaks (None: finishes).
    Token n of the completion is 100 + n, whatever attempt produces it."""

    replicas = 2

    def __init__(self, plan: list[int | None], error: Exception | None = None, *, turns: int = 0) -> None:
        self.plan = plan
        self.error = error
        self.turns = turns
        """Event-loop turns before an attempt's first token (a real one takes a prefill)."""
        self.calls: list[tuple[int, list[int], int]] = []

    async def generate(
        self, replica: int, request: TokenGeneration, *, resume_token_ids: list[int],
        resumed: int, timeout: float | None, on_delta: object = None,
    ) -> AsyncIterator[RouterDelta | RouterFinal]:
        self.calls.append((replica, list(resume_token_ids), resumed))
        if self.error is not None:
            raise self.error
        deliver = self.plan[len(self.calls) - 1] if len(self.calls) <= len(self.plan) else 0
        start = len(resume_token_ids)
        end = MAX_TOKENS if deliver is None else min(MAX_TOKENS, start + deliver)
        for _ in range(self.turns):
            await asyncio.sleep(0)
        for n in range(start, end):
            yield RouterDelta(token_ids=[100 + n])
            await asyncio.sleep(0)
        if deliver is None:
            yield RouterFinal(Final(FinishReason.LENGTH, completion_tokens=MAX_TOKENS))
            return
        raise TierUnavailable(f"router replica {replica} went away")

    async def abort(self, replica: int, request_id: str) -> None:
        return None


class _EchoSession:
    """Each token's text is ``<id>``; the first ``skip`` characters are suppressed."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.queue: asyncio.Queue[PostDelta | PostFinal] = asyncio.Queue()

    async def send_tokens(self, token_ids: list[int]) -> None:
        for token in token_ids:
            text = f"<{token}>"
            cut = min(self.skip, len(text))
            self.skip -= cut
            if text[cut:]:
                self.queue.put_nowait(PostDelta(text[cut:]))

    async def send_end(self, finish_reason: str) -> None:
        self.queue.put_nowait(PostFinal(finish_reason=finish_reason))

    async def read(self) -> PostDelta | PostFinal | None:
        return await self.queue.get()

    async def close(self, graceful: bool = False) -> None:
        return None


class _Post:
    replicas = 2

    def __init__(self, failing_opens: int = 0) -> None:
        self.failing_opens = failing_opens
        self.opens: list[int] = []

    async def open(self, replica: int, config: PostConfig, *, timeout: float | None) -> _EchoSession:
        self.opens.append(replica)
        if len(self.opens) <= self.failing_opens:
            raise TierUnavailable(f"postprocessor replica {replica} is down")
        return _EchoSession(config.skip_chars)


def _core(router: _Router, post: _Post | None = None, policy: RetryPolicy = FAST) -> GatewayCore:
    return GatewayCore(_Tokenizer(), router, post or _Post(),  # type: ignore[arg-type]
                       tenants=TenantRegistry([]), config=GatewayConfig(failover=policy))


async def _run(core: GatewayCore, deadline_s: float = 10.0) -> tuple[str, int]:
    text: list[str] = []
    resumed = -1
    call = GenerateCall(prompt="x", sampling=Sampling(max_tokens=MAX_TOKENS))
    async for item in core.generate_stream(Tenant(name="t"), call, Deadline.after(deadline_s)):
        if isinstance(item, TextDelta):
            text.append(item.text)
        else:
            resumed = item.served_by.resumed
    return "".join(text), resumed


def _failovers(tier: str, kind: str) -> float:
    return REGISTRY.get_sample_value(
        "llmesh_gateway_failovers_total", {"tier": tier, "kind": kind}
    ) or 0.0


FULL_TEXT = "".join(f"<{100 + n}>" for n in range(MAX_TOKENS))


async def test_a_retry_then_a_resume_move_to_the_other_replica_each_time() -> None:
    router = _Router([0, 2, None])
    before = (_failovers("router", "retry"), _failovers("router", "resume"))
    text, resumed = await _run(_core(router))
    assert text == FULL_TEXT
    assert resumed == 1
    # Each move goes to the replica after the one that failed, with the tokens so far.
    first = router.calls[0][0]
    assert router.calls == [(first, [], 0), (1 - first, [], 0), (first, [100, 101], 1)]
    assert (_failovers("router", "retry"), _failovers("router", "resume")) == (
        before[0] + 1, before[1] + 1,
    )


async def test_router_replicas_failing_past_the_budget_end_unavailable() -> None:
    router = _Router([0, 0, 0, 0, None])
    with pytest.raises(TierUnavailable):
        await _run(_core(router))
    # max_failovers 1 plus one pass over the other replica: 2 moves, 3 attempts.
    assert len(router.calls) == FAST.budget(2) + 1 == 3


async def test_a_backoff_that_would_pass_the_deadline_ends_the_request_at_once() -> None:
    router = _Router([1, None])
    slow = RetryPolicy(max_failovers=3, base_backoff_s=30.0, max_backoff_s=30.0, jitter=0.0)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(_run(_core(router, policy=slow), deadline_s=3.0), 2.5)
    assert time.monotonic() - started < 2.0
    assert len(router.calls) == 1


async def test_a_routers_refusal_of_the_request_is_not_retried() -> None:
    router = _Router([], error=InvalidArgument("sampling.top_k", "too big"))
    with pytest.raises(InvalidArgument):
        await _run(_core(router))
    assert len(router.calls) == 1


async def test_a_postprocessor_that_cannot_be_opened_is_replaced_within_the_budget() -> None:
    post = _Post(failing_opens=2)
    before = _failovers("postprocessor", "replay")
    text, _ = await _run(_core(_Router([None]), post))
    assert text == FULL_TEXT
    assert post.opens == [post.opens[0], 1 - post.opens[0], post.opens[0]]
    assert _failovers("postprocessor", "replay") == before + 2


async def test_postprocessor_replicas_failing_past_the_budget_end_unavailable() -> None:
    post = _Post(failing_opens=10)
    with pytest.raises(TierUnavailable, match="keep failing"):
        await _run(_core(_Router([None]), post))
    assert len(post.opens) == FAST.budget(2) + 1

"""The one retry/resume policy: budgets, backoff growth and cap, deadline clipping, the
decision table, and each tier's settings read into it."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.core import DEFAULT_FAILOVER
from gateway.settings import GatewaySettings
from services.common.errors import DeadlineExceeded
from services.common.retry import RETRYABLE_KINDS, Failovers, RetryPolicy, Step
from services.router.settings import RouterSettings
from services.router.workerapi import WorkerCallError

ALL_KINDS = ("transport", "failed", "overloaded", "rejected", "deadline", "cancelled")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- budget -------------------------------------------------------------------------


def test_the_budget_is_max_failovers_alone_unless_replicas_count() -> None:
    router = RetryPolicy(max_failovers=3)
    assert [router.budget(n) for n in (0, 1, 2, 5)] == [3, 3, 3, 3]
    gateway = RetryPolicy(max_failovers=3, count_replicas=True)
    # One move per replica beyond the first: a pass over the others is not charged.
    assert [gateway.budget(n) for n in (0, 1, 2, 5)] == [3, 3, 4, 7]
    assert RetryPolicy(max_failovers=0).budget(4) == 0


def test_a_request_moves_exactly_budget_times_then_is_exhausted() -> None:
    failovers = RetryPolicy(max_failovers=2, count_replicas=True).start(replicas=2)
    assert failovers.budget == 3
    steps = [failovers.failed("transport", delivered=False) for _ in range(4)]
    assert steps == [Step.RETRY, Step.RETRY, Step.RETRY, Step.EXHAUSTED]
    assert (failovers.failures, failovers.retries, failovers.resumes) == (4, 3, 0)


def test_no_failovers_means_the_first_failure_is_final() -> None:
    failovers = RetryPolicy(max_failovers=0).start()
    assert failovers.failed("transport", delivered=True) is Step.EXHAUSTED
    assert (failovers.retries, failovers.resumes) == (0, 0)


def test_retries_and_resumes_share_one_budget() -> None:
    failovers = RetryPolicy(max_failovers=3).start()
    assert failovers.failed("failed", delivered=False) is Step.RETRY
    assert failovers.failed("transport", delivered=True) is Step.RESUME
    assert failovers.failed("overloaded", delivered=True) is Step.RESUME
    assert failovers.failed("transport", delivered=True) is Step.EXHAUSTED
    assert (failovers.failures, failovers.retries, failovers.resumes) == (4, 1, 2)


def test_a_non_retryable_failure_is_not_charged() -> None:
    failovers = RetryPolicy(max_failovers=1).start()
    assert failovers.failed("rejected", delivered=True) is Step.FAIL
    assert failovers.failures == 0
    assert failovers.failed("transport", delivered=False) is Step.RETRY


# ---- decision table -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("delivered", [False, True])
@pytest.mark.parametrize("failures", [1, 3, 4])
def test_decision_table(kind: str, delivered: bool, failures: int) -> None:
    policy = RetryPolicy(max_failovers=3)
    step = policy.decide(kind, delivered=delivered, failures=failures)
    if kind not in ("transport", "failed", "overloaded"):
        expected = Step.FAIL  # the request's own error goes back, budget or not
    elif failures > 3:
        expected = Step.EXHAUSTED
    elif delivered:
        expected = Step.RESUME
    else:
        expected = Step.RETRY
    assert step is expected
    assert step.moves is (expected in (Step.RETRY, Step.RESUME))


def test_the_router_moves_on_exactly_the_policys_kinds() -> None:
    assert {"transport", "failed", "overloaded"} == RETRYABLE_KINDS
    for kind in ALL_KINDS:
        assert WorkerCallError(kind, "X", "m").retryable is (kind in RETRYABLE_KINDS)


# ---- backoff --------------------------------------------------------------------------


def test_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    policy = RetryPolicy(base_backoff_s=0.02, max_backoff_s=0.5, jitter=0.0)
    got = [policy.backoff_s(n) for n in range(0, 8)]
    assert got == pytest.approx([0.0, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5])
    assert policy.backoff_s(10_000) == 0.5  # no overflow far past the cap


def test_full_jitter_spans_zero_to_the_ceiling() -> None:
    policy = RetryPolicy(base_backoff_s=0.1, max_backoff_s=1.0, jitter=1.0)
    assert policy.backoff_s(3, draw=0.0) == pytest.approx(0.4)
    assert policy.backoff_s(3, draw=0.999) == pytest.approx(0.0004)
    random.seed(7)
    samples = [policy.backoff_s(3) for _ in range(2000)]
    assert all(0.0 <= s <= 0.4 for s in samples)
    assert min(samples) < 0.04 and max(samples) > 0.36  # the whole range is used


def test_half_jitter_keeps_half_the_ceiling() -> None:
    policy = RetryPolicy(base_backoff_s=0.05, max_backoff_s=0.5, jitter=0.5)
    for n, ceiling in ((1, 0.05), (2, 0.1), (4, 0.4), (5, 0.5), (9, 0.5)):
        assert policy.backoff_s(n, draw=0.0) == pytest.approx(ceiling)
        assert policy.backoff_s(n, draw=0.9999) == pytest.approx(ceiling / 2, rel=1e-3)


def test_the_pause_follows_the_failures_so_far() -> None:
    failovers = RetryPolicy(base_backoff_s=0.01, max_backoff_s=1.0, jitter=0.0).start()
    assert failovers.next_pause_s() == 0.0
    failovers.failed("transport", delivered=False)
    failovers.failed("transport", delivered=True)
    assert failovers.next_pause_s() == pytest.approx(0.02)


@pytest.mark.parametrize(
    "values",
    [{"max_failovers": -1}, {"base_backoff_s": -0.1}, {"max_backoff_s": -1.0}, {"jitter": 1.5},
     {"jitter": -0.1}],
)
def test_nonsense_policies_are_refused(values: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**values)  # type: ignore[arg-type]


# ---- deadline -------------------------------------------------------------------------


def _failed_once(deadline: float | None, clock: Clock) -> Failovers:
    policy = RetryPolicy(base_backoff_s=0.2, max_backoff_s=1.0, jitter=0.0)
    failovers = policy.start(deadline=deadline, clock=clock)
    failovers.failed("transport", delivered=False)
    return failovers


def test_a_pause_that_ends_before_the_deadline_is_taken() -> None:
    clock = Clock()
    assert _failed_once(clock.now + 0.21, clock).next_pause_s() == pytest.approx(0.2)
    assert _failed_once(None, clock).next_pause_s() == pytest.approx(0.2)


@pytest.mark.parametrize("left", [0.2, 0.19, 0.0, -1.0])
def test_a_pause_that_would_reach_the_deadline_fails_at_once(left: float) -> None:
    clock = Clock()
    failovers = _failed_once(clock.now + left, clock)
    with pytest.raises(DeadlineExceeded):
        failovers.next_pause_s()


async def test_pause_does_not_sleep_into_the_deadline() -> None:
    policy = RetryPolicy(base_backoff_s=30.0, max_backoff_s=30.0, jitter=0.0)
    loop = asyncio.get_running_loop()
    failovers = policy.start(deadline=loop.time() + 5.0, clock=loop.time)
    failovers.failed("transport", delivered=False)
    started = loop.time()
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(failovers.pause(), 2.0)  # TimeoutError if it slept
    assert loop.time() - started < 1.0


# ---- each tier's settings read into the one type -----------------------------------------


def test_router_settings_give_the_routers_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RouterSettings().retry_policy() == RetryPolicy(
        max_failovers=3, count_replicas=False, base_backoff_s=0.02, max_backoff_s=0.5, jitter=1.0
    )
    monkeypatch.setenv("LLMESH_ROUTER_MAX_RETRIES", "5")
    monkeypatch.setenv("LLMESH_ROUTER_RETRY_BASE_BACKOFF_MS", "10")
    monkeypatch.setenv("LLMESH_ROUTER_RETRY_MAX_BACKOFF_MS", "80")
    policy = RouterSettings().retry_policy()
    assert (policy.max_failovers, policy.base_backoff_s, policy.max_backoff_s) == (5, 0.01, 0.08)


def test_gateway_settings_give_the_gateways_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The core's default (tests that build a GatewayCore bare) is the settings' default.
    assert GatewaySettings().failover_policy() == DEFAULT_FAILOVER == RetryPolicy(
        max_failovers=3, count_replicas=True, base_backoff_s=0.05, max_backoff_s=0.5, jitter=0.5
    )
    monkeypatch.setenv("LLMESH_GATEWAY_MAX_RESUMES", "1")
    monkeypatch.setenv("LLMESH_GATEWAY_RETRY_BASE_BACKOFF_MS", "20")
    monkeypatch.setenv("LLMESH_GATEWAY_RETRY_MAX_BACKOFF_MS", "100")
    policy = GatewaySettings().failover_policy()
    assert (policy.max_failovers, policy.base_backoff_s, policy.max_backoff_s) == (1, 0.02, 0.1)
    assert policy.budget(2) == 2

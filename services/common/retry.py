"""One retry/resume policy for a stream that may move between replicas.

Two tiers move a stream when the replica carrying it fails: the router across workers,
the gateway across router replicas (and postprocessor replicas). Both follow the rules
here, each with its own settings values read into one :class:`RetryPolicy`:

* the decision, from the failure's kind and whether tokens were already delivered:
  ``RETRY`` (nothing delivered: start over elsewhere), ``RESUME`` (tokens delivered:
  continue elsewhere from them), ``FAIL`` (the request itself is at fault: the caller
  gets that error) or ``EXHAUSTED`` (the attempt budget is spent);
* the attempt budget: ``max_failovers`` moves, plus one per replica beyond the first when
  ``count_replicas`` (so a pass over the other replicas is not charged to it);
* the backoff between attempts: exponential from ``base_backoff_s``, capped at
  ``max_backoff_s``, with a ``jitter`` fraction of it drawn at random so streams failing
  together do not all come back at the same instant;
* the deadline: a pause that would reach the request's deadline is not taken, the
  request fails with DEADLINE_EXCEEDED at once.

Plain Python, no grpc: the cores call :meth:`RetryPolicy.start` per request and ask the
returned :class:`Failovers` what to do after each failure.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import DeadlineExceeded

RETRYABLE_KINDS = frozenset({"transport", "failed", "overloaded"})
"""Failure kinds another replica may cure:

- ``transport``: the replica or the link failed (unreachable, reset, engine dead);
- ``failed``: the replica answered but failed this request (an engine error finish);
- ``overloaded``: the replica refused for load.

Any other kind (``rejected``: the request itself is bad; ``deadline``; ``cancelled``) goes
back to the caller unchanged.
"""

SESSION_RETRY_S = 60.0
"""How long a peer without Session (an older release during a rolling upgrade) gets
per-request calls before the caller (a router's worker link, a gateway's router or
postprocessor link) asks it for a Session again: it may have been upgraded meanwhile."""


_MAX_DOUBLINGS = 62
"""Beyond this the exponential is past any cap (and 2**n would overflow a float)."""


class Step(enum.Enum):
    """What to do after an attempt failed."""

    RETRY = "retry"
    """Nothing was delivered yet: start the request over on another replica."""
    RESUME = "resume"
    """Tokens were delivered: continue on another replica from the tokens delivered."""
    FAIL = "fail"
    """The failure is the request's own (or the caller's): pass the error on."""
    EXHAUSTED = "exhausted"
    """Another replica might do, but the attempt budget is spent: fail UNAVAILABLE."""

    @property
    def moves(self) -> bool:
        return self in (Step.RETRY, Step.RESUME)


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how soon, a failed stream moves to another replica."""

    max_failovers: int = 3
    """Moves to another replica per request, retries and resumes together."""
    count_replicas: bool = False
    """Add one move per replica beyond the first to the budget: a request may try every
    other replica once before ``max_failovers`` counts (the gateway, whose replicas are
    few and interchangeable). The router's budget is ``max_failovers`` alone."""
    base_backoff_s: float = 0.02
    """Ceiling of the pause after the first failure; it doubles with each further one."""
    max_backoff_s: float = 0.5
    """Upper bound of the pause's ceiling."""
    jitter: float = 1.0
    """Fraction of the ceiling drawn at random: 1 is full jitter (uniform between 0 and the
    ceiling), 0.5 pauses between half the ceiling and the ceiling, 0 always the ceiling."""

    def __post_init__(self) -> None:
        if self.max_failovers < 0:
            raise ValueError("max_failovers must be >= 0")
        if self.base_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be between 0 and 1")

    def budget(self, replicas: int = 1) -> int:
        """Moves one request may make among ``replicas`` replicas."""
        extra = max(replicas, 1) - 1 if self.count_replicas else 0
        return self.max_failovers + extra

    def decide(self, kind: str, *, delivered: bool, failures: int, replicas: int = 1) -> Step:
        """The step after the ``failures``-th failure (counting this one) of one request."""
        if kind not in RETRYABLE_KINDS:
            return Step.FAIL
        if failures > self.budget(replicas):
            return Step.EXHAUSTED
        return Step.RESUME if delivered else Step.RETRY

    def ceiling_s(self, failures: int) -> float:
        """The longest pause after the ``failures``-th failure: base x 2^(failures-1), capped."""
        if failures <= 0:
            return 0.0
        doublings = min(failures - 1, _MAX_DOUBLINGS)
        return min(self.max_backoff_s, self.base_backoff_s * 2.0**doublings)

    def backoff_s(self, failures: int, draw: float | None = None) -> float:
        """The pause after the ``failures``-th failure; ``draw`` in [0, 1) (random if None)."""
        ceiling = self.ceiling_s(failures)
        u = random.random() if draw is None else draw
        return ceiling * (1.0 - self.jitter * u)

    def start(self, *, replicas: int = 1, deadline: float | None = None,
              clock: Callable[[], float] = time.monotonic) -> Failovers:
        """The failover state of one request; ``deadline`` is a ``clock`` instant."""
        return Failovers(self, replicas=replicas, deadline=deadline, clock=clock)


class Failovers:
    """One request's failures so far, under a :class:`RetryPolicy`."""

    def __init__(self, policy: RetryPolicy, *, replicas: int = 1, deadline: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.replicas = replicas
        self.deadline = deadline
        self._clock = clock
        self.failures = 0
        """Retryable failures so far (each one a move, but for an exhausting one)."""
        self.retries = 0
        """Moves made before any token was delivered."""
        self.resumes = 0
        """Moves made after tokens were delivered."""

    @property
    def budget(self) -> int:
        return self.policy.budget(self.replicas)

    def failed(self, kind: str, *, delivered: bool) -> Step:
        """Record an attempt's failure and say what to do next.

        ``delivered``: whether the caller already has tokens of this request (from any
        attempt, or from a tier upstream), so the next attempt must continue from them.
        """
        if kind not in RETRYABLE_KINDS:
            return Step.FAIL
        self.failures += 1
        step = self.policy.decide(
            kind, delivered=delivered, failures=self.failures, replicas=self.replicas
        )
        if step is Step.RESUME:
            self.resumes += 1
        elif step is Step.RETRY:
            self.retries += 1
        return step

    def next_pause_s(self, draw: float | None = None) -> float:
        """The pause before the next attempt; DeadlineExceeded (now, without pausing) when
        the pause would reach the deadline: an attempt after it could not be answered."""
        delay = self.policy.backoff_s(self.failures, draw)
        if self.deadline is not None and self._clock() + delay >= self.deadline:
            raise DeadlineExceeded("deadline passed while retrying")
        return delay

    async def pause(self) -> None:
        """Wait out the backoff before the next attempt (see :meth:`next_pause_s`)."""
        await asyncio.sleep(self.next_pause_s())

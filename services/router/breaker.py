"""Per-worker circuit breaker: closed -> open -> half-open, with exponential backoff.

Transport failures of real requests trip it (passive ejection): ``failure_threshold``
consecutive ones while the worker otherwise answers (its health watch and load polls),
one when it does not. A request the worker refused or failed on its own (invalid
argument, an engine error for that request) never reaches the breaker: that is the
request's fault, and counting it would let one poison request eject every worker.
While open the worker gets no traffic; after the backoff it turns half-open and lets
one trial request through. A successful trial closes it; a failed one reopens it for
twice as long.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class Circuit(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        base_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = max(1, failure_threshold)
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._state = Circuit.CLOSED
        self._failures = 0
        self._trips = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> Circuit:
        """Current state; an open circuit whose backoff has elapsed reads half-open."""
        if self._state is Circuit.OPEN and self._clock() - self._opened_at >= self.backoff_s:
            self._state = Circuit.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    @property
    def backoff_s(self) -> float:
        """How long the circuit stays open after the latest trip."""
        if self._trips == 0:
            return 0.0
        return min(self.max_backoff_s, self.base_backoff_s * 2 ** (self._trips - 1))

    def allows(self) -> bool:
        """Whether a new request may be sent (without claiming the half-open trial)."""
        state = self.state
        return state is Circuit.CLOSED or (state is Circuit.HALF_OPEN and not self._trial_in_flight)

    def reopens_in(self) -> float | None:
        """Seconds until an open circuit reads half-open (0 once due); None: it is not open.

        The one change of state that comes with time alone: readiness waits for it
        instead of re-reading every worker on a short interval."""
        if self._state is not Circuit.OPEN:
            return None
        return max(0.0, self._opened_at + self.backoff_s - self._clock())

    def on_dispatch(self) -> bool:
        """A request was sent; in half-open it is the one trial. True: it claimed the
        trial, so the circuit lets no other request through until it ends."""
        if self.state is Circuit.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def record_success(self) -> bool:
        """A request succeeded. True: it closed an open or half-open circuit."""
        self._failures = 0
        if self._state is not Circuit.CLOSED:
            self._state = Circuit.CLOSED
            self._trips = 0
            self._trial_in_flight = False
            return True
        return False

    def record_failure(self, *, answering: bool = True) -> None:
        """A request failed in transport; ``answering``: the worker's probes still succeed."""
        state = self.state
        if state is Circuit.HALF_OPEN:
            self._trip()
            return
        if state is Circuit.OPEN:
            return
        self._failures += 1
        if not answering or self._failures >= self.failure_threshold:
            self._trip()

    @property
    def failures(self) -> int:
        """Consecutive transport failures since the last success or trip."""
        return self._failures

    def reset(self) -> None:
        """Forget history (the worker was replaced, e.g. re-registered by DNS)."""
        self._state = Circuit.CLOSED
        self._failures = 0
        self._trips = 0
        self._trial_in_flight = False

    def _trip(self) -> None:
        self._trips += 1
        self._state = Circuit.OPEN
        self._opened_at = self._clock()
        self._failures = 0
        self._trial_in_flight = False

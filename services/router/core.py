"""The router's logic, free of grpc: registry, health, admission, routing, retries, resume.

The servicer converts protos and calls :meth:`Router.generate`, :meth:`Router.abort`
and :meth:`Router.workers`; workers are reached through the :class:`WorkerClient`
protocol (``workerclient.GrpcWorkerClient`` in production).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from opentelemetry import trace

from services.common.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    LlmeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from services.common.generation import Delta, Final, FinishReason, RouterFinal, ServedBy, TokenRequest
from services.common.logs import request_id_var
from services.common.retry import Step
from services.router import metrics
from services.router.admission import Admission, NoCapacity
from services.router.batching import AdaptiveWindow, AttemptStream, BatchDispatcher
from services.router.breaker import Circuit, CircuitBreaker
from services.router.health import WorkerMonitor
from services.router.registry import SERVING, ChecksumBook, Registry, WorkerInfo, WorkerState
from services.router.routing import Policy, ZoneLadder, choose, prefix_key
from services.router.settings import RouterSettings
from services.router.workerapi import WorkerCallError, WorkerClient

log = logging.getLogger(__name__)

CIRCUIT_CODES = {Circuit.CLOSED: 0, Circuit.OPEN: 1, Circuit.HALF_OPEN: 2}


@dataclass(frozen=True)
class RouteRequest:
    """One generation as the router receives it."""

    request: TokenRequest
    resume_token_ids: tuple[int, ...] = ()
    """Tokens an earlier router already delivered: appended to the prompt, not re-sent."""
    resumed: int = 0
    tenant: str = ""
    """The caller's tenant (set by the gateway): admission limits each tenant's queue share."""


@dataclass
class _Active:
    """A running request, for RouterService.Abort."""

    stream: AttemptStream | None = None
    aborted: bool = False


@dataclass
class _Attempt:
    worker: WorkerState
    affinity: bool
    released: bool = False
    started: float = field(default_factory=time.monotonic)
    """When the slot was taken: its hold time feeds admission's drain rate."""


Resolver = Callable[[str, int], Awaitable[list[str]]]
ChecksumSource = Callable[[], Awaitable[dict[str, str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as host:port (getaddrinfo in a thread)."""
    infos = await asyncio.to_thread(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    out: dict[str, None] = {}
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        out.setdefault(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}", None)
    return list(out)


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        connect: Callable[[str], WorkerClient],
        *,
        checksum_source: ChecksumSource | None = None,
        resolver: Resolver = resolve_addresses,
    ) -> None:
        self.settings = settings
        self._connect = connect
        self._checksum_source = checksum_source
        self._resolver = resolver
        self.ladder = ZoneLadder(settings.zones, settings.degraded_zones)
        self.retry_policy = settings.retry_policy()
        """Retries before the first token and resumes after it (shared with the gateway)."""
        self.policy = Policy(
            settings.affinity_balance_factor, settings.affinity_balance_slack, settings.kv_weight
        )
        self.checksums = ChecksumBook(settings.model_checksums)
        self.registry = Registry(
            lambda: CircuitBreaker(
                failure_threshold=settings.breaker_failures,
                base_backoff_s=settings.breaker_base_backoff_s,
                max_backoff_s=settings.breaker_max_backoff_s,
            ),
            default_capacity=settings.worker_capacity,
        )
        self.admission: Admission[_Attempt] = Admission(
            settings.max_queue,
            tenant_share=settings.tenant_queue_share,
            queue_timeout_s=settings.queue_timeout_s,
            wait_margin=settings.queue_wait_margin,
            window=settings.drain_window,
            on_depth=lambda priority, depth: metrics.QUEUE_DEPTH.labels(str(priority)).set(depth),
            on_refuse=lambda reason: metrics.ADMISSION_REFUSED.labels(reason).inc(),
        )
        self._clients: dict[str, WorkerClient] = {}
        self._dispatchers: dict[str, BatchDispatcher] = {}
        self._monitors: dict[str, WorkerMonitor] = {}
        self._active: dict[str, _Active] = {}
        self.resume_log: collections.deque[tuple[str, str, int]] = collections.deque(maxlen=256)
        """Recent re-submissions: (request id, worker id, tokens already produced)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self.on_change: Callable[[], None] | None = None
        """Called whenever a worker's health, reachability or circuit may have changed."""

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Fetch expected checksums, connect static workers, start DNS re-resolution."""
        if self._started:
            return
        self._started = True
        if self._checksum_source is not None and not await self._load_checksums():
            self._tasks.append(asyncio.ensure_future(self._checksum_retry_loop()))
        for spec in self.settings.all_workers():
            self.add_worker(
                spec.address, zone=spec.zone, device=spec.device, models=spec.models,
                worker_id=spec.worker_id,
            )
        if self.settings.dns_targets:
            await self.resolve_dns_once()
            self._tasks.append(asyncio.ensure_future(self._dns_loop()))

    async def wait_ready(self, timeout: float = 10.0) -> bool:
        """Wait until at least one worker is healthy (or ``timeout``)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(w.healthy for w in self.registry):
                return True
            await asyncio.sleep(0.05)
        return False

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks = []
        for address in list(self.registry.workers):
            await self.remove_worker(address)

    # ---- workers ---------------------------------------------------------------

    def add_worker(
        self, address: str, *, zone: str = "", device: str = "", models: list[str] | None = None,
        worker_id: str = "", source: str = "static",
    ) -> WorkerState | None:
        state = self.registry.add(
            address, zone=zone, device=device, models=models, worker_id=worker_id, source=source
        )
        if state is None:
            return None
        client = self._connect(address)
        self._clients[address] = client
        self._dispatchers[address] = dispatcher = BatchDispatcher(
            client,
            AdaptiveWindow(self.settings.batch_max_wait_ms, self.settings.batch_max_size),
            state.pressure,
            self._observe_batch,
            session=self.settings.worker_transport == "session",
        )
        monitor = WorkerMonitor(
            state, client, check_info=self._check_info, on_change=self._on_worker_change,
            interval_s=self.settings.load_interval_ms / 1000.0,
            timeout_s=self.settings.load_timeout_ms / 1000.0,
            failures_to_eject=self.settings.load_failures_to_eject,
            heard_at=lambda: dispatcher.heard_at,
        )
        dispatcher.load_watch = (monitor.watcher, monitor.frame_load)
        self._monitors[address] = monitor
        monitor.start()
        log.info("worker %s added (zone=%s, source=%s)", address, zone or "?", source)
        return state

    async def remove_worker(self, address: str) -> None:
        state = self.registry.remove(address)
        if state is None:
            return
        monitor = self._monitors.pop(address, None)
        if monitor is not None:
            await monitor.stop()
        dispatcher = self._dispatchers.pop(address, None)
        if dispatcher is not None:
            await dispatcher.close()
        client = self._clients.pop(address, None)
        if client is not None:
            await client.close()
        metrics.WORKER_HEALTHY.labels(state.worker_id, state.zone).set(0)
        log.info("worker %s removed", address)
        self.admission.wake()
        if self.on_change is not None:
            self.on_change()

    def _check_info(self, state: WorkerState, info: WorkerInfo) -> None:
        problems = [
            reason for model in state.models
            if (reason := self.checksums.check(model, info.tokenizer_checksum, state.address))
        ]
        reason = "; ".join(problems)
        if reason and not state.refused:
            metrics.REFUSED.inc()
            log.error("REFUSING worker %s at %s: %s", state.worker_id, state.address, reason)
        elif not reason and state.refused:
            log.info("worker %s at %s accepted again", state.worker_id, state.address)
        changed = bool(reason) != bool(state.refused)
        state.refused = reason
        if changed and self.on_change is not None:
            self.on_change()

    def _on_worker_change(self, state: WorkerState) -> None:
        labels = (state.worker_id, state.zone)
        dispatcher = self._dispatchers.get(state.address)
        if (
            dispatcher is not None
            and not state.reachable
            and state.load_failures >= self.settings.unreachable_failover_polls
            and dispatcher.live
        ):
            failed = dispatcher.fail_all(
                WorkerCallError("transport", "UNAVAILABLE", "worker stopped answering load polls")
            )
            log.warning("worker %s at %s stopped answering: moving %d requests elsewhere",
                        state.worker_id, state.address, failed)
        metrics.WORKER_HEALTHY.labels(*labels).set(1 if state.healthy else 0)
        metrics.WORKER_CIRCUIT.labels(*labels).set(CIRCUIT_CODES[state.circuit])
        metrics.WORKER_IN_FLIGHT.labels(*labels).set(state.in_flight)
        if self.on_change is not None:
            self.on_change()
        self.admission.wake()

    async def _load_checksums(self) -> bool:
        assert self._checksum_source is not None
        try:
            expected = await asyncio.wait_for(self._checksum_source(), 5.0)
        except Exception as exc:
            log.warning("could not read tokenizer checksums from the tokenizer tier: %s", exc)
            return False
        for model, checksum in expected.items():
            self.checksums.learn(model, checksum, "tokenizer tier")
        for state in self.registry:
            if state.info is not None:
                self._check_info(state, state.info)
        return True

    async def _checksum_retry_loop(self) -> None:
        for _ in range(1_000_000):
            await asyncio.sleep(5.0)
            if await self._load_checksums():
                return

    async def resolve_dns_once(self) -> None:
        for target in self.settings.dns_targets:
            host, _, port_text = target.name.rpartition(":")
            source = f"dns:{target.name}"
            try:
                addresses = set(await self._resolver(host.strip("[]"), int(port_text)))
            except (OSError, ValueError) as exc:
                # A failed lookup keeps the workers we know: DNS hiccups must not empty a zone.
                log.warning("resolving %s failed: %s", target.name, exc)
                continue
            known = {w.address for w in self.registry.from_source(source)}
            for address in sorted(addresses - known):
                self.add_worker(
                    address, zone=target.zone, device=target.device, models=target.models,
                    source=source,
                )
            for address in sorted(known - addresses):
                await self.remove_worker(address)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.dns_interval_s)
            await self.resolve_dns_once()

    def readiness(self) -> dict[str, bool]:
        """Per model: whether some worker could take a request now (healthy, reachable,
        circuit letting requests through). A model no worker can serve is not ready."""
        ready: dict[str, bool] = {}
        for worker in self.registry:
            if worker.refused:
                continue
            routable = worker.routable()
            for model in worker.models:
                ready[model] = ready.get(model, False) or routable
        return ready

    def readiness_due(self) -> float | None:
        """Seconds until :meth:`readiness` may change with time alone: the soonest open
        circuit to half-open. None: only through changes that call ``on_change``."""
        due = [d for worker in self.registry if (d := worker.breaker.reopens_in()) is not None]
        return min(due, default=None)

    def workers(self) -> list[WorkerState]:
        ladder = self.ladder
        return sorted(self.registry, key=lambda w: (ladder.rank(w.zone), w.zone, w.address))

    # ---- requests --------------------------------------------------------------

    def _observe_batch(self, size: int, wait_ms: float) -> None:
        metrics.BATCH_SIZE.observe(size)
        metrics.WINDOW_WAIT.observe(wait_ms / 1000.0)

    def _resolve_model(self, model: str) -> str:
        known = self.registry.models()
        name = model or self.settings.default_model or (known[0] if known else "")
        if name and name in known:
            return name
        if any(w.info is None and not w.models for w in self.registry) or not known:
            raise Unavailable("no worker is connected yet" if len(self.registry) else "no workers configured")
        raise NotFound(f"model {name!r} is not served (served: {', '.join(known)})")

    def silent_wait_s(self, model: str) -> float:
        """How long a new request for ``model`` that finds no routable worker may wait:
        until ``failover_wait_ms`` after the latest silence of a worker serving the model
        began (0 when none is silent: the rest are gone, refused, draining or tripped)."""
        wait_s = self.settings.failover_wait_ms / 1000.0
        now = asyncio.get_running_loop().time()
        return max((
            state.silent_since + wait_s - now for state in self.registry
            if state.silent_since is not None and not state.refused and state.health == SERVING
            and state.serves(model)
        ), default=0.0)

    def _pick(self, model: str, key: bytes | None, exclude: frozenset[str]) -> _Attempt:
        choice = choose(self.registry, model, self.ladder, key, self.policy, exclude)
        if choice.worker is None:
            if choice.routable:
                raise NoCapacity()
            raise Unavailable(f"no zone can serve model {model!r} (no healthy worker)")
        worker = choice.worker
        worker.in_flight += 1
        _export_in_flight(worker)
        if worker.breaker.on_dispatch() and self.on_change is not None:
            # Its one trial: it takes nothing else for now. Readiness only: this runs
            # inside admission's wake(), which must not be woken again from here.
            self.on_change()
        return _Attempt(worker, choice.affinity)

    def _release(self, attempt: _Attempt) -> None:
        if attempt.released:
            return
        attempt.released = True
        attempt.worker.in_flight -= 1
        _export_in_flight(attempt.worker)
        self.admission.released(time.monotonic() - attempt.started)
        metrics.DRAIN_RATE.set(self.admission.drain_rate() or 0.0)
        self.admission.wake()

    async def abort(self, request_id: str) -> bool:
        """Stop a request this router runs; False if it is unknown (already finished)."""
        active = self._active.get(request_id)
        if active is None:
            return False
        active.aborted = True
        stream = active.stream
        if stream is not None:
            await stream.cancel()
            stream.queue.put_nowait(Final(FinishReason.ABORT))
        return True

    def generate(
        self, route: RouteRequest, timeout: float | None = None,
        on_delta: Callable[[Delta], None] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> AsyncGenerator[Delta | RouterFinal, None]:
        """Stream deltas then one Final, retrying before and resuming after the first token.

        An async generator: nothing runs (not even validation) until it is iterated, and
        closing it aborts the worker request.

        With ``on_delta`` the deltas (those with tokens or logprobs) are not yielded but
        handed to it as the worker link reads them, from the reader's task: the caller's
        task then wakes once per attempt's end, not once per token (the router Session's
        steady state). Failures, retries and resumes run as without it; ``on_delta`` must
        not block, and it sees no delta after the generator is closed. With ``on_delta``,
        ``on_tokens`` takes the token ids of deltas without logprobs that come over a
        worker session, with no :class:`Delta` built for them (the same rules).
        """
        return _AttemptLoop(self, route, timeout, on_delta, on_tokens).run()


_FAILOVER_POLL_S = 0.025
"""How often a moving request with no routable worker looks again (failover_wait_ms)."""


class _AttemptLoop:
    """One request through the router: attempts on workers until one of them ends it.

    Each attempt takes a worker slot (admission, away from the workers that failed this
    request), streams the worker's deltas on, and ends the request with its final; when
    it fails, the request's :class:`Failovers` (the router's :class:`RetryPolicy`) says
    whether to retry (nothing delivered yet), resume from the tokens delivered, pass the
    error on, or give up.
    """

    def __init__(
        self, router: Router, route: RouteRequest, timeout: float | None,
        on_delta: Callable[[Delta], None] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.router = router
        self.on_delta = on_delta
        """Where deltas go without being yielded (see :meth:`Router.generate`)."""
        self.on_tokens = on_tokens if on_delta is not None else None
        """Where plain token ids go (see :meth:`Router.generate`)."""
        self.route = route
        self.request = route.request
        self.timeout = timeout
        self.active = _Active()
        self.prompt = list(self.request.prompt_token_ids)
        self.produced: list[int] = list(route.resume_token_ids)
        """Every token the caller has, from this router's attempts and from upstream."""
        self.failed_workers: set[str] = set()
        self.queue_ms = 0.0
        self.first_token_at: float | None = None
        self.done = False
        """A final was yielded: the request is over."""
        # Set when the run starts (validation is lazy, like the generator's body).
        self.model = ""
        self.request_id = ""
        self.key: bytes | None = None
        self.start = 0.0
        self.deadline: float | None = None
        self.failovers = router.retry_policy.start()
        self.span: trace.Span = trace.INVALID_SPAN

    # ---- the loop --------------------------------------------------------------------

    async def run(self) -> AsyncGenerator[Delta | RouterFinal, None]:
        """Attempts until one yields the final: after a failed one, the policy's pause
        (never into the deadline), then the next worker."""
        self._begin()
        router = self.router
        router._active[self.request_id] = self.active
        try:
            while True:
                request = self._attempt_request()
                if request is None:
                    # max_tokens was spent before the failure: nothing left to generate.
                    yield self._final(Final(FinishReason.LENGTH), None)
                    return
                attempt = await self._acquire()
                if self.active.aborted:  # aborted while it waited for a worker
                    router._release(attempt)
                    yield self._final(Final(FinishReason.ABORT), None)
                    return
                self._note_routed(attempt.worker)
                async with contextlib.aclosing(self._attempt(attempt, request)) as events:
                    async for event in events:
                        yield event
                if self.done:
                    return
                await self.failovers.pause()
        finally:
            router._active.pop(self.request_id, None)

    def _begin(self) -> None:
        """Validate the request and start its clock, deadline and failover budget."""
        request, route, router = self.request, self.route, self.router
        if not request.prompt_token_ids and not route.resume_token_ids:
            raise InvalidArgument("request.prompt_token_ids", "must not be empty")
        self.model = router._resolve_model(request.model)
        self.request_id = request.request_id or uuid.uuid4().hex
        if self.request_id in router._active:
            raise InvalidArgument("request.request_id", f"{self.request_id!r} is already running")
        request_id_var.set(self.request_id)  # log lines of this call carry the request id
        self.start = time.monotonic()
        self.deadline = None if self.timeout is None else self.start + self.timeout
        self.failovers = router.retry_policy.start(deadline=self.deadline)
        self.key = prefix_key(self.prompt, router.settings.affinity_prefix_tokens)
        self.span = _current_span()

    def _attempt_request(self) -> TokenRequest | None:
        """What the next attempt sends: the tokens delivered so far replayed (or appended
        to the prompt), the token budgets less what they already cover; None when
        max_tokens was spent before the failure."""
        request, produced = self.request, self.produced
        sampling = request.sampling
        remaining = sampling.max_tokens - len(produced) if sampling.max_tokens is not None else None
        if remaining is not None and remaining <= 0 and produced:
            return None
        attempt_sampling = dataclasses.replace(
            sampling,
            max_tokens=None if remaining is None else max(0, remaining),
            min_tokens=None if sampling.min_tokens is None else max(0, sampling.min_tokens - len(produced)),
        )
        replay = self.router.settings.resume_mode != "prefill"
        failures = self.failovers.failures
        return TokenRequest(
            request_id=self.request_id if failures == 0 else f"{self.request_id}~{failures}",
            model=self.model,
            prompt_token_ids=tuple(self.prompt if replay else self.prompt + produced),
            sampling=attempt_sampling,
            priority=request.priority,
            replay_token_ids=tuple(produced) if replay else (),
        )

    async def _acquire(self) -> _Attempt:
        """A worker slot, queueing in admission if none is free.

        A request moving after a failure may find no routable worker at all (the last
        one missed a load poll while busy, or its circuit is open for a moment): it waits
        up to ``failover_wait_ms`` (never past its deadline) for one to come back instead
        of failing. A new request waits only while a worker of its model has been silent
        (streams open, no report) for less than ``failover_wait_ms``, and no longer than
        that silence plus ``failover_wait_ms``: a busy worker that misses a poll does not
        turn new requests away, and one that stays silent fails them at once after that.
        Otherwise (every circuit open, workers gone or draining) UNAVAILABLE comes at once.
        """
        router = self.router
        waited = time.monotonic()
        give_up_at: float | None = None
        while True:
            try:
                attempt = await router.admission.acquire(
                    functools.partial(router._pick, self.model, self.key, frozenset(self.failed_workers)),
                    self.request.priority, self.deadline, router._release, tenant=self.route.tenant,
                )
                break
            except ResourceExhausted:
                metrics.REJECTED.inc()
                raise
            except Unavailable:
                now = time.monotonic()
                if give_up_at is None:
                    wait_s = router.settings.failover_wait_ms / 1000.0
                    if not self.failovers.failures:
                        wait_s = router.silent_wait_s(self.model)
                        if wait_s <= 0:
                            raise
                    give_up_at = now + wait_s
                    if self.deadline is not None:
                        give_up_at = min(give_up_at, self.deadline)
                    log.log(logging.WARNING if self.failovers.failures else logging.INFO,
                            "request %s: no routable worker for model %s; waiting up to %.1f s",
                            self.request_id, self.model, max(0.0, give_up_at - now))
                if now >= give_up_at:
                    raise
                # Rare (every worker out at once): a short poll also sees circuits that
                # half-open with time, which no worker change announces.
                await asyncio.sleep(min(_FAILOVER_POLL_S, give_up_at - now))
        self.queue_ms += (time.monotonic() - waited) * 1000.0
        return attempt

    def _note_routed(self, worker: WorkerState) -> None:
        metrics.ROUTED.labels(worker.zone, str(self.router.ladder.is_degraded(worker.zone)).lower()).inc()
        failures = self.failovers.failures
        if failures:
            self.router.resume_log.append((self.request_id, worker.worker_id, len(self.produced)))
            log.info("request %s: attempt %d on worker %s from token %d",
                     self.request_id, failures + 1, worker.worker_id, len(self.produced))

    # ---- one attempt -----------------------------------------------------------------

    async def _attempt(
        self, attempt: _Attempt, request: TokenRequest
    ) -> AsyncGenerator[Delta | RouterFinal, None]:
        """One worker's deltas, then the request's Final (``done``); on a failure the
        caller may move on, nothing more is yielded and the failure is recorded (or
        raised, when the request cannot move on). The slot is released on the way out."""
        worker = attempt.worker
        stream = self.router._dispatchers[worker.address].submit(request, self.deadline)
        if self.on_delta is not None:
            stream.on_delta = self._deliver
            if self.on_tokens is not None:
                stream.on_tokens = self._deliver_tokens
        self.active.stream = stream
        finished = False
        try:
            # Closed here when it is left at the final: a generator left suspended is
            # closed by the event loop's finalizer hook, a thread-safe wake-up per request.
            async with contextlib.aclosing(stream.events()) as events:
                async for event in events:
                    if isinstance(event, Delta):
                        if event.token_ids or event.logprobs:
                            self._delivered(event.token_ids)
                            yield event
                        continue
                    if self.active.aborted:
                        finished = self.done = True
                        yield self._final(Final(FinishReason.ABORT), worker)
                        return
                    _raise_engine_failure(event)
                    if worker.breaker.record_success():
                        self.router._on_worker_change(worker)  # the circuit closed again
                    finished = self.done = True
                    _annotate(
                        self.span, worker, stream, self.failovers.retries, self._resumes(),
                        attempt.affinity, queue_ms=self.queue_ms, ttft_ms=(
                            (self.first_token_at - self.start) * 1000.0
                            if self.first_token_at is not None else None
                        ),
                    )
                    yield self._final(event, worker)
                    return
        except WorkerCallError as exc:
            if self.active.aborted:
                self.done = True
                yield self._final(Final(FinishReason.ABORT), worker)
                return
            self._failed(worker, exc)
        finally:
            self.active.stream = None
            if not finished:
                await stream.cancel()
            self.router._release(attempt)

    def _deliver(self, delta: Delta) -> None:
        """A delta straight from the worker link (``on_delta``): accounted for (resume
        replays it) and passed on, in the reader's task."""
        if delta.token_ids or delta.logprobs:
            self._delivered(delta.token_ids)
            assert self.on_delta is not None
            self.on_delta(delta)

    def _deliver_tokens(self, token_ids: list[int]) -> None:
        """:meth:`_deliver` for a worker session's plain token ids (``on_tokens``)."""
        if token_ids:
            self._delivered(token_ids)
            assert self.on_tokens is not None
            self.on_tokens(token_ids)

    def _delivered(self, token_ids: list[int]) -> None:
        """Account for tokens passed on: the first token's time, and what resume replays."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.produced.extend(token_ids)

    def _failed(self, worker: WorkerState, exc: WorkerCallError) -> None:
        """Account for an attempt that failed; raises when the request cannot move on."""
        step = self.failovers.failed(exc.kind, delivered=bool(self.produced))
        if step is Step.FAIL:
            raise _caller_error(exc) from None
        if exc.kind == "transport":
            # Only the link or the worker failing moves the breaker; a worker whose
            # probes still answer needs several failures in a row.
            worker.breaker.record_failure(answering=worker.healthy)
            self.router._on_worker_change(worker)
        self.failed_workers.add(worker.address)
        failures = self.failovers.failures
        log.warning(
            "request %s failed on worker %s (%s) after %d tokens; attempt %d of %d",
            self.request_id, worker.worker_id, exc.code, len(self.produced), failures,
            self.failovers.budget + 1,
        )
        if step is Step.EXHAUSTED:
            raise Unavailable(f"request failed on {failures} attempts; last: {exc.message}") from None
        metrics.FAILOVERS.labels(worker.zone).inc()
        (metrics.RESUMES if step is Step.RESUME else metrics.RETRIES).inc()

    # ---- the answer ------------------------------------------------------------------

    def _resumes(self) -> int:
        """Resumes of this request, counting the ones of the tiers upstream."""
        return int(self.route.resumed) + self.failovers.resumes

    def _final(self, final: Final, worker: WorkerState | None) -> RouterFinal:
        """The worker's final (finish reason, stop token, cached tokens) with this
        router's counts and times, which span every attempt."""
        now = time.monotonic()
        out = dataclasses.replace(
            final,
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.produced),
            queue_ms=self.queue_ms + final.queue_ms,
            ttft_ms=((self.first_token_at or now) - self.start) * 1000.0,
            total_ms=(now - self.start) * 1000.0,
        )
        zone = worker.zone if worker else ""
        served = ServedBy(
            worker_id=worker.worker_id if worker else "",
            zone=zone,
            device=worker.device if worker else "",
            degraded=self.router.ladder.is_degraded(zone) if worker else False,
            resumed=self._resumes(),
        )
        return RouterFinal(out, served, self.failovers.retries)


def _raise_engine_failure(final: Final) -> None:
    """An error or abort finish from the worker: the engine failed this request or the
    worker is draining (its health says so). Try elsewhere, without blaming the worker."""
    if final.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        raise WorkerCallError(
            "failed", "ENGINE_" + final.finish_reason.name,
            "worker ended the request",
        )


def _caller_error(exc: WorkerCallError) -> LlmeshError:
    """A worker's refusal of the request itself, passed on to the caller unchanged."""
    if exc.error is not None:
        return exc.error
    if exc.kind == "deadline":
        return DeadlineExceeded(exc.message)
    if exc.kind == "cancelled":
        return Cancelled(exc.message)
    return Unavailable(exc.message)


def _export_in_flight(worker: WorkerState) -> None:
    """The gauge moves with the count itself, not at the next load poll: a scrape right
    after dispatch must show the request (autoscalers and `llmesh status` read it)."""
    metrics.WORKER_IN_FLIGHT.labels(worker.worker_id, worker.zone).set(worker.in_flight)


def _current_span() -> trace.Span:
    return trace.get_current_span()


def _annotate(
    span: trace.Span, worker: WorkerState, stream: AttemptStream, retries: int, resumes: int,
    affinity: bool, *, queue_ms: float, ttft_ms: float | None,
) -> None:
    """Put the routing decision on the current span (the server span of Generate)."""
    if not span.is_recording():
        return
    span.set_attribute("llmesh.router.worker", worker.worker_id)
    span.set_attribute("llmesh.router.zone", worker.zone)
    span.set_attribute("llmesh.router.retries", retries)
    span.set_attribute("llmesh.router.resumes", resumes)
    span.set_attribute("llmesh.router.batch_size", stream.batch_size)
    span.set_attribute("llmesh.router.window_wait_ms", stream.window_wait_ms)
    span.set_attribute("llmesh.router.affinity", affinity)
    span.set_attribute("llmesh.router.queue_ms", queue_ms)
    if ttft_ms is not None:
        span.set_attribute("llmesh.router.ttft_ms", ttft_ms)

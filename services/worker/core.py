"""The worker's logic: validation, in-flight bookkeeping, cancellation, batching, health.

No grpc import: the servicer converts protos to :mod:`services.worker.engine` types and
calls :class:`WorkerCore`; errors are raised as :mod:`services.common.errors` types and
mapped to status codes in one place (the shared interceptor).

Every request runs as an :class:`EngineRun`: the engine calls its sink from its own step
loop (:meth:`Engine.start`), and the run hands Delta / Final / an error to a consumer
callback, so the outputs of one engine step reach every consumer in one event-loop
callback, with no task or generator per request. :meth:`WorkerCore.generate` (the
Generate RPC) is a thin consumer over a queue; :meth:`WorkerCore.generate_batch` shares
one queue among its requests; the Session feeds its frame straight from the callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from services.common import sampling
from services.common.errors import FieldViolation, InvalidArgument, LlmeshError, NotFound, Unavailable
from services.common.generation import Delta as Delta
from services.common.generation import Final as Final
from services.common.logs import request_id_var
from services.worker import metrics
from services.worker.engine import (
    Engine,
    EngineDeadError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestRejected,
    Sampling,
)

log = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 256


@dataclass(frozen=True)
class WorkerIdentity:
    """What GetModelInfo reports besides the engine's facts."""

    model: str
    tokenizer_checksum: str
    device: str
    zone: str
    worker_id: str
    pid: int
    adapters: tuple[str, ...] = ()
    """LoRA adapter names a request's ``model`` may select."""


Event = Delta | Final


@dataclass(frozen=True)
class Failed:
    """One request of a batch failed on its own (refused, rejected by the engine)."""

    error: Exception


@dataclass(frozen=True)
class LoadReport:
    """Engine load plus the service's own view."""

    engine: EngineLoad
    in_flight: int
    max_num_seqs: int

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing in the engine: the load stays as it is until a
        request comes."""
        return not self.in_flight and not self.engine.running and not self.engine.waiting


ABORTED_ID_WAIT_S = 2.0
"""How long a request waits for an aborted one under the same id to leave the engine."""
BUSY_CHECK_FACTOR = 4
"""How many times ``engine_check_interval_s`` the engine check waits while requests are in
flight (their sinks report the engine's death at once; each check is a wake-up of the
worker, about 0.3 ms of CPU a CPU engine's step apart)."""


@dataclass
class HealthState:
    """What the health monitor concluded last; the server maps it to health status."""

    warmed_up: bool = False
    canary_ok: bool = True
    engine_dead: bool = False
    last_error: str = ""
    canaries: int = field(default=0)

    @property
    def serving(self) -> bool:
        return self.warmed_up and self.canary_ok and not self.engine_dead


# -- validation -------------------------------------------------------------------------

def sampling_violations(s: Sampling, info: EngineInfo, prompt_len: int, prefix: str) -> list[FieldViolation]:
    """Every out-of-range sampling value, with its field path."""
    v: list[FieldViolation] = []
    p = f"{prefix}.sampling"

    def bad(name: str, description: str) -> None:
        v.append(FieldViolation(f"{p}.{name}", description))

    v += sampling.sampling_violations(s, p, vocab_size=info.vocab_size)
    if s.logprobs is not None and info.max_logprobs < s.logprobs <= sampling.MAX_LOGPROBS:
        # This engine was started with a lower limit than vLLM's default: ask it, not the table.
        bad("logprobs", f"must be at most {info.max_logprobs} on this engine, got {s.logprobs}")
    if s.max_tokens is not None and s.max_tokens >= 1 and prompt_len + s.max_tokens > info.max_model_len:
        bad(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({s.max_tokens}) exceeds the "
            f"max context length {info.max_model_len}",
        )
    return v


def request_violations(req: EngineRequest, info: EngineInfo, prefix: str) -> list[FieldViolation]:
    """Every problem with one request (besides duplicates in flight), with field paths."""
    v: list[FieldViolation] = []
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        v.append(FieldViolation(f"{prefix}.request_id", f"longer than {MAX_REQUEST_ID_LEN} characters"))
    prompt = req.prompt_token_ids
    field_name = f"{prefix}.prompt_token_ids"
    if not prompt:
        v.append(FieldViolation(field_name, "must not be empty"))
    else:
        for i, token in enumerate(prompt):
            if not 0 <= token < info.vocab_size:
                v.append(FieldViolation(
                    field_name,
                    f"token id {token} at index {i} is outside the vocabulary (size {info.vocab_size})",
                ))
                break
        if len(prompt) >= info.max_model_len:
            v.append(FieldViolation(
                field_name,
                f"prompt has {len(prompt)} tokens; the max context length is {info.max_model_len} "
                "and at least one token must be generated",
            ))
    for i, token in enumerate(req.replay_token_ids):
        if not 0 <= token < info.vocab_size:
            v.append(FieldViolation(
                f"{prefix}.replay_token_ids",
                f"token id {token} at index {i} is outside the vocabulary (size {info.vocab_size})",
            ))
            break
    # Replayed tokens occupy context like the prompt does.
    v += sampling_violations(req.sampling, info, len(prompt) + len(req.replay_token_ids), prefix)
    return v


# -- one request on the engine -----------------------------------------------------------

Consumer: TypeAlias = Callable[["Delta | Final | Exception"], None]
"""Where an :class:`EngineRun` hands its request's events: deltas, then one Final, or one
exception instead of the Final (Unavailable when the engine died, the engine's
RequestRejected, InvalidArgument for an id still held by another request). Called from the
engine's step callback: it must not block or raise."""


class EngineRun:
    """One request on the engine, fed by the engine's sink (no task, no generator).

    It does the core's bookkeeping for its request: in flight under its id from
    :meth:`start` until the engine let go of it, first-token time, tokens counted, the
    Final (with its metrics) from the engine's last output, engine death (Unavailable, and
    the worker told), the engine's refusal (RequestRejected, counted), and hands each
    event to ``consumer``. :meth:`detach` / :meth:`cancel` are for a consumer that goes
    away (cancelled call, passed deadline, closed session): nothing more reaches it, the
    request is aborted in the engine and its id freed.
    """

    __slots__ = ("_consumer", "_consumer_tokens", "_first_token_at", "_registered", "_starting",
                 "aborted", "completion", "core", "ended", "request", "request_id", "started_at")

    def __init__(self, core: WorkerCore, request: EngineRequest, consumer: Consumer) -> None:
        self.core = core
        self.request = request
        self.request_id = request.request_id
        self._consumer: Consumer | None = consumer
        self._consumer_tokens: Callable[[list[int]], None] | None = getattr(consumer, "step_tokens", None)
        """The consumer's ``step_tokens(token_ids)`` if it has one (see :meth:`step_tokens`)."""
        self.aborted = False
        """Aborted by its caller (Abort, abort by handle): it ends with an ABORT final, and
        its id may be taken again once it left the engine."""
        self.ended = asyncio.Event()
        """Set once it is no longer in flight (its id is free)."""
        self._registered = False
        self._starting = False
        self.started_at = time.perf_counter()
        self._first_token_at: float | None = None
        self.completion = 0

    @property
    def done(self) -> bool:
        """Nothing more reaches the consumer (it got its last event, or went away)."""
        return self._consumer is None

    @property
    def in_engine(self) -> bool:
        """In flight under its id (handed to the engine, not yet let go of)."""
        return self._registered

    async def start(self) -> None:
        """Hand the request to the engine, once an aborted request under the same id left
        it. Never raises (but CancelledError): a refusal goes to the consumer. A run
        aborted before it got here ends at once with an ABORT final."""
        core = self.core
        rid = self.request_id
        if self.done:
            return
        if core.health.engine_dead or core.engine.errored:
            core._engine_died("engine is dead")
            self._end(Unavailable("the engine of this worker is dead"))
            return
        if not self.aborted and rid in core._in_flight:
            try:
                await core._wait_for_aborted(rid)
            except InvalidArgument as exc:
                self._end(exc)
                return
            if self.done:
                return
        if self.aborted:
            self._finish(EngineOutput([], finish_reason=FinishReason.ABORT))
            return
        if not core._in_flight and core.on_busy is not None:
            core.on_busy()
        core._in_flight[rid] = self
        self._registered = True
        metrics.IN_FLIGHT.set(len(core._in_flight))
        self._starting = True
        try:
            await core.engine.start(self.request, self)
        except asyncio.CancelledError:
            self.detach()
            await self._leave_engine()
            raise
        except Exception as exc:  # EngineDeadError, RequestRejected, or a failure: as if sunk
            self._on_output(exc)
        finally:
            self._starting = False
        if self._registered and self.done:
            # Its consumer left while the engine took it: abort it now and free its id.
            await self._leave_engine()
        elif self._registered and self.aborted:
            # Aborted while the engine took it: the abort then may have found nothing to stop.
            await core._abort_in_engine(rid)

    def detach(self) -> None:
        """The consumer goes away: nothing more reaches it. :meth:`cancel` then aborts the
        request in the engine; until then it stays in flight (its id taken)."""
        if self._consumer is not None:
            self._consumer = self._consumer_tokens = None
            self.aborted = True

    async def cancel(self) -> None:
        """:meth:`detach`, abort the request in the engine and free its id."""
        self.detach()
        if not self._starting:  # else start() does it once the engine has the request
            await self._leave_engine()

    async def _leave_engine(self) -> None:
        if self._registered:
            await self.core._abort_in_engine(self.request_id)
            self._release()

    def _on_output(self, out: EngineOutput | Exception) -> None:
        """The engine's sink: one output (or why the request failed) of one step."""
        consumer = self._consumer
        if consumer is None:  # the consumer left; the engine is done with it at its end
            if isinstance(out, Exception) or out.finish_reason is not None:
                if isinstance(out, EngineDeadError):
                    self.core._engine_died(str(out) or "engine died")
                self._release()
            return
        if isinstance(out, Exception):
            error: Exception = out
            if isinstance(out, EngineDeadError):
                self.core._engine_died(str(out) or "engine died")
                error = Unavailable("the engine of this worker died")
                error.__cause__ = out
            elif isinstance(out, RequestRejected):
                metrics.REJECTED.inc()
            elif not isinstance(out, LlmeshError):
                log.error("request %s failed in the engine", self.request_id, exc_info=out)
            self._end(error)
            return
        token_ids = out.token_ids
        if token_ids:
            if self._first_token_at is None:
                self._first_token_at = time.perf_counter()
            self.completion += len(token_ids)
            self.core._tokens_produced += len(token_ids)
            consumer(Delta(token_ids, out.logprobs))
        if out.finish_reason is not None:
            self._finish(out)

    __call__ = _on_output
    """The run is the engine's sink (a :class:`~services.worker.engine.TokenSink`)."""

    def step_tokens(self, token_ids: list[int]) -> None:
        """The engine's sink for a step's plain token ids (no logprobs, not the end): what
        :meth:`_on_output` does with them, and the consumer's own ``step_tokens`` when it has
        one, so no :class:`Delta` is built per request and step."""
        if not token_ids:
            return
        consumer = self._consumer
        if consumer is None:
            return
        if self._first_token_at is None:
            self._first_token_at = time.perf_counter()
        n = len(token_ids)
        self.completion += n
        self.core._tokens_produced += n
        fast = self._consumer_tokens
        if fast is not None:
            fast(token_ids)
        else:
            consumer(Delta(list(token_ids), None))

    def _finish(self, out: EngineOutput) -> None:
        reason = FinishReason.ABORT if self.aborted else out.finish_reason
        assert reason is not None
        self._end(self.core._final(reason, out, self.completion, self.started_at, self._first_token_at,
                                   self.request_id))

    def _end(self, event: Final | Exception) -> None:
        consumer, self._consumer = self._consumer, None
        self._consumer_tokens = None
        self._release()
        if consumer is not None:
            consumer(event)

    def _release(self) -> None:
        """No longer in flight: its id is free."""
        if self._registered:
            self._registered = False
            in_flight = self.core._in_flight
            if in_flight.get(self.request_id) is self:
                del in_flight[self.request_id]
            metrics.IN_FLIGHT.set(len(in_flight))
        self.ended.set()


# -- the core ---------------------------------------------------------------------------

class WorkerCore:
    """Runs generations on one engine and tracks what is in flight."""

    def __init__(
        self,
        engine: Engine,
        identity: WorkerIdentity,
        *,
        on_engine_dead: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.identity = identity
        self.health = HealthState()
        self._in_flight: dict[str, EngineRun] = {}
        self._on_engine_dead = on_engine_dead
        self._dead_reported = False
        self._canary_seq = 0
        self._tokens_produced = 0
        """Tokens the engine produced for callers; a busy engine proves it is not wedged."""
        self.on_busy: Callable[[], None] | None = None
        """Called when a request comes to a worker with none in flight (the load watches'
        clocks: an idle worker's reports wait longer, services/worker/loadclock.py)."""

    # -- requests ---------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def in_flight_ids(self) -> list[str]:
        return list(self._in_flight)

    def id_in_flight(self, request_id: str) -> bool:
        """Whether a request (running, or aborted and on its way out) holds ``request_id``."""
        return request_id in self._in_flight

    def adapter_for(self, model: str, field_name: str = "request.model") -> str:
        """The LoRA adapter a request's ``model`` selects ("" for the base model)."""
        if not model or model == self.identity.model:
            return ""
        if model in self.identity.adapters:
            return model
        raise NotFound(f"{field_name}: model {model!r} is not served by this worker "
                       f"(serves {self.identity.model!r})")

    def validate(self, req: EngineRequest, prefix: str = "request") -> None:
        """Raise InvalidArgument naming every bad field of ``req``."""
        violations = request_violations(req, self.engine.info, prefix)
        if self._running_under(req.request_id):
            violations.insert(0, FieldViolation(f"{prefix}.request_id",
                                                f"request id {req.request_id!r} is already in flight"))
        if violations:
            metrics.REJECTED.inc()
            raise InvalidArgument.many(violations)

    async def generate(self, req: EngineRequest, *, validated: bool = False) -> AsyncGenerator[Event, None]:
        """Deltas, then one Final. Cancelling (or closing) the iterator aborts the request."""
        if not validated:
            self.validate(req)
        request_id_var.set(req.request_id)  # this request's log lines carry its id (the task's own context)
        events: asyncio.Queue[Event | Exception] = asyncio.Queue()
        run = EngineRun(self, req, events.put_nowait)
        try:
            await run.start()
            while True:
                event = await events.get()
                if isinstance(event, Exception):
                    raise event
                yield event
                if isinstance(event, Final):
                    return
        finally:
            # The caller went away (cancelled, deadline passed) before the end: free the
            # engine's sequence; a no-op once the run ended.
            await run.cancel()

    def _running_under(self, request_id: str) -> bool:
        """Whether a request runs under ``request_id`` and is not being aborted. An aborted
        one is on its way out: a caller that cancelled and at once sent its request again
        under the same id (or a router resuming onto this worker) waits for it instead of
        being refused."""
        run = self._in_flight.get(request_id)
        return run is not None and not run.aborted

    async def _wait_for_aborted(self, request_id: str) -> None:
        """Wait (up to :data:`ABORTED_ID_WAIT_S`) until no aborted request holds
        ``request_id``; a running one under it, or one still there after the wait, makes
        this request a duplicate."""
        try:
            async with asyncio.timeout(ABORTED_ID_WAIT_S):
                while (run := self._in_flight.get(request_id)) is not None and run.aborted:
                    await run.ended.wait()
        except TimeoutError:
            pass
        if request_id in self._in_flight:
            metrics.REJECTED.inc()
            raise InvalidArgument("request.request_id", f"request id {request_id!r} is already in flight")

    async def generate_batch(
        self, reqs: Sequence[EngineRequest | Failed], ids: Sequence[str] | None = None,
    ) -> AsyncGenerator[tuple[str, Event | Failed], None]:
        """Run several requests together; yields (request id, event) as they come.

        Each request stands alone: one that fails validation (or that the caller already
        refused, passed in as :class:`Failed` with its id in ``ids``) or that the engine
        rejects ends with a :class:`Failed` event of its own while the others run. All
        valid ones are handed to the engine before the first output is awaited.
        Cancelling the iterator aborts the unfinished ones. Only engine death fails the
        whole call, since no request of it can finish then.
        """
        if not reqs:
            raise InvalidArgument("requests", "must contain at least one request")
        runnable: list[EngineRequest] = []
        seen: set[str] = set()
        for i, req in enumerate(reqs):
            # A refusal belongs to that request alone: name its fields as Generate would.
            prefix = "request"
            if isinstance(req, Failed):
                yield (ids[i] if ids is not None else ""), req
                continue
            violations = request_violations(req, self.engine.info, prefix)
            if req.request_id in seen or self._running_under(req.request_id):
                violations.append(FieldViolation(f"{prefix}.request_id",
                                                 f"request id {req.request_id!r} is duplicated or in flight"))
            seen.add(req.request_id)
            if violations:
                metrics.REJECTED.inc()
                yield req.request_id, Failed(InvalidArgument.many(violations))
            else:
                runnable.append(req)
        if not runnable:
            return

        queue: asyncio.Queue[tuple[str, Event | Failed] | Unavailable] = asyncio.Queue()

        def consumer_for(request_id: str) -> Consumer:
            def consume(event: Event | Exception) -> None:
                if isinstance(event, Unavailable):  # the engine died: nothing in this call can finish
                    queue.put_nowait(event)
                elif isinstance(event, Exception):
                    queue.put_nowait((request_id, Failed(event)))
                else:
                    queue.put_nowait((request_id, event))
            return consume

        runs = [EngineRun(self, req, consumer_for(req.request_id)) for req in runnable]
        waiting: list[asyncio.Task[None]] = []
        try:
            for run in runs:
                if self.id_in_flight(run.request_id):
                    # An aborted request still holds its id: wait for it aside, the others go on.
                    waiting.append(asyncio.ensure_future(run.start()))
                else:
                    await run.start()
            remaining = len(runs)
            while remaining:
                item = await queue.get()
                if isinstance(item, Unavailable):
                    raise item
                if isinstance(item[1], Final | Failed):
                    remaining -= 1
                yield item
        finally:
            for task in waiting:
                task.cancel()
            unfinished = [run for run in runs if not run.done]
            if waiting or unfinished:
                await asyncio.gather(*waiting, *(run.cancel() for run in unfinished), return_exceptions=True)

    async def abort(self, request_id: str) -> None:
        """Abort a request in flight; its stream ends with finish reason ABORT."""
        run = self.mark_aborted(request_id)
        if run is None:
            raise NotFound(f"request_id {request_id!r} is not in flight on this worker")
        await self.abort_marked(run)

    def mark_aborted(self, request_id: str) -> EngineRun | None:
        """Note at once that the request under ``request_id`` is being aborted (its stream
        will end ABORT, and its id may be taken again once it left the engine); None if
        none is in flight. :meth:`abort_marked` then stops it in the engine."""
        run = self._in_flight.get(request_id)
        if run is not None:
            run.aborted = True
        return run

    async def abort_marked(self, run: EngineRun) -> None:
        """Abort this request in the engine, unless it already left it: the engine knows
        requests by id, and the id may by now belong to a newer request. (A run still
        being handed over is aborted by its :meth:`EngineRun.start` once the engine has it.)"""
        if run.in_engine:
            await self.engine.abort(run.request_id)

    def load(self) -> LoadReport:
        return LoadReport(
            engine=self.engine.load(),
            in_flight=len(self._in_flight),
            max_num_seqs=self.engine.info.max_num_seqs,
        )

    # -- health -------------------------------------------------------------------------
    def canary_request(self, max_tokens: int = 1, logprobs: int | None = None) -> EngineRequest:
        self._canary_seq += 1
        info = self.engine.info
        # A short fixed prompt of ordinary ids (low ids are often special tokens).
        base = min(info.vocab_size - 1, 100)
        prompt = tuple(range(base, base + 4)) if base + 4 <= info.vocab_size else (base,)
        return EngineRequest(
            # Callers cannot guess it, so no client request can collide with (or abort) it.
            request_id=f"llmesh-canary-{uuid.uuid4().hex}-{self._canary_seq}",
            prompt_token_ids=prompt,
            sampling=Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs),
        )

    async def run_canary(self, timeout_s: float, max_tokens: int = 1, logprobs: int | None = None) -> bool:
        """One generation that must yield a token within ``timeout_s``; never raises."""
        req = self.canary_request(max_tokens, logprobs)
        # Straight on the engine, not an EngineRun: a canary is neither in flight nor counted.
        outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        got_token = False

        def sink(out: EngineOutput | Exception) -> None:
            nonlocal got_token
            if outcome.done():
                return
            if isinstance(out, Exception):
                outcome.set_exception(out)
                return
            got_token = got_token or bool(out.token_ids)
            if out.finish_reason is not None:
                outcome.set_result(got_token)

        ok = False
        produced_before = self._tokens_produced
        try:
            async with asyncio.timeout(timeout_s):
                await self.engine.start(req, sink)
                ok = await outcome
            if not ok:
                self.health.last_error = "canary produced no token"
        except TimeoutError:
            if self._tokens_produced > produced_before:
                # A saturated engine queues the canary behind real work; it is slow, not
                # wedged, as long as callers' requests keep getting tokens.
                ok = True
                log.info("canary queued behind %d tokens of real work; engine is busy, not wedged",
                         self._tokens_produced - produced_before)
            else:
                self.health.last_error = f"canary produced no token within {timeout_s:g}s"
        except EngineDeadError as exc:
            self._engine_died(str(exc) or "engine died")
        except Exception as exc:
            self.health.last_error = f"canary failed: {type(exc).__name__}"
            log.warning("canary failed: %s", exc)
        finally:
            outcome.cancel()  # a late output finds it done (and no exception goes unretrieved)
            with contextlib.suppress(Exception):
                await self.engine.abort(req.request_id)
        if self.engine.errored:
            self._engine_died("engine is dead")
            ok = False
        self.health.canaries += 1
        metrics.CANARIES.labels("ok" if ok else "failed").inc()
        return ok

    async def warm_up(self, timeout_s: float) -> None:
        """The first generation; the worker reports SERVING only after it succeeded."""
        # With logprobs: vLLM's first logprobs request pays a one-off cost of seconds on
        # CPU; the warm-up pays it instead of the first caller.
        if not await self.run_canary(timeout_s, max_tokens=2, logprobs=1):
            raise RuntimeError(f"warm-up generation failed: {self.health.last_error or 'engine dead'}")
        self.health.warmed_up = True
        self.health.canary_ok = True

    async def monitor(
        self,
        *,
        canary_interval_s: float,
        canary_timeout_s: float,
        check_interval_s: float,
        on_change: Callable[[bool], object] | None = None,
    ) -> None:
        """Watch the engine until it dies: cheap liveness checks, and a periodic canary.

        Calls ``on_change(serving)`` whenever the serving verdict changes; returns once the
        engine is dead (the caller then exits the process). Checks every
        ``check_interval_s``, or :data:`BUSY_CHECK_FACTOR` times that while requests are
        in flight.
        """
        serving = self.health.serving
        next_canary = time.monotonic() + canary_interval_s
        while not self.health.engine_dead:
            # While requests are in the engine its death reaches them at once (their sinks
            # get EngineDeadError, which marks it dead): the check only backs that up then,
            # and wakes a busy worker BUSY_CHECK_FACTOR times less often.
            await asyncio.sleep(check_interval_s * (BUSY_CHECK_FACTOR if self._in_flight else 1))
            try:
                await self.engine.check_health()
            except EngineDeadError as exc:
                self._engine_died(str(exc) or "engine died")
            except Exception as exc:  # any failing health check means dead engine
                self._engine_died(f"check_health failed: {type(exc).__name__}")
            if self.engine.errored:
                self._engine_died("engine is dead")
            if not self.health.engine_dead:
                self._export_load()
            if not self.health.engine_dead and canary_interval_s > 0 and time.monotonic() >= next_canary:
                ok = await self.run_canary(canary_timeout_s)
                if ok != self.health.canary_ok:
                    log.warning("canary %s%s", "recovered" if ok else "failed: ",
                                "" if ok else self.health.last_error)
                self.health.canary_ok = ok
                next_canary = time.monotonic() + canary_interval_s
            if self.health.serving != serving:
                serving = self.health.serving
                if on_change is not None:
                    result = on_change(serving)
                    if asyncio.iscoroutine(result):
                        await result
        if on_change is not None and serving:
            result = on_change(False)
            if asyncio.iscoroutine(result):
                await result

    # -- internals -------------------------------------------------------------------------
    def _export_load(self) -> None:
        load = self.engine.load()
        metrics.ENGINE_RUNNING.set(load.running)
        metrics.ENGINE_WAITING.set(load.waiting)
        metrics.KV_CACHE_USAGE.set(load.kv_cache_usage)
        metrics.PREFIX_CACHE_HIT_RATE.set(load.prefix_cache_hit_rate)

    def _engine_died(self, reason: str) -> None:
        self.health.engine_dead = True
        self.health.last_error = reason
        if not self._dead_reported:
            self._dead_reported = True
            log.error("engine is dead: %s", reason)
            if self._on_engine_dead is not None:
                self._on_engine_dead()

    async def _abort_in_engine(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception as exc:
            log.warning("abort of %s in the engine failed: %s", request_id, exc)

    def _final(
        self, reason: FinishReason, out: EngineOutput | None, completion: int, start: float,
        first_token_at: float | None, request_id: str = "",
    ) -> Final:
        now = time.perf_counter()
        total_ms = (now - start) * 1000.0
        measured_ttft = (first_token_at - start) * 1000.0 if first_token_at is not None else 0.0
        ttft_ms = out.ttft_ms if out is not None and out.ttft_ms is not None else measured_ttft
        queue_ms = out.queue_ms if out is not None and out.queue_ms is not None else 0.0
        metrics.REQUESTS.labels(reason.value).inc()
        metrics.GENERATED_TOKENS.inc(completion)
        if first_token_at is not None:
            metrics.TTFT.observe(ttft_ms / 1000.0)
        log.debug("request %s finished: %s prompt=%d completion=%d ttft_ms=%.1f total_ms=%.1f", request_id,
                  reason.value, out.prompt_tokens if out is not None else 0, completion, ttft_ms, total_ms)
        return Final(
            finish_reason=reason,
            stop_token_id=out.stop_token_id if out is not None and reason is FinishReason.STOP else None,
            prompt_tokens=out.prompt_tokens if out is not None else 0,
            completion_tokens=completion,
            cached_tokens=out.cached_tokens if out is not None else 0,
            queue_ms=queue_ms,
            ttft_ms=ttft_ms,
            total_ms=total_ms,
        )

"""The worker's logic: validation, in-flight bookkeeping, cancellation, batching, health.

No grpc import: the servicer converts protos to :mod:`services.worker.engine` types and
calls :class:`WorkerCore`; errors are raised as :mod:`services.common.errors` types and
mapped to status codes in one place (the shared interceptor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

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


@dataclass
class _InFlight:
    request_id: str
    aborted: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


ABORTED_ID_WAIT_S = 2.0
"""How long a request waits for an aborted one under the same id to leave the engine."""


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
        self._in_flight: dict[str, _InFlight] = {}
        self._on_engine_dead = on_engine_dead
        self._dead_reported = False
        self._canary_seq = 0
        self._tokens_produced = 0
        """Tokens the engine produced for callers; a busy engine proves it is not wedged."""

    # -- requests ---------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def in_flight_ids(self) -> list[str]:
        return list(self._in_flight)

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
        if self.health.engine_dead or self.engine.errored:
            self._engine_died("engine is dead")
            raise Unavailable("the engine of this worker is dead")
        rid = req.request_id
        request_id_var.set(rid)  # this request's log lines carry its id (the task's own context)
        if rid in self._in_flight:
            await self._wait_for_aborted(rid)
        state = _InFlight(rid)
        self._in_flight[rid] = state
        metrics.IN_FLIGHT.set(len(self._in_flight))
        start = time.perf_counter()
        first_token_at: float | None = None
        completion = 0
        last: EngineOutput | None = None
        finished = False
        try:
            # Closed here, not whenever it is collected: its clean-up (the engine's abort of an
            # unfinished sequence) must run before this request's id may be taken again.
            async with contextlib.aclosing(self.engine.generate(req)) as outputs:
                async for out in outputs:
                    last = out
                    if out.token_ids:
                        if first_token_at is None:
                            first_token_at = time.perf_counter()
                        completion += len(out.token_ids)
                        self._tokens_produced += len(out.token_ids)
                        yield Delta(out.token_ids, out.logprobs)
                    if out.finish_reason is not None:
                        finished = True
                        reason = FinishReason.ABORT if state.aborted else out.finish_reason
                        yield self._final(reason, out, completion, start, first_token_at)
                        return
            # The engine ended the stream without a finish reason: report it as an error.
            finished = True
            yield self._final(FinishReason.ERROR, last, completion, start, first_token_at)
        except EngineDeadError as exc:
            self._engine_died(str(exc) or "engine died")
            raise Unavailable("the engine of this worker died") from exc
        except RequestRejected:
            metrics.REJECTED.inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away (cancelled, deadline passed): free the engine's sequence.
            if not finished:
                state.aborted = True  # its id may be taken again while the engine frees it
                await self._abort_in_engine(rid)
            raise
        finally:
            if self._in_flight.get(rid) is state:
                del self._in_flight[rid]
            state.ended.set()
            metrics.IN_FLIGHT.set(len(self._in_flight))

    def _running_under(self, request_id: str) -> bool:
        """Whether a request runs under ``request_id`` and is not being aborted. An aborted
        one is on its way out: a caller that cancelled and at once sent its request again
        under the same id (or a router resuming onto this worker) waits for it instead of
        being refused."""
        state = self._in_flight.get(request_id)
        return state is not None and not state.aborted

    async def _wait_for_aborted(self, request_id: str) -> None:
        """Wait (up to :data:`ABORTED_ID_WAIT_S`) until no aborted request holds
        ``request_id``; a running one under it, or one still there after the wait, makes
        this request a duplicate."""
        try:
            async with asyncio.timeout(ABORTED_ID_WAIT_S):
                while (state := self._in_flight.get(request_id)) is not None and state.aborted:
                    await state.ended.wait()
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

        queue: asyncio.Queue[tuple[str, Event | Failed] | BaseException | None] = asyncio.Queue()

        async def pump(req: EngineRequest) -> None:
            try:
                async with contextlib.aclosing(self.generate(req, validated=True)) as events:
                    async for event in events:
                        queue.put_nowait((req.request_id, event))
            except asyncio.CancelledError:
                raise
            except Unavailable as exc:  # the engine died: nothing in this call can finish
                queue.put_nowait(exc)
            except Exception as exc:
                if not isinstance(exc, LlmeshError):
                    log.exception("request %s failed in the engine", req.request_id)
                queue.put_nowait((req.request_id, Failed(exc)))
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(req)) for req in runnable]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def abort(self, request_id: str) -> None:
        """Abort a request in flight; its stream ends with finish reason ABORT."""
        state = self.mark_aborted(request_id)
        if state is None:
            raise NotFound(f"request_id {request_id!r} is not in flight on this worker")
        await self.abort_marked(state)

    def mark_aborted(self, request_id: str) -> _InFlight | None:
        """Note at once that the request under ``request_id`` is being aborted (its stream
        will end ABORT, and its id may be taken again once it left the engine); None if
        none is in flight. :meth:`abort_marked` then stops it in the engine."""
        state = self._in_flight.get(request_id)
        if state is not None:
            state.aborted = True
        return state

    async def abort_marked(self, state: _InFlight) -> None:
        """Abort this request in the engine, unless it already ended: the engine knows
        requests by id, and the id may by now belong to a newer request."""
        if not state.ended.is_set():
            await self.engine.abort(state.request_id)

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
        got_token = False

        async def run() -> None:
            nonlocal got_token
            async with contextlib.aclosing(self.engine.generate(req)) as outputs:
                async for out in outputs:
                    if out.token_ids:
                        got_token = True
                    if out.finish_reason is not None:
                        return

        ok = False
        produced_before = self._tokens_produced
        try:
            await asyncio.wait_for(run(), timeout_s)
            ok = got_token
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
        engine is dead (the caller then exits the process).
        """
        serving = self.health.serving
        next_canary = time.monotonic() + canary_interval_s
        while not self.health.engine_dead:
            await asyncio.sleep(check_interval_s)
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
        first_token_at: float | None,
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
        log.debug("request finished: %s prompt=%d completion=%d ttft_ms=%.1f total_ms=%.1f",
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

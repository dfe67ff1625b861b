"""Gateway core: drives tokenizer -> router -> postprocessor for one request.

Plain asyncio, no grpc: the tiers are reached through the protocols below, whose grpc
implementations live in :mod:`gateway.tiers`. Transport failures arrive as
:class:`TierUnavailable`, which is what triggers failover:

* the router carrying a stream dies -> resume through another router replica with the
  prompt plus the tokens already received and the remaining budget;
* the postprocessor dies -> replay every token so far into another replica, which
  suppresses the characters the client already has (``skip_chars``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway import metrics
from gateway.audit import AuditLog
from gateway.tenants import AuthenticationFailed, RateLimiter, Tenant, TenantRegistry
from gateway.types import (
    ChatTurn,
    Completion,
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
    TextDelta,
    Timing,
    TokenGeneration,
    TokenLogprob,
)
from gateway.validation import check_context, validate_call, validate_request
from services.common.errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    LlmeshError,
    NotFound,
    Unavailable,
)
from services.common.limits import RequestLimits, clip
from services.common.logs import request_id_var
from services.common.retry import RetryPolicy, Step
from services.common.tracing import tracer

log = logging.getLogger(__name__)


class TierUnavailable(Unavailable):
    """A replica of a tier could not be reached or broke the connection."""


class TokenizerTier(Protocol):
    async def encode(
        self, model: str, prompt: str, messages: list[ChatTurn], *,
        add_generation_prompt: bool | None, timeout: float | None,
    ) -> Encoded: ...

    async def list_models(self, *, timeout: float | None) -> list[ModelMeta]: ...


class RouterTier(Protocol):
    @property
    def replicas(self) -> int: ...

    def generate(
        self, replica: int, request: TokenGeneration, *, resume_token_ids: list[int],
        resumed: int, timeout: float | None,
        on_delta: Callable[[RouterDelta], None] | None = None,
    ) -> AsyncIterator[RouterDelta | RouterFinal]:
        """The request's deltas, then its final. With ``on_delta`` a tier may hand the
        deltas to it instead, in order and before the final, from its frame reader
        (nothing woken per frame); the caller takes either. An ``on_delta`` with a
        ``step_tokens(token_ids)`` method may get a delta without logprobs as its plain
        token ids there instead (a router session's frames)."""
        ...

    async def abort(self, replica: int, request_id: str) -> None: ...


class PostSession(Protocol):
    async def send_tokens(self, token_ids: list[int]) -> None: ...
    async def send_end(self, finish_reason: str) -> None: ...
    async def read(self) -> PostDelta | PostFinal | None: ...
    async def close(self, graceful: bool = False) -> None: ...


class PostprocessorTier(Protocol):
    @property
    def replicas(self) -> int: ...

    async def open(self, replica: int, config: PostConfig, *, timeout: float | None) -> PostSession: ...


class DeltaSink(Protocol):
    """A consumer that takes released text at once, from the frame reader that released it
    (the HTTP surface writes it straight to the connection). The stream's own iterator
    carries whatever the sink does not take, so the order holds: text goes to the sink
    only while nothing waits in the iterator before it."""

    def ready(self) -> bool:
        """Whether :meth:`send` may be called now."""
        ...

    def send(self, delta: TextDelta) -> None:
        """Pass the delta on without blocking."""
        ...


@dataclass
class Deadline:
    """The client's deadline as a monotonic instant (None = no deadline)."""

    at: float | None = None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(None if seconds is None else time.monotonic() + seconds)

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed")
        return left


DEFAULT_FAILOVER = RetryPolicy(
    max_failovers=3, count_replicas=True, base_backoff_s=0.05, max_backoff_s=0.5, jitter=0.5
)
"""The gateway's defaults (GatewaySettings' max_resumes and retry_*_backoff_ms)."""


@dataclass
class GatewayConfig:
    limits: RequestLimits = field(default_factory=RequestLimits)
    default_model: str = ""
    default_max_tokens: int = 512
    default_temperature: float | None = 0.0
    """Applied when a request leaves temperature unset; None leaves it to the engine."""
    failover: RetryPolicy = field(default_factory=lambda: DEFAULT_FAILOVER)
    """How a stream moves to another router or postprocessor replica (GatewaySettings.failover_policy)."""
    models_refresh_s: float = 30.0
    stream_interval: int = 1
    """Tokens per stream delta when a request does not choose (1 = every token)."""
    stream_max_delay_ms: int = 100
    """Longest time streamed text waits for the interval to fill."""


@dataclass(frozen=True)
class Pacing:
    """How one request's text deltas are grouped before they reach the transport.

    Coalescing happens after the postprocessor, on text it already released: stop strings,
    the filter's hold-back and UTF-8 boundaries are decided before any grouping, so the
    concatenated text is the same whatever the pacing.
    """

    interval: int
    """Tokens per delta; 0 holds all text for one delta before the final (unary calls)."""
    max_delay_s: float | None = None
    """Longest time released text is held waiting for the interval; None = no bound."""

    @classmethod
    def for_call(cls, call: GenerateCall, config: GatewayConfig) -> Pacing:
        options = call.stream_options
        delay_ms = options.max_delay_ms or config.stream_max_delay_ms
        return cls(interval=options.interval or config.stream_interval, max_delay_s=delay_ms / 1000)


WHOLE = Pacing(interval=0)
"""One delta with all the text, then the final: what a unary call needs."""


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def scoped_request_id(tenant: Tenant, client_id: str) -> str:
    """The id router and workers know a request by: ``<tenant scope>/<client id>``.

    A client-chosen id is only unique within its tenant: scoped, it neither collides with
    nor reveals (through "already running" or Abort) another tenant's request. The scope
    is a hash of the tenant name, so ids stay short and of one alphabet whatever the name;
    "/" never occurs in a client id, so the split is unambiguous.
    """
    scope = hashlib.sha256(tenant.name.encode()).hexdigest()[:12]
    return f"t{scope}/{client_id}"


def _to_engine_sampling(
    call: GenerateCall, max_tokens: int, default_temperature: float | None = None
) -> GenerateCall:
    temperature = call.sampling.temperature
    if temperature is None:
        temperature = default_temperature
    sampling = dataclasses.replace(call.sampling, max_tokens=max_tokens, stop=[], temperature=temperature)
    return dataclasses.replace(call, sampling=sampling)


class GatewayCore:
    """Everything the public API does, independent of the transport."""

    def __init__(
        self,
        tokenizer: TokenizerTier,
        router: RouterTier,
        postprocessor: PostprocessorTier,
        *,
        tenants: TenantRegistry,
        config: GatewayConfig | None = None,
        audit: AuditLog | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.router = router
        self.postprocessor = postprocessor
        self.tenants = tenants
        self.config = config or GatewayConfig()
        self.audit = audit or AuditLog(None)
        self.limiter = limiter or RateLimiter()
        self._models: list[ModelMeta] = []
        self._models_at = 0.0
        self._rr_router = 0
        self._rr_post = 0
        self._running: set[str] = set()
        """Scoped ids of the requests in progress (a tenant may not reuse a running id)."""

    # -- models -------------------------------------------------------------------

    async def list_models(self, deadline: Deadline | None = None) -> list[ModelMeta]:
        now = time.monotonic()
        if not self._models or now - self._models_at > self.config.models_refresh_s:
            timeout = deadline.remaining() if deadline else 5.0
            self._models = await self.tokenizer.list_models(timeout=timeout)
            self._models_at = now
        return list(self._models)

    async def resolve_model(self, name: str, deadline: Deadline | None = None) -> ModelMeta:
        models = await self.list_models(deadline)
        wanted = name or self.config.default_model
        if not wanted:
            defaults = [m for m in models if m.is_default] or models
            if not defaults:
                raise Unavailable("no model is served")
            return defaults[0]
        for meta in models:
            if meta.id == wanted:
                return meta
        raise NotFound(f"model: {clip(wanted)!r} is not served (served: {', '.join(m.id for m in models)})")

    # -- authentication -------------------------------------------------------------

    def authenticate(self, authorization: str | None, *, peer: str, surface: str) -> Tenant:
        """The caller's tenant; a refusal is counted, audited and logged, then raised."""
        try:
            return self.tenants.authenticate(authorization)
        except AuthenticationFailed as exc:
            self.record_auth_failure(exc, peer=peer, surface=surface)
            raise

    def record_auth_failure(self, exc: AuthenticationFailed, *, peer: str, surface: str) -> None:
        metrics.AUTH_FAILURES.labels(surface, exc.reason).inc()
        entry = {"surface": surface, "peer": clip(peer, 64), "reason": exc.reason,
                 "key_sha256_prefix": exc.key_sha256_prefix}
        self.audit.write(entry, event="auth_failure")
        log.warning("authentication failed (%s) from %s", exc.reason, entry["peer"], extra={"fields": entry})

    # -- tokenize -------------------------------------------------------------------

    async def tokenize(
        self, tenant: Tenant, model: str, prompt: str, messages: list[ChatTurn],
        add_generation_prompt: bool | None, deadline: Deadline,
    ) -> tuple[ModelMeta, Encoded]:
        validate_request(GenerateCall(model=model, prompt=prompt, messages=messages), self.config.limits)
        meta = await self.resolve_model(model, deadline)
        self.limiter.admit(tenant)
        encoded = await self.tokenizer.encode(
            meta.id, prompt, messages, add_generation_prompt=add_generation_prompt,
            timeout=deadline.remaining(),
        )
        return meta, encoded

    # -- generate -------------------------------------------------------------------

    async def generate(self, tenant: Tenant, call: GenerateCall, deadline: Deadline) -> Completion:
        """The unary answer: the concatenation of the stream, gathered in one delta."""
        final: Completion | None = None
        parts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        async for item in self.generate_stream(tenant, call, deadline, pacing=WHOLE):
            if isinstance(item, TextDelta):
                parts.append(item.text)
                ids.extend(item.token_ids)
                logprobs.extend(item.logprobs)
            else:
                final = item
        assert final is not None
        final.text = "".join(parts)
        final.token_ids = ids + final.token_ids
        final.logprobs = logprobs + final.logprobs
        return final

    async def generate_stream(
        self, tenant: Tenant, call: GenerateCall, deadline: Deadline, *, pacing: Pacing | None = None,
        sink: DeltaSink | None = None,
    ) -> AsyncIterator[TextDelta | Completion]:
        """Text deltas as the postprocessor releases them, grouped by ``pacing`` (default: the
        call's stream options over the deployment's), then one Completion. With ``sink``,
        the deltas it is ready for go to it instead of through the iterator (no task wakes
        per delta); the iterator still ends with the Completion."""
        start = time.monotonic()
        limits = self.config.limits
        # Until validate_request passes, what the client sent is only logged clipped.
        client_id = (clip(call.request_id, limits.max_request_id_chars) if call.request_id
                     else uuid.uuid4().hex)
        request_id = scoped_request_id(tenant, client_id)
        request_id_var.set(request_id)  # every log line of this call, in every tier, carries it
        span = tracer().start_span("gateway.generate")
        span.set_attribute("llmesh.request_id", request_id)
        span.set_attribute("llmesh.tenant", tenant.name)
        audit = {
            "tenant": tenant.name, "request_id": client_id, "model": clip(call.model, limits.max_model_chars),
            "prompt_chars": len(call.prompt) + sum(len(m.content) for m in call.messages),
            "messages": len(call.messages),
            "prompt_sha256": sha256_text(
                call.prompt or "\n".join(f"{m.role}:{m.content}" for m in call.messages)
            ),
        }
        status = "OK"
        output_parts: list[str] = []
        completion: Completion | None = None
        registered = False
        try:
            validate_request(call, limits)
            if request_id in self._running:
                raise InvalidArgument(
                    "request_id", f"{client_id!r} is already in use by a running request of this tenant"
                )
            self._running.add(request_id)
            registered = True
            meta = await self.resolve_model(call.model, deadline)
            audit["model"] = meta.id
            span.set_attribute("llmesh.model", meta.id)
            validate_call(call, meta, self.config.limits)
            self.limiter.admit(tenant)
            post_config = PostConfig(
                model=meta.id, stop=list(call.sampling.stop), filter_mode=tenant.filter_mode,
            )
            stream = _Stream(self, post_config, deadline,
                             want_tokens=call.sampling.logprobs is not None,
                             pacing=pacing or Pacing.for_call(call, self.config),
                             sink=sink, record=output_parts)
            with tracer().start_as_current_span("gateway.tokenize"):
                encoded = await self.tokenizer.encode(
                    meta.id, call.prompt, call.messages, add_generation_prompt=None,
                    timeout=deadline.remaining(),
                )
            if encoded.tokenizer_checksum and meta.tokenizer_checksum and (
                encoded.tokenizer_checksum != meta.tokenizer_checksum
            ):
                raise Unavailable("tokenizer replica's checksum differs from the model's")
            prompt_tokens = len(encoded.token_ids)
            span.set_attribute("llmesh.prompt_tokens", prompt_tokens)
            max_tokens = check_context(call, meta, prompt_tokens, self.config.default_max_tokens)
            self.limiter.charge_tokens(tenant, prompt_tokens)
            engine_call = _to_engine_sampling(call, max_tokens, self.config.default_temperature)
            generation = TokenGeneration(
                request_id=request_id, model=meta.id, prompt_token_ids=encoded.token_ids,
                sampling=engine_call.sampling, priority=call.priority, tenant=tenant.name,
            )
            async for item in stream.run(generation):
                if isinstance(item, TextDelta):
                    output_parts.append(item.text)
                    yield item
                    continue
                completion = item
            assert completion is not None
            completion.request_id = client_id  # the client's own id, never the scoped one
            completion.model = meta.id
            completion.prompt_tokens = prompt_tokens
            completion.timing.total_ms = (time.monotonic() - start) * 1000
            completion.timing.ttft_ms = (
                (stream.first_text_at - start) * 1000 if stream.first_text_at else completion.timing.total_ms
            )
            self.limiter.charge_tokens(tenant, completion.completion_tokens)
            metrics.record_completion(completion, tenant.name)
            span.set_attribute("llmesh.completion_tokens", completion.completion_tokens)
            span.set_attribute("llmesh.finish_reason", completion.finish_reason)
            span.set_attribute("llmesh.worker_id", completion.served_by.worker_id)
            span.set_attribute("llmesh.zone", completion.served_by.zone)
            span.set_attribute("llmesh.resumed", completion.served_by.resumed)
            span.set_attribute("llmesh.queue_ms", completion.timing.queue_ms)
            span.set_attribute("llmesh.ttft_ms", completion.timing.ttft_ms)
            yield completion
        except LlmeshError as exc:
            status = exc.code.name
            if status == "RESOURCE_EXHAUSTED":
                metrics.RATE_LIMITED.labels(tenant.name).inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            if registered:
                self._running.discard(request_id)
            span.set_attribute("llmesh.status", status)
            span.end()
            output = "".join(output_parts)
            entry = dict(audit)
            entry.update({
                "status": status,
                "output_chars": len(output),
                "output_sha256": sha256_text(output),
                "duration_ms": round((time.monotonic() - start) * 1000, 3),
            })
            if completion is not None:
                entry.update({
                    "prompt_tokens": completion.prompt_tokens,
                    "completion_tokens": completion.completion_tokens,
                    "finish_reason": completion.finish_reason,
                    "served_by": dataclasses.asdict(completion.served_by),
                })
            else:
                entry["finish_reason"] = "cancelled" if status == "CANCELLED" else "error"
            self.audit.write(entry)
            # One line per request in the process log (sizes and outcome, never text),
            # with this request's id and trace id for correlation with the other tiers.
            log.info("request %s: %s", entry["finish_reason"], status, extra={"fields": {
                k: entry[k] for k in ("tenant", "model", "status", "finish_reason", "prompt_chars",
                                      "output_chars", "duration_ms", "prompt_tokens",
                                      "completion_tokens", "served_by") if k in entry
            }})

    def next_router(self) -> int:
        self._rr_router = (self._rr_router + 1) % max(1, self.router.replicas)
        return self._rr_router

    def next_postprocessor(self) -> int:
        self._rr_post = (self._rr_post + 1) % max(1, self.postprocessor.replicas)
        return self._rr_post


def _failure_kind(exc: LlmeshError) -> str:
    """The retry policy's kind of a router call's error: a replica failing is worth
    another replica; anything else is the request's own answer."""
    if isinstance(exc, TierUnavailable):
        return "transport"
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, Cancelled):
        return "cancelled"
    return "rejected"


class _RouterSink:
    """A stream's ``on_delta`` for the router tier (see :meth:`RouterTier.generate`):
    called with a :class:`RouterDelta`, and its :attr:`step_tokens` with a router
    session frame's plain token ids."""

    __slots__ = ("on_delta", "step_tokens")

    def __init__(self, on_delta: Callable[[RouterDelta], None],
                 step_tokens: Callable[[list[int]], None]) -> None:
        self.on_delta = on_delta
        self.step_tokens = step_tokens

    def __call__(self, delta: RouterDelta) -> None:
        self.on_delta(delta)


class _Stream:
    """One request's pump between the router stream and the postprocessor stream."""

    def __init__(
        self, core: GatewayCore, post_config: PostConfig,
        deadline: Deadline, *, want_tokens: bool, pacing: Pacing = WHOLE,
        sink: DeltaSink | None = None, record: list[str] | None = None,
    ) -> None:
        self.core = core
        self.sink = sink
        self.record = record if record is not None else []
        """The text that went to :attr:`sink`, for the request's audit entry (the rest is
        recorded where the stream's iterator is read)."""
        self.generation: TokenGeneration
        """Set by :meth:`run` (the token ids come from the tokenizer)."""
        self.post_config = post_config
        self.deadline = deadline
        self.want_tokens = want_tokens
        self.tokens: list[int] = []
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.sent_chars = 0
        self.resumed = 0
        self.router_final: RouterFinal | None = None
        self.router_ended = False
        self.router_replica = core.next_router()
        self.post_replica = core.next_postprocessor()
        self.session: PostSession | None = None
        self._send_now: Callable[[list[int]], bool] | None = None
        """The session's write that needs no wait (a Session request), if it has one."""
        self.session_gen = 0
        self.lock = asyncio.Lock()
        """Held while the postprocessor session is replaced or written to with a wait."""
        self.post_sent = 0
        """Tokens of :attr:`tokens` the current postprocessor session has had."""
        self._forwarder: asyncio.Future[None] | None = None
        self.events: asyncio.Queue[tuple[str, object, int]] = asyncio.Queue()
        self.first_text_at: float | None = None
        policy = core.config.failover
        self.router_failovers = policy.start(replicas=core.router.replicas, deadline=deadline.at)
        """Moves to another router replica: retries, then resumes once tokens arrived."""
        self.post_failovers = policy.start(replicas=core.postprocessor.replicas, deadline=deadline.at)
        """Moves to another postprocessor replica, each replaying every token so far."""
        self._reader: asyncio.Future[None] | None = None
        self._opening: asyncio.Future[None] | None = None
        """The postprocessor request opening aside (:meth:`open_soon`)."""
        self._discarded = False
        """The run ended: an open not begun by then is not begun."""
        self.pacing = pacing
        self.held = TextDelta(text="")
        """Released text (with its token detail) not yet sent: the delta being coalesced."""
        self.held_parts: list[str] = []
        """The postprocessor's text pieces held: one per token while text flows (a character
        whose bytes span tokens, or a match the filter holds back, makes one piece of several)."""
        self.hold_timer: asyncio.TimerHandle | None = None
        self.sends = 0
        """Deltas sent; a hold timer armed before the last send is stale."""

    @staticmethod
    def _other(current: int, replicas: int) -> int:
        """The next replica after ``current``, per request: a failover never lands on the
        replica that just failed while another exists (a shared round-robin counter could
        hand concurrent failovers the dead one again)."""
        return (current + 1) % max(1, replicas)

    # postprocessor side ---------------------------------------------------------

    async def _open_session(self) -> None:
        """Open (or re-open) the postprocessor stream and replay what it missed. Holds lock."""
        while True:
            config = dataclasses.replace(self.post_config, skip_chars=self.sent_chars)
            try:
                session = await self.core.postprocessor.open(
                    self.post_replica, config, timeout=self.deadline.remaining()
                )
                replay = list(self.tokens)
                if replay:
                    await session.send_tokens(replay)
                if self.router_ended and self.router_final is not None:
                    await session.send_end(self.router_final.final.finish_reason.value)
            except TierUnavailable as exc:
                self._postprocessor_failed(exc.message)
                await self.post_failovers.pause()
                continue
            self.session = session
            self._send_now = getattr(session, "send_tokens_nowait", None)
            self.post_sent = len(replay)
            self.session_gen += 1
            gen = self.session_gen
            self._reader = asyncio.ensure_future(self._read_session(session, gen))
            self._forward()  # what came meanwhile (sent once the lock is free)
            return

    def _postprocessor_failed(self, reason: str) -> None:
        """Count a postprocessor replica's failure and move to the next replica; raises
        TierUnavailable when the stream may move no more."""
        step = self.post_failovers.failed("transport", delivered=bool(self.tokens))
        if not step.moves:
            raise TierUnavailable(f"postprocessor replicas keep failing; last: {reason}")
        metrics.FAILOVERS.labels("postprocessor", "replay").inc()
        log.warning("postprocessor replica %d failed (%s); replaying %d tokens into another",
                    self.post_replica, reason, len(self.tokens))
        self.post_replica = self._other(self.post_replica, self.core.postprocessor.replicas)

    async def _read_session(self, session: PostSession, gen: int) -> None:
        """The session's final or failure on to the pump. Its text goes to
        :meth:`_on_text` without waking anything: from the session's own frame reader
        when the session can call back (``listen``), else from here."""
        listen = getattr(session, "listen", None)
        if listen is not None:
            listen(functools.partial(self._on_text, gen))
        try:
            while True:
                item = await session.read()
                if item is None:
                    await self.events.put(("post_failed", None, gen))
                    return
                if isinstance(item, PostDelta):
                    self._on_text(gen, item.text)
                    continue
                await self.events.put(("post", item, gen))
                return
        except TierUnavailable as exc:
            await self.events.put(("post_failed", exc, gen))
        except LlmeshError as exc:
            await self.events.put(("error", exc, gen))
        except Exception as exc:
            await self.events.put(("error", _unexpected("postprocessor", exc), gen))

    def _forward(self) -> None:
        """Send the current postprocessor session the tokens it has not had: at once
        when its write needs no wait (a Session request), else from a task that takes the
        lock (a Process call, or while the session is being replaced). Never raises."""
        if self.session is None or self.post_sent >= len(self.tokens):
            return  # none open yet: opening replays every token
        send_now = self._send_now
        if send_now is not None and not self.lock.locked():
            ids = self.tokens[self.post_sent:]
            self.post_sent = len(self.tokens)
            try:
                if send_now(ids):
                    return
            except TierUnavailable:
                return  # a dead session is noticed by its reader, which replays everything
            self.post_sent -= len(ids)  # it needs the awaited write after all
        if self._forwarder is None or self._forwarder.done():
            self._forwarder = asyncio.ensure_future(self._forward_later())

    async def _forward_later(self) -> None:
        async with self.lock:
            await self._send_pending()

    async def _send_pending(self) -> None:
        """:meth:`_forward`'s awaited path. Holds lock."""
        while self.session is not None and self.post_sent < len(self.tokens):
            ids = self.tokens[self.post_sent:]
            self.post_sent = len(self.tokens)
            with contextlib.suppress(TierUnavailable):
                await self.session.send_tokens(ids)

    # router side ------------------------------------------------------------------

    async def _run_router(self) -> None:
        """Router attempts until one ends with the router's final; on a replica's failure
        the stream retries (nothing received yet) or resumes (from the tokens received)
        through the next replica, as the failover policy says. An error that ends the
        request goes to the pump as an ``error`` event."""
        while True:
            try:
                await self._router_attempt()
                return
            except Exception as exc:
                if not isinstance(exc, LlmeshError):
                    await self.events.put(("error", _unexpected("router", exc), 0))
                    return
                step = self.router_failovers.failed(_failure_kind(exc), delivered=bool(self.tokens))
                if not step.moves:
                    await self.events.put(("error", exc, 0))
                    return
                if step is Step.RESUME:
                    self.resumed += 1
                metrics.FAILOVERS.labels("router", step.value).inc()
                log.warning("router replica %d failed (%s); %s through another replica",
                            self.router_replica, exc.message,
                            "resuming" if step is Step.RESUME else "retrying")
                self.router_replica = self._other(self.router_replica, self.core.router.replicas)
            try:
                await self.router_failovers.pause()
            except DeadlineExceeded as exc:
                await self.events.put(("error", exc, 0))
                return

    async def _router_attempt(self) -> None:
        """One router replica's stream: tokens on to the postprocessor as they come, then
        the final. Raises TierUnavailable when the replica fails before its final."""
        stream = self.core.router.generate(
            self.router_replica, self.generation, resume_token_ids=list(self.tokens),
            resumed=self.resumed, timeout=self.deadline.remaining(),
            on_delta=_RouterSink(self._on_tokens, self._on_token_ids),
        )
        async for event in stream:
            if isinstance(event, RouterDelta):
                # Yielded (a Generate call): this task is awake anyway, so it writes.
                self._take_tokens(event.token_ids, event.logprobs)
                async with self.lock:
                    await self._send_pending()
            else:
                async with self.lock:
                    await self._send_pending()  # every token before the end
                    self.router_final = event
                    self.router_ended = True
                    if self.session is not None:
                        with contextlib.suppress(TierUnavailable):
                            await self.session.send_end(event.final.finish_reason.value)
        if not self.router_ended:
            raise TierUnavailable("router stream ended without a final message")

    # the pump -----------------------------------------------------------------------

    async def open(self) -> None:
        """Open the postprocessor request (unless it is open)."""
        async with self.lock:
            if self.session is None:
                await self._open_session()

    def open_soon(self) -> None:
        """Open the postprocessor request aside, two event-loop turns from now: what was
        asked for in this turn (the router submission, from the task :meth:`run` has just
        started) is written first, at the end of the next one (its link's flush), so the
        open's set-up is off the first token's path: the router, the worker and the
        engine take longer than an open, and tokens that come before it are replayed into
        it. Its failure (when the failover policy gives up) ends the request."""
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._start_opening)

    def _start_opening(self) -> None:
        if not self._discarded and self._opening is None and self.session is None:
            self._opening = asyncio.ensure_future(self._open_aside())

    async def _open_aside(self) -> None:
        try:
            await self.open()
        except Exception as exc:
            error = exc if isinstance(exc, LlmeshError) else _unexpected("postprocessor", exc)
            self.events.put_nowait(("error", error, 0))

    async def run(self, generation: TokenGeneration) -> AsyncIterator[TextDelta | Completion]:
        self.generation = generation
        router_task: asyncio.Task[None] | None = None
        final: PostFinal | None = None
        try:
            router_task = asyncio.create_task(self._run_router())
            self.open_soon()
            while final is None:
                kind, payload, gen = await self.events.get()
                if kind == "release":
                    # Due when it was asked for; a release since then took the text.
                    if gen == self.sends and self.held_parts:
                        yield self._release()
                    continue
                if kind == "error":
                    assert isinstance(payload, BaseException)
                    if self.held_parts:
                        yield self._release()  # what the client would have had at interval 1
                    raise payload
                if gen != self.session_gen:
                    continue  # from a replaced postprocessor session
                if kind == "post_failed":
                    reason = payload.message if isinstance(payload, LlmeshError) else "stream ended"
                    self._postprocessor_failed(reason)
                    await self.post_failovers.pause()
                    async with self.lock:
                        await self._open_session()
                    continue
                if isinstance(payload, PostFinal):
                    final = payload
            if self.held_parts:
                yield self._release()
            if not self.router_ended and router_task is not None:
                # Output ended early (stop string, blocked content): stop the engine, and
                # give the router a moment to report where it ran.
                with contextlib.suppress(LlmeshError):
                    await self.core.router.abort(self.router_replica, self.generation.request_id)
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(router_task), 1.0)
            yield self._completion(final)
        finally:
            self._discarded = True
            if self.hold_timer is not None:
                self.hold_timer.cancel()
            if self._opening is not None and not self._opening.done():
                self._opening.cancel()
            if self._forwarder is not None and not self._forwarder.done():
                self._forwarder.cancel()
            if router_task is not None and not router_task.done():
                router_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await router_task
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
            if self.session is not None:
                with contextlib.suppress(Exception):
                    await self.session.close(graceful=final is not None)

    def _on_tokens(self, delta: RouterDelta) -> None:
        """The router's tokens, on to the postprocessor; runs inside the router link's
        frame reader (or this request's attempt): never raises."""
        self._on_token_ids(delta.token_ids, delta.logprobs)

    def _on_token_ids(self, token_ids: list[int], logprobs: Sequence[TokenLogprob] = ()) -> None:
        """The router's token ids (and their logprobs, when a delta carries them) on to the
        postprocessor: a router session frame's plain ids come here directly."""
        try:
            self._take_tokens(token_ids, logprobs)
            self._forward()
        except Exception as exc:
            self.events.put_nowait(("error", _unexpected("router", exc), 0))

    def _take_tokens(self, token_ids: list[int], logprobs: Sequence[TokenLogprob] = ()) -> None:
        self.tokens.extend(token_ids)
        if self.want_tokens:
            self.pending_ids.extend(token_ids)
            self.pending_logprobs.extend(logprobs)

    def _on_text(self, gen: int, text: str) -> None:
        """Text released by the postprocessor, held for the next delta; wakes the pump only
        when a delta is due. Runs inside the session's frame reader: never raises."""
        if gen != self.session_gen or not text:
            return  # from a replaced postprocessor session
        try:
            first = self.first_text_at is None
            if first:
                self.first_text_at = time.monotonic()
            # Released by the postprocessor: a replacement replica skips these.
            self.sent_chars += len(text)
            self.held_parts.append(text)
            if self.want_tokens:
                self.held.token_ids += self.pending_ids
                self.held.logprobs += self.pending_logprobs
                self.pending_ids, self.pending_logprobs = [], []
            # The first text goes out at once (time to first token is not traded); after
            # it, a delta per ``interval`` pieces, or when the hold expires. Pieces, not
            # tokens received: the router runs ahead of the postprocessor.
            if self.pacing.interval and (first or len(self.held_parts) == self.pacing.interval):
                self._due()
            elif self.hold_timer is None and self.pacing.max_delay_s is not None:
                self.hold_timer = asyncio.get_running_loop().call_later(
                    self.pacing.max_delay_s, self._hold_expired, self.sends,
                )
        except Exception as exc:
            self.events.put_nowait(("error", _unexpected("postprocessor", exc), gen))

    def _hold_expired(self, sends: int) -> None:
        """The hold timer armed at delta ``sends``: due unless a release took the text."""
        if sends == self.sends and self.held_parts:
            try:
                self._due()
            except Exception as exc:
                self.events.put_nowait(("error", _unexpected("postprocessor", exc), self.session_gen))

    def _due(self) -> None:
        """The held text is due: to the sink at once when it is ready and nothing waits in
        the pump before it (the order holds), else through the pump."""
        sink = self.sink
        if sink is not None and self.events.empty() and sink.ready():
            delta = self._release()
            self.record.append(delta.text)
            sink.send(delta)
        else:
            self.events.put_nowait(("release", None, self.sends))

    def _release(self) -> TextDelta:
        """The held text as one delta; the next text starts a new one (and a new timer)."""
        delta = self.held
        delta.text = "".join(self.held_parts)
        self.held = TextDelta(text="")
        self.held_parts = []
        self.sends += 1
        if self.hold_timer is not None:
            self.hold_timer.cancel()
            self.hold_timer = None
        return delta

    def _completion(self, final: PostFinal) -> Completion:
        router_final = self.router_final or RouterFinal(Final(FinishReason.ABORT))
        served_by = router_final.served_by
        if self.resumed > served_by.resumed:
            served_by = dataclasses.replace(served_by, resumed=self.resumed)
        completion = Completion(
            request_id=self.generation.request_id,
            model=self.generation.model,
            text="",
            finish_reason=final.finish_reason,
            matched_stop=final.matched_stop,
            completion_tokens=final.completion_tokens or len(self.tokens),
            cached_tokens=router_final.final.cached_tokens,
            served_by=served_by,
            timing=Timing(queue_ms=router_final.final.queue_ms),
        )
        if self.want_tokens:
            completion.token_ids = list(self.pending_ids)
            completion.logprobs = list(self.pending_logprobs)
        return completion


def _unexpected(tier: str, exc: Exception) -> Internal:
    """A failure that is not llmesh's own error (a bug in the gateway or a tier client):
    logged with its traceback, and the request ends INTERNAL at once instead of leaving
    its caller waiting for the deadline."""
    log.error("the %s side of a request failed unexpectedly", tier, exc_info=exc)
    return Internal(f"gateway error on the {tier} side: {type(exc).__name__}")

"""A deterministic engine double with no vLLM import (``llmesh worker --engine fake``).

The next token is a pure function of the whole sequence so far (prompt + generated):
a hash of the last :data:`CONTEXT` tokens, mod the vocabulary, skipping special tokens.
So generating N tokens equals generating k, then re-submitting prompt + those k with
N - k remaining -- the property the router's mid-stream resume relies on. Sampling
temperature, top-p/k and seeds are accepted but do not change the output.

With ``echo`` it generates the prompt again instead, token by token and cycling, so a
test can put known text (an e-mail address, a stop string) into the output; the token at
each position still depends only on the original prompt and the position, so forced
replay on resume gives the same continuation.

It honours ``max_tokens``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids`` (a stop id is
only produced if the hash lands on it), ``logprobs``, abort, a running-request limit
(further requests wait, and count as waiting, until a slot frees) and a step time. It runs
like a batched accelerator: one timer per step, and when it fires every running request
gets its next token and its sink is called, all in that one event-loop callback (no task
or generator per request; :meth:`FakeEngine.start`). A step with no running request arms no
timer, so an idle fake costs nothing. It emits EOS only with ``eos_after``: then EOS
follows the ``eos_after``-th generated token of a request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.modelinfo import max_context_length
from services.worker.engine import (
    EngineDeadError,
    EngineInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    FinishReason,
    OutputSink,
    RequestRejected,
    TokenLogprob,
    stream_from_start,
)

CONTEXT = 4
"""How many trailing tokens determine the next one."""


@dataclass(frozen=True)
class FakeModel:
    """What the fake needs from a model directory."""

    vocab_size: int
    eos_token_id: int
    special_ids: frozenset[int]
    max_model_len: int

    @classmethod
    def from_dir(cls, model_dir: str | Path, max_model_len: int = 0) -> FakeModel:
        root = Path(model_dir).expanduser()
        config = json.loads((root / "config.json").read_text())
        vocab = int(config.get("vocab_size") or 32000)
        eos = config.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        bos = config.get("bos_token_id")
        special: set[int] = {i for i in (eos, bos, config.get("pad_token_id")) if isinstance(i, int)}
        tokenizer_path = root / "tokenizer.json"
        if tokenizer_path.is_file():
            for added in json.loads(tokenizer_path.read_text()).get("added_tokens", []):
                if added.get("special"):
                    special.add(int(added["id"]))
        if len(special) >= vocab:
            raise ValueError(f"{root}: every token is special")
        return cls(
            vocab_size=vocab,
            eos_token_id=int(eos) if isinstance(eos, int) else 0,
            special_ids=frozenset(special),
            max_model_len=max_context_length(root, max_model_len),
        )


def next_token(sequence: list[int] | tuple[int, ...], model: FakeModel) -> int:
    """The fake's next token: a pure function of the sequence's last CONTEXT tokens."""
    tail = ",".join(map(str, sequence[-CONTEXT:])).encode()
    value = int.from_bytes(hashlib.blake2b(tail, digest_size=8).digest(), "big")
    token = value % model.vocab_size
    while token in model.special_ids:
        token = (token + 1) % model.vocab_size
    return token


def _logprob(token: int, n_top: int, model: FakeModel) -> TokenLogprob:
    # Deterministic, plausible numbers: the chosen token is the most likely one.
    top = tuple(
        ((token + i) % model.vocab_size, -0.25 - 1.5 * i) for i in range(max(0, n_top))
    )
    return TokenLogprob(token_id=token, logprob=-0.25, top=top)


@dataclass(eq=False)
class _Sequence:
    """One request inside the fake: what it generated so far and where its outputs go."""

    request: EngineRequest
    sink: OutputSink
    sequence: list[int]
    """Prompt + replayed + generated tokens (the next token hashes its tail)."""
    limit: int
    """Tokens it may still generate: ``max_tokens`` or what the context leaves."""
    arrival: float
    stops: frozenset[int] = frozenset()
    min_tokens: int = 0
    ignore_eos: bool = False
    generated: int = 0
    queue_ms: float | None = None
    ttft_ms: float | None = None
    prompt_tokens: int = field(init=False)
    step_tokens: Callable[[list[int]], None] | None = field(init=False)
    """The sink's ``step_tokens`` for a request without logprobs (a TokenSink): its
    tokens that do not end it go there, as vLLM's adapter hands them."""

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.sequence)
        self.step_tokens = (getattr(self.sink, "step_tokens", None)
                            if self.request.sampling.logprobs is None else None)

    def ending(self, reason: FinishReason) -> EngineOutput:
        """The last output of a request that ends without a new token."""
        return EngineOutput([], finish_reason=reason, queue_ms=self.queue_ms, ttft_ms=self.ttft_ms,
                            prompt_tokens=self.prompt_tokens)


class FakeEngine:
    """Implements :class:`services.worker.engine.Engine` deterministically, one step at a time."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        token_delay_ms: float = 5.0,
        eos_after: int = 0,
        max_running: int = 8,
        max_model_len: int = 0,
        echo: bool = False,
    ) -> None:
        self.model = FakeModel.from_dir(model_dir, max_model_len)
        self.echo = echo
        self.token_delay_s = max(0.0, token_delay_ms) / 1000.0
        """The step time: every running request gets one token per step."""
        self.eos_after = eos_after
        self.max_running = max(1, max_running)
        self.steps = 0
        """Steps that produced tokens (tokens per step = batch occupancy)."""
        self._running: dict[str, _Sequence] = {}
        self._waiting: dict[str, _Sequence] = {}
        """In arrival order: admitted first-come as slots free."""
        self._step_handle: asyncio.Handle | None = None
        self._soon: list[tuple[OutputSink, EngineOutput | Exception]] = []
        """Outputs outside a step (abort, death, no room to generate), delivered together."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead = False
        self._wedged = False
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._seen_prompts: set[tuple[int, ...]] = set()

    # -- protocol -----------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            max_model_len=self.model.max_model_len,
            vocab_size=self.model.vocab_size,
            max_num_seqs=self.max_running,
            eos_token_ids=(self.model.eos_token_id,),
        )

    @property
    def errored(self) -> bool:
        return self._dead

    def load(self) -> EngineLoad:
        rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_cache_usage=min(1.0, len(self._running) / self.max_running),
            prefix_cache_hit_rate=rate,
            # The fake's counts are exact: its scheduler and its frontend are one.
            scheduler_running=len(self._running),
            scheduler_waiting=len(self._waiting),
        )

    async def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError("fake engine killed")

    async def start(self, request: EngineRequest, sink: OutputSink) -> None:
        rid = request.request_id
        if self._dead:
            raise EngineDeadError("fake engine killed")
        if rid in self._running or rid in self._waiting:
            # The worker never does this (it refuses an id in flight); vLLM would run both.
            raise RequestRejected("request.request_id", f"request id {rid!r} is already in the engine")
        self._loop = asyncio.get_running_loop()
        # The next token is a pure function of the sequence, so forced replay of earlier
        # tokens is the same as having them in the prompt.
        prompt = [*request.prompt_token_ids, *request.replay_token_ids]
        self._account_prefix(tuple(prompt))
        sampling = request.sampling
        limit = self.model.max_model_len - len(prompt)
        if sampling.max_tokens is not None:
            limit = min(limit, sampling.max_tokens)
        self._waiting[rid] = _Sequence(
            request, sink, prompt, limit, time.perf_counter(), stops=frozenset(sampling.stop_token_ids),
            min_tokens=sampling.min_tokens or 0,  # unset: the engine's default
            ignore_eos=bool(sampling.ignore_eos),
        )
        self._admit()

    def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        return stream_from_start(self, request)

    async def abort(self, request_id: str) -> None:
        seq = self._running.pop(request_id, None)
        if seq is None:
            seq = self._waiting.pop(request_id, None)
        if seq is not None:
            # Gone from the engine now (its id may be taken again); its ABORT output follows.
            self._deliver_soon(seq.sink, seq.ending(FinishReason.ABORT))
            self._admit()

    async def shutdown(self) -> None:
        self.kill()

    # -- test hooks -----------------------------------------------------------------
    def kill(self) -> None:
        """Simulate engine death: every request's sink gets EngineDeadError."""
        self._dead = True
        if self._step_handle is not None:
            self._step_handle.cancel()
            self._step_handle = None
        doomed = [*self._running.values(), *self._waiting.values()]
        self._running.clear()
        self._waiting.clear()
        for seq in doomed:
            self._deliver_soon(seq.sink, EngineDeadError("fake engine killed"))

    def wedge(self, wedged: bool = True) -> None:
        """Simulate a wedged engine: no step runs (no token) until un-wedged."""
        self._wedged = wedged
        self._arm()

    @property
    def wedged(self) -> bool:
        return self._wedged

    # -- the step loop -------------------------------------------------------------------
    def _admit(self) -> None:
        """Move waiting requests into free slots (first come, first served), and make sure
        a step is coming for the running ones."""
        while self._waiting and len(self._running) < self.max_running:
            rid = next(iter(self._waiting))
            seq = self._waiting.pop(rid)
            seq.queue_ms = (time.perf_counter() - seq.arrival) * 1000.0
            if seq.limit <= 0:  # prompt and replay fill the context: nothing to generate
                self._deliver_soon(seq.sink, seq.ending(FinishReason.LENGTH))
                continue
            self._running[rid] = seq
        self._arm()

    def _arm(self) -> None:
        if self._step_handle is None and self._running and not self._wedged and not self._dead:
            assert self._loop is not None  # set by start(), before anything runs
            if self.token_delay_s > 0:
                self._step_handle = self._loop.call_later(self.token_delay_s, self._step)
            else:
                self._step_handle = self._loop.call_soon(self._step)

    def _step(self) -> None:
        """One forward pass over the running batch: every running request gets its next
        token, and every sink is called here, in this one callback."""
        self._step_handle = None
        if self._wedged or self._dead or not self._running:
            return
        self.steps += 1
        now = time.perf_counter()
        delivered: list[tuple[_Sequence, EngineOutput]] = []
        finished: list[str] = []
        for rid, seq in self._running.items():
            out = self._advance(seq, now)
            delivered.append((seq, out))
            if out.finish_reason is not None:
                finished.append(rid)
        for rid in finished:
            del self._running[rid]
        if finished:
            self._admit()
        else:
            self._arm()
        for seq, out in delivered:
            step_tokens = seq.step_tokens
            if step_tokens is not None and out.finish_reason is None:
                step_tokens(out.token_ids)
            else:
                seq.sink(out)

    def _advance(self, seq: _Sequence, now: float) -> EngineOutput:
        """The next token of one running request, as its output (finished when it ends)."""
        request = seq.request
        may_stop = seq.generated >= seq.min_tokens
        if self.eos_after and seq.generated >= self.eos_after and may_stop and not seq.ignore_eos:
            token = self.model.eos_token_id
        elif self.echo and request.prompt_token_ids:
            source = request.prompt_token_ids
            token = source[(len(seq.sequence) - len(source)) % len(source)]
        else:
            token = next_token(seq.sequence, self.model)
        seq.sequence.append(token)
        seq.generated += 1
        if seq.ttft_ms is None:
            seq.ttft_ms = (now - seq.arrival) * 1000.0
        n_logprobs = request.sampling.logprobs
        logprobs = [_logprob(token, n_logprobs, self.model)] if n_logprobs is not None else None
        finish: FinishReason | None = None
        stop_id: int | None = None
        if may_stop and (token in seq.stops or (token == self.model.eos_token_id and not seq.ignore_eos)):
            finish, stop_id = FinishReason.STOP, token
        elif seq.generated >= seq.limit:
            finish = FinishReason.LENGTH
        return EngineOutput([token], logprobs=logprobs, finish_reason=finish, stop_token_id=stop_id,
                            queue_ms=seq.queue_ms, ttft_ms=seq.ttft_ms, prompt_tokens=seq.prompt_tokens)

    def _deliver_soon(self, sink: OutputSink, out: EngineOutput | Exception) -> None:
        """Hand ``out`` to ``sink`` from the loop, not from inside the caller (an abort, a
        kill): every such output of one loop iteration goes out in one callback."""
        if not self._soon:
            assert self._loop is not None
            self._loop.call_soon(self._deliver)
        self._soon.append((sink, out))

    def _deliver(self) -> None:
        soon, self._soon = self._soon, []
        for sink, out in soon:
            sink(out)

    def _account_prefix(self, prompt: tuple[int, ...]) -> None:
        # A coarse prefix cache: a prompt whose first half was seen before counts as a hit.
        half = prompt[: max(1, len(prompt) // 2)]
        self.prefix_queries += len(prompt)
        if half in self._seen_prompts:
            self.prefix_hits += len(half)
        self._seen_prompts.add(half)
        if len(self._seen_prompts) > 4096:
            self._seen_prompts.clear()


def fake_greedy(prompt: list[int], n: int, model: FakeModel) -> list[int]:
    """What the fake generates for ``prompt`` with ``max_tokens=n`` and no EOS (for tests)."""
    sequence = list(prompt)
    for _ in range(n):
        sequence.append(next_token(sequence, model))
    return sequence[len(prompt):]


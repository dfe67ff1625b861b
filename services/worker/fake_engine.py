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
(further requests wait, and count as waiting) and a step time: one shared timer per step
gives every running request its next token at once (:class:`StepClock`), as a batched
accelerator does. It emits EOS only
with ``eos_after``: then EOS follows the ``eos_after``-th generated token of a request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
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
    TokenLogprob,
    start_from_generator,
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
    tail = ",".join(str(t) for t in sequence[-CONTEXT:]).encode()
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


class StepClock:
    """One timer per engine step for every running request, like a batched accelerator.

    A request waiting for its next token joins the step that is pending (the first waiter
    arms it); when it fires, every request waiting on it gets its token at the same time,
    as one forward pass over the running batch would give them. So a capacity run sees
    one wake-up per step, not one timer per token per request: it measures llmesh, not
    the fake. ``steps`` counts fired steps (tokens per step = batch occupancy).
    """

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.steps = 0
        self._pending: asyncio.Event | None = None

    async def tick(self) -> None:
        if self.step_s <= 0:
            await asyncio.sleep(0)
            return
        if self._pending is None:
            self._pending = asyncio.Event()
            asyncio.get_running_loop().call_later(self.step_s, self._fire)
        # Event.wait is cancel-safe: an aborted request leaves the step to the others.
        await self._pending.wait()

    def _fire(self) -> None:
        step, self._pending = self._pending, None
        self.steps += 1
        if step is not None:
            step.set()


class FakeEngine:
    """Implements :class:`services.worker.engine.Engine` deterministically."""

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
        self.clock = StepClock(self.token_delay_s)
        """Every running request gets one token per step of ``token_delay_ms``."""
        self.eos_after = eos_after
        self.max_running = max(1, max_running)
        self._running: set[str] = set()
        self._waiting: set[str] = set()
        self._aborted: set[str] = set()
        self._slot_freed = asyncio.Condition()
        self._dead = False
        self._wedged = asyncio.Event()
        self._wedged.set()  # set = not wedged (tokens flow)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._drains: set[asyncio.Task[None]] = set()

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

    async def abort(self, request_id: str) -> None:
        if request_id in self._running or request_id in self._waiting:
            self._aborted.add(request_id)
            async with self._slot_freed:
                self._slot_freed.notify_all()

    async def start(self, request: EngineRequest, sink: OutputSink) -> None:
        task = start_from_generator(self.generate(request), sink)
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def shutdown(self) -> None:
        self._dead = True
        self._wedged.set()
        async with self._slot_freed:
            self._slot_freed.notify_all()

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        if self._dead:
            raise EngineDeadError("fake engine killed")
        arrival = time.perf_counter()
        # The next token is a pure function of the sequence, so forced replay of earlier
        # tokens is the same as having them in the prompt.
        prompt = tuple(request.prompt_token_ids) + tuple(request.replay_token_ids)
        self._account_prefix(prompt)
        self._waiting.add(rid)
        try:
            async with self._slot_freed:
                await self._slot_freed.wait_for(
                    lambda: len(self._running) < self.max_running or rid in self._aborted or self._dead
                )
            self._waiting.discard(rid)
            if self._dead:
                raise EngineDeadError("fake engine killed")
            queue_ms = (time.perf_counter() - arrival) * 1000.0
            self._running.add(rid)
            async for output in self._decode(request, prompt, arrival, queue_ms):
                yield output
        finally:
            self._waiting.discard(rid)
            self._running.discard(rid)
            self._aborted.discard(rid)
            async with self._slot_freed:
                self._slot_freed.notify_all()

    # -- test hooks -----------------------------------------------------------------
    def kill(self) -> None:
        """Simulate engine death: running generations fail with EngineDeadError."""
        self._dead = True
        self._wedged.set()

    def wedge(self, wedged: bool = True) -> None:
        """Simulate a wedged engine: no token is produced until un-wedged."""
        if wedged:
            self._wedged.clear()
        else:
            self._wedged.set()

    @property
    def wedged(self) -> bool:
        return not self._wedged.is_set()

    # -- internals -------------------------------------------------------------------
    def _account_prefix(self, prompt: tuple[int, ...]) -> None:
        # A coarse prefix cache: a prompt whose first half was seen before counts as a hit.
        half = prompt[: max(1, len(prompt) // 2)]
        self.prefix_queries += len(prompt)
        if half in self._seen_prompts:
            self.prefix_hits += len(half)
        self._seen_prompts.add(half)
        if len(self._seen_prompts) > 4096:
            self._seen_prompts.clear()

    async def _decode(
        self, request: EngineRequest, prompt: tuple[int, ...], arrival: float, queue_ms: float
    ) -> AsyncGenerator[EngineOutput, None]:
        sampling = request.sampling
        limit = self.model.max_model_len - len(prompt)
        if sampling.max_tokens is not None:
            limit = min(limit, sampling.max_tokens)
        sequence = list(prompt)
        stops = set(sampling.stop_token_ids)
        min_tokens = sampling.min_tokens or 0  # unset: the engine's default
        ignore_eos = bool(sampling.ignore_eos)
        generated = 0
        ttft_ms: float | None = None
        prompt_tokens = len(prompt)
        rid = request.request_id
        while True:
            if rid in self._aborted:
                yield EngineOutput([], finish_reason=FinishReason.ABORT, queue_ms=queue_ms,
                                   ttft_ms=ttft_ms, prompt_tokens=prompt_tokens)
                return
            if generated >= limit:
                yield EngineOutput([], finish_reason=FinishReason.LENGTH, queue_ms=queue_ms,
                                   ttft_ms=ttft_ms, prompt_tokens=prompt_tokens)
                return
            await self.clock.tick()
            if not self._wedged.is_set():
                await self._wedged.wait()
            if self._dead:
                raise EngineDeadError("fake engine killed")
            if rid in self._aborted:
                continue
            may_stop = generated >= min_tokens
            if self.eos_after and generated >= self.eos_after and may_stop and not ignore_eos:
                token = self.model.eos_token_id
            elif self.echo and request.prompt_token_ids:
                source = request.prompt_token_ids
                token = source[(len(sequence) - len(source)) % len(source)]
            else:
                token = next_token(sequence, self.model)
            sequence.append(token)
            generated += 1
            if ttft_ms is None:
                ttft_ms = (time.perf_counter() - arrival) * 1000.0
            logprobs = (
                [_logprob(token, sampling.logprobs, self.model)] if sampling.logprobs is not None else None
            )
            finish: FinishReason | None = None
            stop_id: int | None = None
            if may_stop and (
                token in stops or (token == self.model.eos_token_id and not ignore_eos)
            ):
                finish, stop_id = FinishReason.STOP, token
            elif generated >= limit:
                finish = FinishReason.LENGTH
            yield EngineOutput([token], logprobs=logprobs, finish_reason=finish, stop_token_id=stop_id,
                               queue_ms=queue_ms, ttft_ms=ttft_ms, prompt_tokens=prompt_tokens)
            if finish is not None:
                return


def fake_greedy(prompt: list[int], n: int, model: FakeModel) -> list[int]:
    """What the fake generates for ``prompt`` with ``max_tokens=n`` and no EOS (for tests)."""
    sequence = list(prompt)
    for _ in range(n):
        sequence.append(next_token(sequence, model))
    return sequence[len(prompt):]


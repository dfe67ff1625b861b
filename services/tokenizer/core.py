"""Tokenizer tier logic: validate, render chat templates, encode (no grpc import).

Encoding is micro-batched: requests that arrive while the encoder threads are busy are
encoded together with ``Tokenizer.encode_batch``, which releases the GIL and spreads the
work over the cores (``Tokenizer.encode`` holds the GIL, so a plain thread pool of single
encodes does not scale).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.common.errors import FieldViolation, InvalidArgument, NotFound, Unavailable
from services.common.limits import RequestLimits, check_text, clip
from services.tokenizer.loader import LoadedTokenizer

ROLES = ("system", "user", "assistant", "tool")
# Roles whose turns carry no meaning without text. Assistant turns may be empty (a turn
# that only called a tool) and so may tool results.
ROLES_NEEDING_CONTENT = ("system", "user")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class EncodeInput:
    """One prompt or one conversation, as the caller sent it."""

    model: str = ""
    prompt: str = ""
    messages: tuple[ChatMessage, ...] = ()
    add_generation_prompt: bool | None = None
    """Messages only; ``None`` means the default (true)."""
    truncate_to: int = 0
    add_special_tokens: bool | None = None
    """Raw prompts only; ``None`` means the default (true)."""


@dataclass(frozen=True)
class EncodeResult:
    model: str
    token_ids: list[int]
    truncated: bool
    tokenizer_checksum: str

    @property
    def count(self) -> int:
        return len(self.token_ids)


class RaiseFromTemplate(jinja2.exceptions.TemplateError):
    """``raise_exception(...)`` called by a chat template (e.g. roles must alternate)."""


def _raise_exception(message: str) -> None:
    raise RaiseFromTemplate(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Same as transformers: jinja's built-in tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses.

    Sandboxed and immutable (a template cannot reach Python internals or mutate the
    messages), ``trim_blocks``/``lstrip_blocks``, loop controls, and the helpers templates
    expect: ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatRenderer:
    """A model's chat template with its special-token variables bound."""

    def __init__(self, model: LoadedTokenizer) -> None:
        self.model_name = model.name
        self.template = compile_chat_template(model.chat_template) if model.chat_template else None
        self.variables = dict(model.special_tokens)

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool,
               field: str) -> str:
        if self.template is None:
            raise InvalidArgument(field, f"model {self.model_name!r} has no chat template; send a prompt")
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, tools=None,
                documents=None, **self.variables,
            )
        except RaiseFromTemplate as exc:
            raise InvalidArgument(field, f"rejected by the chat template: {exc.message}") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidArgument(field, f"chat template failed: {exc}") from exc


@dataclass(frozen=True)
class PreparedInput:
    """A validated input: the text to encode and how."""

    model: LoadedTokenizer
    text: str
    add_special_tokens: bool
    truncate_to: int


def _check_text(field: str, value: str, max_chars: int) -> None:
    violations: list[FieldViolation] = []
    check_text(field, value, max_chars, violations)
    if violations:
        raise InvalidArgument.many(violations)


def validate_messages(messages: Sequence[ChatMessage], limits: RequestLimits, field: str) -> None:
    if len(messages) > limits.max_messages:
        raise InvalidArgument(
            field, f"{len(messages)} messages exceed the limit of {limits.max_messages}"
        )
    total = 0
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if message.role not in ROLES:
            raise InvalidArgument(f"{where}.role", f"unknown role {clip(message.role, 32)!r}; "
                                  f"expected one of {', '.join(ROLES)}")
        if not message.content and message.role in ROLES_NEEDING_CONTENT:
            raise InvalidArgument(f"{where}.content", f"a {message.role} message needs content")
        total += len(message.content)
        if total > limits.max_input_chars:
            raise InvalidArgument(
                f"{where}.content",
                f"conversation exceeds the limit of {limits.max_input_chars} characters",
            )
        _check_text(f"{where}.content", message.content, limits.max_input_chars)


INLINE_ENCODE_MAX_CHARS = 512
"""The default longest text encoded on the event loop (TokenizerSettings.inline_encode_max_chars)."""


class EncodeBatcher:
    """Micro-batches concurrent encodes into ``encode_batch`` calls on a thread pool.

    There is no timer: the encodes asked for in one event-loop iteration are gathered and,
    at the end of it, leave as one batch as soon as a thread is free, carrying everything
    that queued up meanwhile. Under load batches grow by themselves.

    At low load a short text (at most ``inline_max_chars``) that is alone, with no encode
    running, is encoded on the event loop instead: tens of microseconds of encoding
    against the hand-off to a thread and back (two thread wake-ups, 0.1-0.5 ms of the
    request's time to first token on a busy 2-core machine).
    """

    def __init__(self, threads: int = 2, max_batch: int = 32,
                 on_batch: Callable[[int], None] | None = None, *,
                 inline_max_chars: int = INLINE_ENCODE_MAX_CHARS) -> None:
        self.threads = max(1, threads)
        self.on_batch = on_batch
        self.max_batch = max(1, max_batch)
        self.inline_max_chars = max(0, inline_max_chars)
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="encode")
        self._pending: deque[tuple[Tokenizer, bool, str, asyncio.Future[list[int]]]] = deque()
        self._inflight = 0
        self._dispatch_scheduled = False
        self.batches = 0
        """Encode batches run, on a thread or (of one text) inline."""
        self.inline = 0
        """Of those, the ones encoded on the event loop."""
        self.encoded = 0

    async def encode(self, tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        self._pending.append((tokenizer, add_special_tokens, text, future))
        if not self._dispatch_scheduled:
            # At the end of this iteration: the other encodes asked for in it join the batch.
            self._dispatch_scheduled = True
            loop.call_soon(self._dispatch)
        return await future

    def _dispatch(self) -> None:
        self._dispatch_scheduled = False
        loop = asyncio.get_running_loop()
        while self._pending and self._inflight < self.threads:
            tokenizer, add_special, _, _ = self._pending[0]
            batch: list[tuple[str, asyncio.Future[list[int]]]] = []
            keep: deque[tuple[Tokenizer, bool, str, asyncio.Future[list[int]]]] = deque()
            while self._pending:
                item = self._pending.popleft()
                if item[3].done():  # the caller went away while queued
                    continue
                if len(batch) < self.max_batch and item[0] is tokenizer and item[1] == add_special:
                    batch.append((item[2], item[3]))
                else:
                    keep.append(item)
            self._pending = keep
            if not batch:
                continue
            self.batches += 1
            if self.on_batch is not None:
                self.on_batch(len(batch))
            if (len(batch) == 1 and not self._inflight and not self._pending
                    and 0 < len(batch[0][0]) <= self.inline_max_chars):
                self._encode_inline(tokenizer, add_special, *batch[0])
                continue
            self._inflight += 1
            texts = [text for text, _ in batch]
            work: Future[list[list[int]]] = self._executor.submit(
                _encode_batch, tokenizer, texts, add_special
            )
            work.add_done_callback(functools.partial(self._finished_in_thread, loop, batch))

    def _encode_inline(self, tokenizer: Tokenizer, add_special: bool, text: str,
                       future: asyncio.Future[list[int]]) -> None:
        self.inline += 1
        try:
            ids = tokenizer.encode(text, add_special_tokens=add_special).ids
        except Exception as exc:
            future.set_exception(exc)
            return
        future.set_result(ids)
        self.encoded += 1

    def _finished_in_thread(self, loop: asyncio.AbstractEventLoop,
                            batch: list[tuple[str, asyncio.Future[list[int]]]],
                            done: Future[list[list[int]]]) -> None:
        # Runs on the encoder thread: hand the results back to the event loop (which may
        # already be closed when the server shuts down with work in flight).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._finish, batch, done)

    def _finish(self, batch: list[tuple[str, asyncio.Future[list[int]]]],
                done: Future[list[list[int]]]) -> None:
        self._inflight -= 1
        cancelled = done.cancelled()
        error = Unavailable("the tokenizer is shutting down") if cancelled else done.exception()
        results = done.result() if error is None else None
        for i, (_, future) in enumerate(batch):
            if future.done():
                continue
            if results is not None:
                future.set_result(results[i])
                self.encoded += 1
            else:
                assert error is not None
                future.set_exception(error)
        self._dispatch()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _encode_batch(tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    return [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]


class TokenizerCore:
    """Every loaded model, the limits, and the encoder."""

    def __init__(self, models: dict[str, LoadedTokenizer], *, limits: RequestLimits | None = None,
                 threads: int = 2, max_batch: int = 32,
                 on_batch: Callable[[int], None] | None = None,
                 inline_max_chars: int = INLINE_ENCODE_MAX_CHARS) -> None:
        if not models:
            raise ValueError("at least one model is required")
        # The served name is the key; keep each model's own name in step with it.
        self.models = {
            name: model if model.name == name else dataclasses.replace(model, name=name)
            for name, model in models.items()
        }
        self.default_model = next(iter(models))
        self.limits = limits or RequestLimits()
        self.renderers = {name: ChatRenderer(model) for name, model in self.models.items()}
        self.batcher = EncodeBatcher(threads=threads, max_batch=max_batch, on_batch=on_batch,
                                     inline_max_chars=inline_max_chars)

    def resolve(self, name: str, field: str) -> LoadedTokenizer:
        model = self.models.get(name or self.default_model)
        if model is None:
            served = ", ".join(self.models)
            raise NotFound(f"{field}: model {clip(name)!r} is not served here (served: {served})")
        return model

    def prepare(self, item: EncodeInput, field: str) -> PreparedInput:
        """Validate one input and render it; ``field`` prefixes error field names."""
        model = self.resolve(item.model, f"{field}.model")
        if item.prompt and item.messages:
            raise InvalidArgument(field, "give either prompt or messages, not both")
        if not item.prompt and not item.messages:
            raise InvalidArgument(field, "empty input: give a prompt or messages")
        if item.truncate_to < 0:
            raise InvalidArgument(f"{field}.truncate_to", "must be >= 0")
        if item.prompt:
            _check_text(f"{field}.prompt", item.prompt, self.limits.max_input_chars)
            add_special = True if item.add_special_tokens is None else item.add_special_tokens
            return PreparedInput(model, item.prompt, add_special, item.truncate_to)
        validate_messages(item.messages, self.limits, f"{field}.messages")
        add_generation = True if item.add_generation_prompt is None else item.add_generation_prompt
        text = self.renderers[model.name].render(
            item.messages, add_generation_prompt=add_generation, field=f"{field}.messages"
        )
        # The rendered template already holds its special tokens (BOS, turn markers):
        # encoding must not add them again (as transformers' apply_chat_template does).
        return PreparedInput(model, text, False, item.truncate_to)

    async def encode_prepared(self, prepared: PreparedInput) -> EncodeResult:
        ids = await self.batcher.encode(prepared.model.tokenizer, prepared.text, prepared.add_special_tokens)
        truncated = 0 < prepared.truncate_to < len(ids)
        if truncated:
            # Keep the end: the latest turns and the generation prompt matter most.
            ids = ids[len(ids) - prepared.truncate_to:]
        return EncodeResult(prepared.model.name, ids, truncated, prepared.model.checksum)

    async def encode(self, item: EncodeInput, field: str = "input") -> EncodeResult:
        return await self.encode_prepared(self.prepare(item, field))

    async def encode_batch(self, items: Sequence[EncodeInput], field: str = "inputs") -> list[EncodeResult]:
        if not items:
            raise InvalidArgument(field, "no inputs")
        if len(items) > self.limits.max_batch_inputs:
            raise InvalidArgument(
                field, f"{len(items)} inputs exceed the limit of {self.limits.max_batch_inputs}"
            )
        total = sum(len(i.prompt) + sum(len(m.content) for m in i.messages) for i in items)
        if total > self.limits.max_batch_chars:
            raise InvalidArgument(
                field, f"{total} characters exceed the request limit of {self.limits.max_batch_chars}"
            )
        # Validate everything first: a bad input fails the call before any work is done.
        prepared = [self.prepare(item, f"{field}[{i}]") for i, item in enumerate(items)]
        return list(await asyncio.gather(*(self.encode_prepared(p) for p in prepared)))

    def close(self) -> None:
        self.batcher.close()

"""Postprocessor logic: token deltas in, text deltas out (no grpc import).

One ``PostprocessSession`` per request, a pipeline applied token by token:

    IncrementalDetokenizer -> StopStringMatcher -> SensitiveDataFilter -> skip_chars

Each stage holds back only what it must (an incomplete character, text that could still
become a stop string, a tail that could still be sensitive data) and releases the rest.
Tokens are stepped one at a time so ``completion_tokens`` names exactly the token that
completed a stop string or a blocked match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from services.common.errors import InvalidArgument, NotFound
from services.postprocessor.detokenizer import IncrementalDetokenizer, byte_fallback_ids
from services.postprocessor.sensitive import FilterMode, SensitiveDataFilter
from services.tokenizer.loader import LoadedTokenizer


class UpstreamFinish(StrEnum):
    """Why the engine stopped (ProcessEnd)."""

    UNSPECIFIED = "unspecified"
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class FinishReason(StrEnum):
    """The final reason the client sees."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    CONTENT_FILTER = "content_filter"
    ERROR = "error"


UPSTREAM_TO_FINISH: dict[UpstreamFinish, FinishReason] = {
    # An engine that ends without saying why ended normally (EOS).
    UpstreamFinish.UNSPECIFIED: FinishReason.STOP,
    UpstreamFinish.STOP: FinishReason.STOP,
    UpstreamFinish.LENGTH: FinishReason.LENGTH,
    UpstreamFinish.ABORT: FinishReason.CANCELLED,
    UpstreamFinish.ERROR: FinishReason.ERROR,
}


class StopStringMatcher:
    """Finds the first stop string in a text stream, holding back possible beginnings.

    Everything released was checked: no stop string can start in released text, because
    any suffix that is a prefix of a stop string stays in the buffer until it is either
    completed (a match) or disproved.
    """

    def __init__(self, stops: Sequence[str], *, include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self._buffer = ""
        self.matched: str | None = None
        self._longest = max((len(s) for s in self.stops), default=0)
        self._first_chars = frozenset(s[0] for s in self.stops if s)

    @property
    def held_chars(self) -> int:
        return len(self._buffer)

    def feed(self, text: str) -> str:
        """Add text; return what is safe to release. Sets ``matched`` on a hit."""
        if not self.stops:
            return text
        if self.matched is not None:
            return ""
        buf = self._buffer + text
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = buf.find(stop)
            # Earliest match wins; at the same position the longer stop string.
            if at >= 0 and (best is None or (at, -len(stop)) < (best[0], best[1])):
                best = (at, -len(stop), stop)
        if best is not None:
            at, _, stop = best
            self.matched = stop
            self._buffer = ""
            return buf[:at + len(stop)] if self.include_stop else buf[:at]
        hold = 0
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            if buf[-k] not in self._first_chars:
                continue  # cheap pre-check: no stop string starts with this character
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        self._buffer = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return out


class SkipChars:
    """Suppresses the first ``count`` characters (already delivered before a replay)."""

    def __init__(self, count: int) -> None:
        self.remaining = count

    def apply(self, text: str) -> str:
        if self.remaining <= 0 or not text:
            return text
        cut = min(self.remaining, len(text))
        self.remaining -= cut
        return text[cut:]


@dataclass(frozen=True)
class SessionConfig:
    model: str = ""
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    filter_mode: FilterMode | None = None
    """``None`` takes the server's default mode."""
    skip_chars: int = 0


@dataclass(frozen=True)
class Limits:
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_tokens_per_stream: int = 131_072
    max_skip_chars: int = 4_000_000


@dataclass(frozen=True)
class FinalResult:
    finish_reason: FinishReason
    matched_stop: str
    completion_tokens: int
    redactions: int


@dataclass(frozen=True)
class Step:
    """What one call released: text (possibly empty) and, once, the final result."""

    text: str
    final: FinalResult | None = None


class PostprocessSession:
    """One request's stream. ``feed`` token deltas, then ``end``; stop after a final."""

    def __init__(self, model: LoadedTokenizer, config: SessionConfig, mode: FilterMode,
                 limits: Limits, *, byte_ids: frozenset[int], token_texts: dict[int, str] | None = None,
                 on_redaction: Callable[[str], None] | None = None) -> None:
        self.model = model
        self.config = config
        self.limits = limits
        self.detokenizer = IncrementalDetokenizer(
            model.tokenizer, skip_special_tokens=config.skip_special_tokens,
            byte_token_ids=byte_ids, special_token_ids=model.special_ids, token_texts=token_texts,
        )
        self.stops = StopStringMatcher(config.stop, include_stop=config.include_stop_str_in_output)
        self.filter = SensitiveDataFilter(mode)
        self.skip = SkipChars(config.skip_chars)
        self.on_redaction = on_redaction
        self.tokens = 0
        self.final: FinalResult | None = None
        self._reported: dict[str, int] = {}

    @property
    def redactions(self) -> int:
        return sum(self.filter.redactions.values())

    def _report_redactions(self) -> None:
        if self.on_redaction is None:
            return
        for kind, count in self.filter.redactions.items():
            for _ in range(count - self._reported.get(kind, 0)):
                self.on_redaction(kind)
            self._reported[kind] = count

    def _finish(self, reason: FinishReason) -> FinalResult:
        self.final = FinalResult(
            finish_reason=reason,
            matched_stop=self.stops.matched or "",
            completion_tokens=self.tokens,
            redactions=self.redactions,
        )
        return self.final

    def _through_filters(self, text: str, *, final: bool) -> str:
        released = self.filter.feed(text, final=final)
        self._report_redactions()
        return self.skip.apply(released)

    def check(self, token_ids: Sequence[int], field: str = "tokens.token_ids") -> None:
        """Raise InvalidArgument (naming the index) for ids out of range or too many tokens."""
        if self.tokens + len(token_ids) > self.limits.max_tokens_per_stream:
            raise InvalidArgument(
                field, f"stream exceeds {self.limits.max_tokens_per_stream} tokens"
            )
        vocab = self.model.vocab_size
        for i, token in enumerate(token_ids):
            if not 0 <= token < vocab:
                raise InvalidArgument(
                    f"{field}[{i}]", f"token id {token} is outside the vocabulary (0..{vocab - 1})"
                )

    def feed(self, token_ids: Sequence[int], field: str = "tokens.token_ids") -> Step:
        """Process newly generated tokens (checked first, see ``check``)."""
        if self.final is not None:
            return Step("")
        self.check(token_ids, field)
        if not self.stops.stops and self.filter.mode is FilterMode.OFF:
            # Nothing can end the stream or hold text back per token: the delta's text in
            # one step (the same text, released as early, as token by token below).
            self.tokens += len(token_ids)
            return Step(self.skip.apply(self.detokenizer.add_each(token_ids)))
        out: list[str] = []
        for token in token_ids:
            self.tokens += 1
            text = self.stops.feed(self.detokenizer.add((token,)))
            if self.stops.matched is not None:
                out.append(self._through_filters(text, final=True))
                reason = (FinishReason.CONTENT_FILTER if self.filter.blocked else FinishReason.STOP)
                return Step("".join(out), self._finish(reason))
            out.append(self._through_filters(text, final=False))
            if self.filter.blocked is not None:
                return Step("".join(out), self._finish(FinishReason.CONTENT_FILTER))
        return Step("".join(out))

    def end(self, upstream: UpstreamFinish) -> Step:
        """The engine finished: release everything held, then the final result."""
        if self.final is not None:
            return Step("")
        text = self.stops.feed(self.detokenizer.flush())
        if self.stops.matched is None:
            text += self.stops.flush()
        released = self._through_filters(text, final=True)
        if self.filter.blocked is not None:
            reason = FinishReason.CONTENT_FILTER
        elif self.stops.matched is not None:
            reason = FinishReason.STOP
        else:
            reason = UPSTREAM_TO_FINISH[upstream]
        return Step(released, self._finish(reason))


class PostprocessCore:
    """Loaded tokenizers, limits and the default filter mode; opens sessions."""

    def __init__(self, models: dict[str, LoadedTokenizer], *, limits: Limits | None = None,
                 default_filter_mode: FilterMode = FilterMode.REDACT,
                 on_redaction: Callable[[str], None] | None = None) -> None:
        if not models:
            raise ValueError("at least one model is required")
        # The served name is the key; keep each model's own name in step with it.
        self.models = {
            name: model if model.name == name else dataclasses.replace(model, name=name)
            for name, model in models.items()
        }
        self.default_model = next(iter(models))
        self.limits = limits or Limits()
        self.default_filter_mode = default_filter_mode
        self.on_redaction = on_redaction
        self._byte_ids = {name: byte_fallback_ids(m.tokenizer) for name, m in self.models.items()}
        # Single tokens' texts, per model and skip_special_tokens, shared by its streams.
        self._token_texts: dict[tuple[str, bool], dict[int, str]] = {
            (name, skip): {} for name in self.models for skip in (False, True)
        }

    def open(self, config: SessionConfig, field: str = "config") -> PostprocessSession:
        """Validate ``config`` and start a session (errors name ``config.<field>``)."""
        name = config.model or self.default_model
        model = self.models.get(name)
        if model is None:
            served = ", ".join(self.models)
            raise NotFound(f"{field}.model: model {name[:128]!r} is not served here (served: {served})")
        if len(config.stop) > self.limits.max_stop_strings:
            raise InvalidArgument(
                f"{field}.stop",
                f"{len(config.stop)} stop strings exceed the limit of {self.limits.max_stop_strings}",
            )
        for i, stop in enumerate(config.stop):
            if not stop:
                raise InvalidArgument(f"{field}.stop[{i}]", "must not be empty")
            if len(stop) > self.limits.max_stop_chars:
                raise InvalidArgument(
                    f"{field}.stop[{i}]",
                    f"{len(stop)} characters exceed the limit of {self.limits.max_stop_chars}",
                )
        if config.skip_chars > self.limits.max_skip_chars:
            raise InvalidArgument(f"{field}.skip_chars", f"must be <= {self.limits.max_skip_chars}")
        mode = config.filter_mode or self.default_filter_mode
        return PostprocessSession(
            model, config, mode, self.limits, byte_ids=self._byte_ids[name],
            token_texts=self._token_texts[name, config.skip_special_tokens], on_redaction=self.on_redaction,
        )

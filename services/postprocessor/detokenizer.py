"""Incremental, UTF-8-safe detokenization (the vLLM / TGI prefix-offset algorithm). No grpc.

Decoding token by token is wrong in two ways: a character split over several tokens
(byte-level BPE, SentencePiece byte fallback) decodes to U+FFFD halves, and SentencePiece
decoders strip the leading space of whatever they decode, so "▁world" alone is "world".
The fix is to always decode a small window that starts a little before the new tokens
and emit only what the new tokens added to it:

* ``prefix_offset..read_offset`` are tokens whose text was already emitted; they give
  the new tokens their context (and absorb the decoder's leading-space strip);
* ``read_offset..`` are the tokens not emitted yet;
* while the window's text ends in U+FFFD, a character is still incomplete: hold it back
  (offsets unchanged) and try again with the next token;
* with SentencePiece byte fallback, a run of ``<0xNN>`` tokens decodes as a whole: if
  the run is not valid UTF-8, *every* byte of it becomes U+FFFD, even an ASCII byte
  that decoded fine alone. So a window ending in a byte token is held until the run
  ends (this also covers a CJK character spelled as three byte tokens).

The concatenated output equals ``tokenizer.decode(all_ids)`` (property-tested in
tests/postprocessor for both tokenizer families).

Each step decodes two windows. Streamed one token at a time, the first (the text already
emitted) is a single token, whose text a table shared by every stream of the tokenizer
keeps: one decode per token instead of two, the postprocessor's largest single cost.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def byte_fallback_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the ``<0xNN>`` pieces of a byte-fallback tokenizer (empty for byte-level BPE)."""
    if not getattr(tokenizer.model, "byte_fallback", False):
        return frozenset()
    return frozenset(
        idx for piece, idx in tokenizer.get_vocab(with_added_tokens=False).items()
        if _BYTE_PIECE.fullmatch(piece)
    )


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    return frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 max_held_tokens: int = 64, byte_token_ids: frozenset[int] | None = None,
                 special_token_ids: frozenset[int] | None = None,
                 token_texts: dict[int, str] | None = None) -> None:
        """``byte_token_ids`` / ``special_token_ids`` are computed from ``tokenizer`` when
        not given; pass them to avoid that per stream. ``token_texts`` is the table of
        single tokens' decoded texts, to share between the streams of one tokenizer and
        one ``skip_special_tokens`` (at most one entry per vocabulary id)."""
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {} if token_texts is None else token_texts
        self.skip_special_tokens = skip_special_tokens
        self.byte_token_ids = byte_fallback_ids(tokenizer) if byte_token_ids is None else byte_token_ids
        if special_token_ids is None:
            special_token_ids = special_ids(tokenizer)
        # Tokens the decoder never sees: they neither end nor split a byte run.
        self.invisible_ids = special_token_ids if skip_special_tokens else frozenset()
        # A text that keeps ending in U+FFFD (the model really produces that character,
        # or invalid bytes) must not hold the stream forever. A UTF-8 character spans at
        # most 4 bytes, hence 4 tokens; 64 leaves a wide margin.
        self.max_held_tokens = max_held_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def held_tokens(self) -> int:
        """Tokens received whose text has not been emitted yet."""
        return len(self.token_ids) - self.read_offset

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the text that is now safe to emit (may be empty)."""
        self.token_ids.extend(token_ids)
        return self._step(final=False)

    def add_each(self, token_ids: Sequence[int]) -> str:
        """The text that adding ``token_ids`` one at a time would release, in one step when
        it can be: the run is decoded as a whole, and only if that leaves some of it held
        back (an incomplete character, a byte run, text-less tokens) is it added again a
        token at a time, so no text is released later than token by token would. A delta
        of several tokens then costs one decode of the window, not one per token."""
        count = len(token_ids)
        if count == 1:
            return self.add(token_ids)
        if self.held_tokens + count > self.max_held_tokens:
            # (Past the hold limit, where the held text is cut depends on the token.)
            return "".join([self.add((token,)) for token in token_ids])
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        text = self._step(final=False)
        if text:
            # Tokens without text at the end stay held, as one at a time they would (so the
            # hold limit counts the same tokens either way).
            end = len(self.token_ids)
            while end > start and self.token_ids[end - 1] in self.invisible_ids:
                end -= 1
            self.read_offset = end
            return text
        del self.token_ids[start:]  # _step released nothing, so it changed nothing else
        return "".join([self.add((token,)) for token in token_ids])

    def flush(self) -> str:
        """The stream ended: emit whatever is held, incomplete characters included."""
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        if self.read_offset >= len(self.token_ids):
            return ""
        emitted = self.read_offset - self.prefix_offset
        if emitted == 1:
            token = self.token_ids[self.prefix_offset]
            prefix_text = self.token_texts.get(token)
            if prefix_text is None:
                prefix_text = self.token_texts[token] = self._decode([token])
        elif emitted:
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        else:
            prefix_text = ""
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) and not final:
            # The new tokens add no text yet (e.g. skipped special tokens): wait for more.
            return ""
        complete = not new_text.endswith(REPLACEMENT) and not self._in_byte_run()
        if not (complete or final or self.held_tokens > self.max_held_tokens):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta

    def _in_byte_run(self) -> bool:
        if not self.byte_token_ids:
            return False
        # Look back no further than the window: its first tokens were emitted complete.
        for index in range(len(self.token_ids) - 1, self.prefix_offset - 1, -1):
            token = self.token_ids[index]
            if token in self.invisible_ids:
                continue
            return token in self.byte_token_ids
        return False

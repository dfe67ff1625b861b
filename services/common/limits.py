"""What one request may carry: the limits the gateway and the tokenizer share.

One type, read by the gateway's validation (public API and HTTP) and by the tokenizer's
core, so a request the gateway admits is never one the tokenizer refuses. The largest
request message the gateway accepts is derived from them, so an oversized (or
unauthenticated) message is refused by gRPC before anything is parsed.

Text rule, the same for every string field (prompt, message content and role, stop
strings, model, request id), at every tier that reads it: NUL and lone surrogates are
refused (``INVALID_ARGUMENT`` naming the field). NUL is what C code and log pipelines
truncate or choke on; a lone surrogate cannot be encoded as UTF-8 for the next hop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from services.common.errors import FieldViolation

# Longest role name ("assistant"), rounded up: roles are one of a fixed set.
MAX_ROLE_CHARS = 16
# Worst-case encoded size of one character: UTF-8 (proto) and a JSON escape pair (HTTP).
_PROTO_BYTES_PER_CHAR = 4
_JSON_BYTES_PER_CHAR = 12

_FORBIDDEN_TEXT = re.compile("[\x00\ud800-\udfff]")


@dataclass(frozen=True)
class RequestLimits:
    """Sizes and counts one request may carry (characters are Unicode code points)."""

    max_input_chars: int = 200_000
    """Most characters in one prompt, or in all message contents of one conversation."""
    max_messages: int = 256
    """Most chat messages in one conversation."""
    max_model_chars: int = 256
    max_request_id_chars: int = 128
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    max_priority: int = 1000
    max_batch_inputs: int = 64
    """Tokenizer EncodeBatch: most inputs in one call."""
    max_batch_chars: int = 4_000_000
    """Tokenizer EncodeBatch: most characters in all inputs of one call."""

    def _text_chars(self) -> int:
        return (self.max_input_chars + self.max_messages * MAX_ROLE_CHARS + self.max_model_chars
                + self.max_request_id_chars + self.max_stop_strings * self.max_stop_chars)

    def _items(self) -> int:
        return self.max_messages + self.max_stop_strings + self.max_stop_token_ids

    def max_message_bytes(self) -> int:
        """The largest serialized request that can be within these limits: every string at
        its limit in 4-byte UTF-8, every repeated field full, framing and scalars on top."""
        return _PROTO_BYTES_PER_CHAR * self._text_chars() + 32 * self._items() + 4096

    def max_json_bytes(self) -> int:
        """The same for an OpenAI-style JSON body, where one character may take a 12-byte
        escape pair and every list item carries its keys."""
        return _JSON_BYTES_PER_CHAR * self._text_chars() + 256 * self._items() + 16384


class RequestLimitSettings(BaseModel):
    """The settings fields of :class:`RequestLimits`, shared by the gateway's and the
    tokenizer's settings so both tiers take the same flags with the same defaults."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    max_input_chars: int = RequestLimits.max_input_chars
    """Most characters in one prompt, or in all message contents of one conversation
    (gateway and tokenizer share this limit; keep them equal)."""
    max_messages: int = RequestLimits.max_messages
    """Most chat messages in one conversation."""
    max_stop_strings: int = RequestLimits.max_stop_strings
    """Most stop strings in one request."""
    max_stop_chars: int = RequestLimits.max_stop_chars
    """Longest stop string, in characters."""
    max_stop_token_ids: int = RequestLimits.max_stop_token_ids
    """Most stop token ids in one request."""
    max_model_chars: int = RequestLimits.max_model_chars
    """Longest model name a request may carry, in characters."""
    max_request_id_chars: int = RequestLimits.max_request_id_chars
    """Longest client request id, in characters."""

    def request_limits(self, **extra: int) -> RequestLimits:
        """These settings as :class:`RequestLimits` (``extra`` sets tier-only fields)."""
        return RequestLimits(
            max_input_chars=self.max_input_chars, max_messages=self.max_messages,
            max_stop_strings=self.max_stop_strings, max_stop_chars=self.max_stop_chars,
            max_stop_token_ids=self.max_stop_token_ids, max_model_chars=self.max_model_chars,
            max_request_id_chars=self.max_request_id_chars, **extra,
        )


def check_text(field: str, value: str, max_chars: int, violations: list[FieldViolation]) -> None:
    """Append a violation when ``value`` is too long or breaks the text rule (module doc)."""
    if len(value) > max_chars:
        violations.append(FieldViolation(field, f"{len(value)} characters exceeds the limit of {max_chars}"))
        return
    bad = _FORBIDDEN_TEXT.search(value)
    if bad is not None:
        what = "NUL characters" if bad.group() == "\x00" else "unpaired surrogate code points"
        violations.append(FieldViolation(field, f"must not contain {what}"))


def clip(value: str, max_chars: int = 128) -> str:
    """A client-controlled string as it may appear in logs, audit records and messages."""
    return value if len(value) <= max_chars else f"{value[:max_chars]}...({len(value)} chars)"

"""Sensitive data in model output: detection with checksums, and a streaming filter. No grpc.

Kinds: ``card`` (13-19 digits starting 2-6, passing Luhn, spaces/dashes allowed), ``iban`` (mod-97),
``cn_id`` (18-character Chinese resident identity number with its ISO 7064 check
character), ``phone`` (international ``+<digits>`` or a mainland China mobile number) and
``email``. Checksums keep ordinary numbers (amounts, years, order numbers) from being
redacted.

The streaming filter holds back a bounded tail of text that could still be, or grow
into, a match, so a number split over several deltas is still caught; it never logs
or stores text beyond that tail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class FilterMode(StrEnum):
    OFF = "off"
    REDACT = "redact"
    BLOCK = "block"


KINDS = ("card", "iban", "cn_id", "phone", "email")
# Longest tail held back while it could still become a match (an e-mail local part,
# an IBAN in groups of four). Longer candidates are released and may be missed.
MAX_HOLD_CHARS = 96


@dataclass(frozen=True)
class Match:
    kind: str
    start: int
    end: int


def luhn_valid(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def iban_valid(compact: str) -> bool:
    if not 15 <= len(compact) <= 34 or not compact[:2].isalpha() or not compact[2:4].isdigit():
        return False
    rearranged = compact[4:] + compact[:4]
    number = "".join(str(int(ch, 36)) for ch in rearranged)
    return int(number) % 97 == 1


_CN_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_CN_ID_CHECK = "10X98765432"


def cn_id_valid(value: str) -> bool:
    if len(value) != 18 or not value[:17].isdigit():
        return False
    total = sum(int(d) * w for d, w in zip(value[:17], _CN_ID_WEIGHTS, strict=True))
    return _CN_ID_CHECK[total % 11] == value[17].upper()


_CN_ID = re.compile(r"(?<![0-9A-Za-z])\d{17}[\dXx](?![0-9A-Za-z])")
_CARD = re.compile(r"(?<![\d])\d(?:[ -]?\d){12,18}(?![\d])")
_IBAN = re.compile(r"(?<![0-9A-Za-z])[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,32}")
_PHONE_INTL = re.compile(r"(?<![\w+])\+\d(?:[ ().-]{0,2}\d){6,14}(?!\d)")
_PHONE_CN = re.compile(r"(?<![\d+])(?:(?:00|\+)?86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)")
_EMAIL = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}(?![A-Za-z0-9-])"
)


# Every kind's match holds a digit (``\d``, as its pattern: any Unicode decimal digit)
# or an "@": text without either can hold no match, and the filter skips the search.
_TRIGGER = re.compile(r"[\d@]")


def could_match(text: str) -> bool:
    """False when no kind can match anywhere in ``text`` (no digit and no "@")."""
    return _TRIGGER.search(text) is not None


def _shorter_ends(text: str, start: int, end: int) -> list[int]:
    """``end`` and every earlier separator position: candidates trimmed group by group."""
    ends = [end]
    for j in range(end - 1, start, -1):
        if text[j] in " -":
            ends.append(j)
    return ends


def _candidates(pattern: re.Pattern[str], text: str) -> list[tuple[int, int]]:
    """The (greedy) match at *every* start the pattern accepts, overlapping ones included.

    ``finditer`` alone resumes after each match, so "0000 4111 1111 1111 1111" would
    consume the card's digits in a longer candidate that fails Luhn and never try the
    card itself (and a streamed text, cut elsewhere, would find it: different output).
    """
    spans = []
    for start in range(len(text)):
        m = pattern.match(text, start)
        if m is not None:
            spans.append((m.start(), m.end()))
    return spans


def _find_cards(text: str) -> list[Match]:
    found = []
    for start, end in _candidates(_CARD, text):
        for cut in _shorter_ends(text, start, end):
            digits = re.sub(r"[ -]", "", text[start:cut])
            # Payment networks' numbers start with 2-6 (Mastercard, Amex, Visa, ...,
            # UnionPay, Discover); other digit runs passing Luhn are left alone.
            if 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn_valid(digits):
                found.append(Match("card", start, cut))
                break
    return found


def _find_ibans(text: str) -> list[Match]:
    found = []
    for start, end in _candidates(_IBAN, text):
        for cut in _shorter_ends(text, start, end):
            if cut < len(text) and text[cut].isalnum():
                continue
            if iban_valid(text[start:cut].replace(" ", "")):
                found.append(Match("iban", start, cut))
                break
    return found


def _find_regex(kind: str, pattern: re.Pattern[str], text: str, min_digits: int = 0,
                max_digits: int = 1000) -> list[Match]:
    found = []
    for start, end in _candidates(pattern, text):
        digits = sum(ch.isdigit() for ch in text[start:end])
        if min_digits <= digits <= max_digits:
            found.append(Match(kind, start, end))
    return found


def find_sensitive(text: str, min_start: int = 0) -> list[Match]:
    """Validated, non-overlapping matches in ``text`` starting at ``min_start`` or later.

    ``text[:min_start]`` is context only (already released): it decides boundaries but
    a match starting there is not reported and does not shadow later ones.

    Overlaps are resolved by the earliest start, then by kind priority: the stricter
    checksum wins (an 18-digit resident ID may also pass Luhn by chance).
    """
    candidates = [
        *(m for m in _find_regex("cn_id", _CN_ID, text) if cn_id_valid(text[m.start:m.end])),
        *_find_cards(text),
        *_find_ibans(text),
        *_find_regex("phone", _PHONE_CN, text),
        *_find_regex("phone", _PHONE_INTL, text, min_digits=8, max_digits=15),
        *_find_regex("email", _EMAIL, text),
    ]
    candidates = [m for m in candidates if m.start >= min_start]
    candidates.sort(key=lambda m: (m.start, KINDS.index(m.kind), -m.end))
    result: list[Match] = []
    for m in candidates:
        if result and m.start < result[-1].end:
            continue
        result.append(m)
    return result


# Could the tail starting here still be, or grow into, a match? (Prefix checks.) Each
# accepts at least every start the detection patterns above accept, so nothing that could
# become a match is released early; holding a little more than needed is harmless.
_PREFIX_NUMBER = re.compile(r"\+?[\d() .-]*[Xx]?")
_PREFIX_IBAN = re.compile(r"[A-Z]{1,2}|[A-Z]{2}\d{1,2}|[A-Z]{2}\d{2}(?: ?[A-Z0-9]){0,32} ?")
_PREFIX_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+(?:@[A-Za-z0-9.-]*)?")
_EMAIL_LOCAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._%+-")


def _could_start_match(tail: str, before: str) -> bool:
    first = tail[0]
    # Cards, resident IDs and CN mobiles start at a digit after a non-digit; international
    # numbers at a "+" after a non-word character.
    number_start = (first.isdigit() and not before.isdigit()) or (
        first == "+" and not (before.isalnum() or before in ("_", "+"))
    )
    if number_start and sum(ch.isdigit() for ch in tail) <= 19 and _PREFIX_NUMBER.fullmatch(tail):
        return True
    if "A" <= first <= "Z" and not before.isalnum() and _PREFIX_IBAN.fullmatch(tail):
        return True
    return first in _EMAIL_LOCAL and before not in _EMAIL_LOCAL and bool(_PREFIX_EMAIL.fullmatch(tail))


def hold_start(text: str, before: str = "") -> int:
    """Index from which ``text`` must be held back (``len(text)`` if nothing needs to be).

    ``before`` is the character preceding ``text`` (already released), for boundaries.
    """
    n = len(text)
    for p in range(max(0, n - MAX_HOLD_CHARS), n):
        prev = text[p - 1] if p > 0 else before
        if _could_start_match(text[p:], prev):
            return p
    return n


def redaction_marker(kind: str) -> str:
    return f"[REDACTED:{kind}]"


class SensitiveDataFilter:
    """Streaming filter: feed text, get back text that is safe to release."""

    def __init__(self, mode: FilterMode) -> None:
        self.mode = mode
        self._buffer = ""
        self._before = ""
        self.redactions: dict[str, int] = {}
        self.blocked: str | None = None
        """Kind of the match that stopped the stream in block mode."""

    @property
    def held_chars(self) -> int:
        return len(self._buffer)

    def feed(self, text: str, *, final: bool = False) -> str:
        """Add ``text``; return what can be released. With ``final`` nothing is held.

        In block mode, once ``blocked`` is set the returned text ends before the match
        and every later call returns "".
        """
        if self.mode is FilterMode.OFF:
            return text
        if self.blocked is not None:
            return ""
        buf = self._buffer + text
        if not buf:
            return ""
        ctx = self._before
        # Matches start in ``buf`` and so lie in it: without a digit or "@" there is none
        # (the search tries every pattern at every start: most of a redacting stream's CPU).
        matches = [Match(m.kind, m.start - len(ctx), m.end - len(ctx))
                   for m in find_sensitive(ctx + buf, min_start=len(ctx))] if could_match(buf) else []
        release = len(buf) if final else hold_start(buf, ctx)
        for m in matches:
            if m.start < release < m.end:
                release = m.start  # never cut through a match: hold all of it
        settled = [m for m in matches if m.end <= release]
        if self.mode is FilterMode.BLOCK and settled:
            first = settled[0]
            self.blocked = first.kind
            self.redactions[first.kind] = self.redactions.get(first.kind, 0) + 1
            self._buffer = ""
            return buf[:first.start]
        pieces: list[str] = []
        pos = 0
        for m in settled:
            pieces.append(buf[pos:m.start])
            pieces.append(redaction_marker(m.kind))
            self.redactions[m.kind] = self.redactions.get(m.kind, 0) + 1
            pos = m.end
        pieces.append(buf[pos:release])
        if release > 0:
            self._before = buf[release - 1]
        self._buffer = buf[release:]
        return "".join(pieces)

"""Sensitive-data detection (checksums) and the streaming filter's hold-back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.postprocessor.sensitive import (
    MAX_HOLD_CHARS,
    FilterMode,
    SensitiveDataFilter,
    cn_id_valid,
    could_match,
    find_sensitive,
    iban_valid,
    luhn_valid,
)

CARD = "4111 1111 1111 1111"
IBAN = "DE89 3704 0044 0532 0130 00"
CN_ID = "11010519491231002X"
PHONE_INTL = "+44 20 7946 0958"
PHONE_CN = "138 1234 5678"
EMAIL = "jane.doe@example.co.uk"
SAMPLES = {"card": CARD, "iban": IBAN, "cn_id": CN_ID, "phone": PHONE_INTL, "email": EMAIL}


def test_checksums():
    assert luhn_valid("4111111111111111") and luhn_valid("5500005555555559")
    assert not luhn_valid("4111111111111112")
    assert iban_valid("DE89370400440532013000") and iban_valid("GB82WEST12345698765432")
    assert not iban_valid("DE89370400440532013001")
    assert cn_id_valid("11010519491231002X") and cn_id_valid("11010519491231002x")
    assert not cn_id_valid("110105194912310021")


@pytest.mark.parametrize(("text", "kind"), [
    (f"card {CARD} ok", "card"),
    ("card 5500-0055-5555-5559.", "card"),
    ("card 4111111111111111", "card"),
    (f"iban {IBAN}, thanks", "iban"),
    ("GB82WEST12345698765432", "iban"),
    (f"id {CN_ID} here", "cn_id"),
    ("身份证110105194912310021无效 11010519491231002X", "cn_id"),
    (f"call {PHONE_INTL} now", "phone"),
    (f"手机 {PHONE_CN}", "phone"),
    ("mobile 13812345678.", "phone"),
    ("+86 138-1234-5678", "phone"),
    (f"write to {EMAIL}.", "email"),
])
def test_finds_each_kind(text, kind):
    kinds = [m.kind for m in find_sensitive(text)]
    assert kinds == [kind], (text, kinds)


@pytest.mark.parametrize("text", [
    "In 2024 revenue was 1234567 dollars, order 99812.",
    "card 4111 1111 1111 1112 fails Luhn",
    "IBAN DE89 3704 0044 0532 0130 02 fails mod-97",
    "id 110105194912310021 has a wrong check digit",
    "version 1.2.3, call me maybe, 12:30",
    "no at-sign: jane.doe example.com",
])
def test_ordinary_text_is_not_flagged(text):
    assert find_sensitive(text) == []


def _stream(mode, pieces):
    f = SensitiveDataFilter(mode)
    out = [f.feed(p) for p in pieces]
    out.append(f.feed("", final=True))
    return "".join(out), f


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_redaction_caught_at_every_split_point(kind):
    text = f"Sure, the value is {SAMPLES[kind]} and that is all."
    expected = text.replace(SAMPLES[kind], f"[REDACTED:{kind}]")
    for cut in range(1, len(text)):
        out, f = _stream(FilterMode.REDACT, [text[:cut], text[cut:]])
        assert out == expected, cut
        assert f.redactions == {kind: 1}
    out, _ = _stream(FilterMode.REDACT, list(text))
    assert out == expected


def test_hold_back_releases_ordinary_text_promptly():
    f = SensitiveDataFilter(FilterMode.REDACT)
    assert f.feed("The answer is simply this: ") == "The answer is simply this: "
    # A trailing word could still become an e-mail address: held until disproved.
    assert f.feed("hello") == ""
    assert f.feed(" there") == "hello "
    # A digit run could still become a card number.
    assert f.feed("; 4111 1111") == "there; "
    assert f.held_chars <= MAX_HOLD_CHARS


def test_block_sends_nothing_of_the_match():
    text = f"Your card is {CARD} and more text"
    for cut in (5, 17, 20, len(text) - 3):
        out, f = _stream(FilterMode.BLOCK, [text[:cut], text[cut:]])
        assert out == "Your card is "
        assert f.blocked == "card"
        assert f.feed("anything") == ""


def test_off_passes_everything_through():
    out, f = _stream(FilterMode.OFF, [CARD[:7], CARD[7:]])
    assert out == CARD and f.redactions == {}


_filler = st.text(alphabet=st.sampled_from(list("abc XYZ.,;:-+()@0123456789\n你好")), max_size=30)


@settings(max_examples=400, deadline=None)
@given(
    parts=st.lists(st.tuples(_filler, st.sampled_from([*SAMPLES.values(), PHONE_CN, ""])), max_size=4),
    cuts=st.lists(st.integers(1, 12), max_size=40),
)
def test_streamed_output_equals_one_shot(parts, cuts):
    """However the text is cut into deltas, the filter's output is the same."""
    text = "".join(f"{filler} {item} " for filler, item in parts)
    whole, _ = _stream(FilterMode.REDACT, [text])
    pieces, pos = [], 0
    for size in cuts:
        pieces.append(text[pos:pos + size])
        pos += size
    pieces.append(text[pos:])
    streamed, _ = _stream(FilterMode.REDACT, pieces)
    assert streamed == whole


# Everything the patterns use but digits and "@" (the Unicode digit is the filter's
# business too: ``\d`` matches it).
_NO_TRIGGER = st.text(alphabet=st.sampled_from(list("abcxyzXYZDEGB .,;:-+()%_/\n你好é")), max_size=80)


@settings(max_examples=300, deadline=None)
@given(text=_NO_TRIGGER, start=st.integers(0, 80))
def test_text_without_a_digit_or_at_sign_holds_no_match(text, start):
    """The premise of the filter's fast path, checked against the full search."""
    assert not could_match(text)
    assert find_sensitive(text, min_start=min(start, len(text))) == []


@pytest.mark.parametrize("sample", [*SAMPLES.values(), PHONE_CN, "\uff14111 1111 1111 1111", "user@host"])
def test_every_kind_needs_a_digit_or_at_sign(sample):
    assert could_match(sample)
    assert not could_match(sample.translate({ord(c): None for c in "0123456789@\uff14"}))


def test_the_fast_path_still_redacts_a_number_completed_by_a_later_delta():
    """Deltas without a digit still pass through the search while a held number waits."""
    out, f = _stream(FilterMode.REDACT, ["card ", CARD[:4], " ", CARD[5:9], " ", CARD[10:], " thanks"])
    assert out == "card [REDACTED:card] thanks" and f.redactions == {"card": 1}

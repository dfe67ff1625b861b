"""IncrementalDetokenizer: UTF-8-safe deltas whose concatenation equals tokenizer.decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.postprocessor.detokenizer import REPLACEMENT, IncrementalDetokenizer, byte_fallback_ids
from tests.postprocessor.conftest import SMOL, TINY

MULTIBYTE = "你好，世界！漢字テスト 😀👍🏽👩‍👩‍👧 ünïcödé Ωμέγα"


def _stream(tokenizer, ids, chunks, skip=True, token_texts=None):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, token_texts=token_texts)
    deltas = []
    pos = 0
    for size in chunks:
        if pos >= len(ids):
            break
        deltas.append(detok.add(ids[pos:pos + size]))
        pos += size
    if pos < len(ids):
        deltas.append(detok.add(ids[pos:]))
    deltas.append(detok.flush())
    return deltas


def _interesting_ids(model):
    """Ids that make detokenizing hard: specials, byte pieces, pieces of CJK and emoji."""
    tok = model.tokenizer
    ids = set(model.special_ids)
    ids |= set(byte_fallback_ids(tok))
    ids |= set(tok.encode(MULTIBYTE, add_special_tokens=False).ids)
    ids |= set(tok.encode(" Hello  world\n\n  indented", add_special_tokens=False).ids)
    return sorted(ids)


def _property(model_name):
    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def check(tokenizers, data):
        model = tokenizers[model_name]
        interesting = _interesting_ids(model)
        token = st.one_of(st.integers(0, model.vocab_size - 1), st.sampled_from(interesting))
        ids = data.draw(st.lists(token, max_size=48), label="ids")
        chunks = data.draw(st.lists(st.integers(1, 6), max_size=48), label="chunks")
        skip = data.draw(st.booleans(), label="skip_special_tokens")
        # A table of single tokens' texts warmed by every earlier example, as a
        # postprocessor's streams share one, or a fresh one.
        shared = data.draw(st.booleans(), label="shared_token_texts")
        table = tables.setdefault(skip, {}) if shared else None
        deltas = _stream(model.tokenizer, ids, chunks, skip, table)
        assert "".join(deltas) == model.tokenizer.decode(ids, skip_special_tokens=skip)

    tables: dict[bool, dict[int, str]] = {}
    return check


test_concatenation_equals_decode_byte_level_bpe = _property(SMOL)
test_concatenation_equals_decode_sentencepiece_byte_fallback = _property(TINY)


@pytest.mark.parametrize("model_name", [SMOL, TINY])
def test_cjk_and_emoji_split_across_tokens_never_emit_partial_characters(tokenizers, model_name):
    tok = tokenizers[model_name].tokenizer
    ids = tok.encode(MULTIBYTE, add_special_tokens=False).ids
    # The text really is split inside characters: some single tokens decode to U+FFFD.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    deltas = _stream(tok, ids, [1] * len(ids))
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE


def test_byte_fallback_character_is_held_until_complete(tokenizers):
    tok = tokenizers[TINY].tokenizer
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["", "", "", ""]  # held: the byte run may continue
    word = tok.encode("ok", add_special_tokens=False).ids
    assert detok.add(word) == tok.decode(ids + word) == "😀 ok"


@pytest.mark.parametrize(("model_name", "expected"), [
    (SMOL, ["Hello", " world", ",", " how", " are", " you"]),
    # SentencePiece: the decoder strips one leading space of what it decodes; the
    # window keeps the spaces between words, and the first word has none (as decode).
    (TINY, None),
])
def test_leading_spaces_are_kept(tokenizers, model_name, expected):
    tok = tokenizers[model_name].tokenizer
    text = "Hello world, how are you"
    ids = tok.encode(text, add_special_tokens=False).ids
    deltas = [d for d in _stream(tok, ids, [1] * len(ids)) if d]
    assert "".join(deltas) == text == tok.decode(ids)
    if expected is not None:
        assert deltas == expected
    assert any(d.startswith(" ") for d in deltas)


# (a special token to open the stream, EOS to close it) per model
SPECIAL = {SMOL: (1, 2), TINY: (0, 1)}  # SmolLM2: <|im_start|>, <|im_end|>; DeepSeek: BOS, EOS


@pytest.mark.parametrize("name", [SMOL, TINY])
def test_special_tokens_skipped_or_kept(tokenizers, name):
    tok = tokenizers[name].tokenizer
    first, eos = SPECIAL[name]
    ids = [first, *tok.encode("Paris.", add_special_tokens=False).ids, eos]
    assert "".join(_stream(tok, ids, [1] * len(ids), skip=True)) == "Paris."
    kept = "".join(_stream(tok, ids, [1] * len(ids), skip=False))
    assert kept == tok.decode(ids, skip_special_tokens=False)
    assert "Paris." in kept and kept.endswith(tok.decode([eos], skip_special_tokens=False))
    if name == SMOL:
        assert kept == "<|im_start|>Paris.<|im_end|>"


@pytest.mark.parametrize("name", [SMOL, TINY])
def test_empty_stream_and_very_long_stream(tokenizers, name):
    tok = tokenizers[name].tokenizer
    detok = IncrementalDetokenizer(tok)
    assert detok.add([]) == "" and detok.flush() == ""
    text = ("The quick brown fox 跳过 the lazy dog 🐕. " * 300).strip()
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > 4000
    deltas = _stream(tok, ids, [3] * (len(ids) // 3 + 1))
    assert "".join(deltas) == tok.decode(ids) == text


class _CountingTokenizer:
    """A tokenizer that counts its decode calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", [SMOL, TINY])
@pytest.mark.parametrize("text", [
    "The ledger of branch 7 must balance, and stay balanced. " * 4,
    "Ledgers 跳过 😀 balance. " * 4,  # characters split over tokens: windows of several
])
def test_one_token_at_a_time_decodes_once_per_token_with_a_shared_table(tokenizers, name, text):
    model = tokenizers[name]
    ids = model.tokenizer.encode(text, add_special_tokens=False).ids
    table: dict[int, str] = {}
    counted = _CountingTokenizer(model.tokenizer)

    def stream() -> tuple[str, int]:
        counted.decodes = 0
        detok = IncrementalDetokenizer(
            counted, byte_token_ids=byte_fallback_ids(model.tokenizer),  # type: ignore[arg-type]
            special_token_ids=model.special_ids, token_texts=table,
        )
        return "".join(detok.add([i]) for i in ids) + detok.flush(), counted.decodes

    cold_text, cold = stream()
    warm_text, warm = stream()  # a second stream finds the table warm
    assert cold_text == warm_text == model.tokenizer.decode(ids)
    assert table == {i: model.tokenizer.decode([i]) for i in table}
    assert warm < cold
    if text.isascii():  # every token a whole piece: one window decode per token, no more
        assert cold <= len(ids) + len(set(ids)) + 1
        assert warm <= len(ids) + 1


def _each_property(model_name):
    """``add_each`` releases, delta by delta, exactly what adding the delta's tokens one at
    a time releases (same text, never later), over deltas of any size, hard tokens
    included, up to and past the hold limit."""
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def check(tokenizers, data):
        model = tokenizers[model_name]
        token = st.one_of(st.integers(0, model.vocab_size - 1), st.sampled_from(_interesting_ids(model)))
        ids = data.draw(st.lists(token, max_size=64), label="ids")
        chunks = data.draw(st.lists(st.integers(1, 8), max_size=64), label="chunks")
        skip = data.draw(st.booleans(), label="skip_special_tokens")
        held = data.draw(st.sampled_from([4, 64]), label="max_held_tokens")
        whole = IncrementalDetokenizer(model.tokenizer, skip_special_tokens=skip, max_held_tokens=held)
        single = IncrementalDetokenizer(model.tokenizer, skip_special_tokens=skip, max_held_tokens=held)
        pos = 0
        out: list[str] = []
        single_out: list[str] = []
        for size in [*chunks, len(ids)]:
            chunk = ids[pos:pos + size]
            if not chunk:
                break
            released = whole.add_each(chunk)
            single_out.append("".join(single.add([t]) for t in chunk))
            assert released == single_out[-1], (pos, chunk)
            assert whole.held_tokens == single.held_tokens, (pos, chunk)
            out.append(released)
            pos += size
        text = "".join(out) + whole.flush()
        assert text == "".join(single_out) + single.flush()
        if held == 64:  # never passed here: nothing is cut, the text is the decode
            assert text == model.tokenizer.decode(ids, skip_special_tokens=skip)

    return check


test_add_each_releases_as_token_by_token_byte_level_bpe = _each_property(SMOL)
test_add_each_releases_as_token_by_token_sentencepiece = _each_property(TINY)


@pytest.mark.parametrize("name", [SMOL, TINY])
def test_add_each_decodes_a_complete_delta_once(tokenizers, name):
    model = tokenizers[name]
    ids = model.tokenizer.encode("The ledger of branch 7 must balance, and stay balanced. " * 4,
                                 add_special_tokens=False).ids
    counted = _CountingTokenizer(model.tokenizer)
    detok = IncrementalDetokenizer(
        counted, byte_token_ids=byte_fallback_ids(model.tokenizer),  # type: ignore[arg-type]
        special_token_ids=model.special_ids, token_texts={},
    )
    deltas = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    text = "".join(detok.add_each(delta) for delta in deltas) + detok.flush()
    assert text == model.tokenizer.decode(ids)
    # Two windows per delta (the text already out, then with the new tokens), not one per token.
    assert counted.decodes <= 2 * len(deltas) + 1 < len(ids)

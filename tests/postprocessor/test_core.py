"""PostprocessSession: stop strings, filter and skip_chars on real token streams."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument, NotFound
from services.postprocessor.core import (
    FinishReason,
    Limits,
    PostprocessCore,
    SessionConfig,
    StopStringMatcher,
    UpstreamFinish,
)
from services.postprocessor.sensitive import FilterMode, SensitiveDataFilter
from tests.postprocessor.conftest import SMOL, TINY


@pytest.fixture(scope="module")
def core(tokenizers):
    return PostprocessCore(tokenizers, limits=Limits(max_stop_strings=3, max_stop_chars=20,
                                                     max_tokens_per_stream=10_000))


def _ids(core, model, text):
    return core.models[model].tokenizer.encode(text, add_special_tokens=False).ids


def _run(core, config, ids, chunks=None, upstream=UpstreamFinish.STOP):
    """Feed ``ids`` in ``chunks``; return (concatenated text, final, deltas)."""
    session = core.open(config)
    chunks = chunks or [1] * len(ids)
    deltas, pos = [], 0
    for size in [*chunks, len(ids)]:
        if pos >= len(ids):
            break
        step = session.feed(ids[pos:pos + size])
        pos += size
        deltas.append(step.text)
        if step.final is not None:
            return "".join(deltas), step.final, deltas
    step = session.end(upstream)
    deltas.append(step.text)
    assert step.final is not None
    return "".join(deltas), step.final, deltas


def test_stop_matcher_holds_possible_beginnings():
    m = StopStringMatcher(["###", "END"])
    assert m.feed("abc #") == "abc "
    assert m.feed("#") == ""
    assert m.feed(" x E") == "## x "
    assert m.feed("N") == ""
    assert m.feed("D tail") == "" and m.matched == "END"
    inc = StopStringMatcher(["END"], include_stop=True)
    assert inc.feed("abEN") == "ab" and inc.feed("Dzz") == "END"


@pytest.mark.parametrize("model", [SMOL, TINY])
def test_stop_string_spanning_tokens_and_chunks(core, model):
    text = "Hello world. The answer is: forty-two. Then more text follows here."
    ids = _ids(core, model, text)
    stop = "forty-two"
    # The stop string is not one token: it is split over several.
    assert stop not in [core.models[model].tokenizer.decode([i]) for i in ids]
    for chunks in ([1], [2], [3, 1, 4], [len(ids)]):
        out, final, _ = _run(core, SessionConfig(model=model, stop=(stop,), filter_mode=FilterMode.OFF),
                             ids, chunks * len(ids))
        assert out == "Hello world. The answer is: "
        assert final.finish_reason is FinishReason.STOP and final.matched_stop == stop
        # completion_tokens: exactly up to the token that completed the stop string.
        prefix_tokens = final.completion_tokens
        assert stop in core.models[model].tokenizer.decode(ids[:prefix_tokens])
        assert stop not in core.models[model].tokenizer.decode(ids[:prefix_tokens - 1])


def test_include_stop_str_and_earliest_stop_wins(core):
    ids = _ids(core, SMOL, "alpha beta gamma delta")
    config = SessionConfig(model=SMOL, stop=("delta", "beta"), include_stop_str_in_output=True,
                           filter_mode=FilterMode.OFF)
    out, final, _ = _run(core, config, ids)
    assert out == "alpha beta" and final.matched_stop == "beta"


def test_held_stop_prefix_is_released_at_end(core):
    ids = _ids(core, SMOL, "the end is near ST")
    out, final, _ = _run(core, SessionConfig(model=SMOL, stop=("STOP",), filter_mode=FilterMode.OFF), ids,
                         upstream=UpstreamFinish.LENGTH)
    assert out == "the end is near ST"
    assert final.finish_reason is FinishReason.LENGTH and final.matched_stop == ""
    assert final.completion_tokens == len(ids)


@pytest.mark.parametrize(("upstream", "reason"), [
    (UpstreamFinish.STOP, FinishReason.STOP),
    (UpstreamFinish.LENGTH, FinishReason.LENGTH),
    (UpstreamFinish.ABORT, FinishReason.CANCELLED),
    (UpstreamFinish.ERROR, FinishReason.ERROR),
    (UpstreamFinish.UNSPECIFIED, FinishReason.STOP),
])
def test_finish_reason_mapping(core, upstream, reason):
    _, final, _ = _run(core, SessionConfig(model=TINY), _ids(core, TINY, "hi"), upstream=upstream)
    assert final.finish_reason is reason


def test_empty_stream(core):
    out, final, deltas = _run(core, SessionConfig(), [])
    assert out == "" and deltas == [""]
    assert final.finish_reason is FinishReason.STOP and final.completion_tokens == 0


@pytest.mark.parametrize("model", [SMOL, TINY])
def test_very_long_stream(core, model):
    text = ("Paris is the capital of France; 巴黎是法国的首都。 " * 200).strip()
    ids = _ids(core, model, text)
    assert len(ids) > 3000
    out, final, deltas = _run(core, SessionConfig(model=model, stop=("never",)), ids, [7] * len(ids))
    assert out == text and final.completion_tokens == len(ids)
    assert len([d for d in deltas if d]) > 100  # streamed, not buffered until the end


@pytest.mark.parametrize("model", [SMOL, TINY])
def test_redaction_across_token_boundaries(core, model):
    text = "My card is 4111 1111 1111 1111 and my mail is jane.doe@example.com, bye."
    ids = _ids(core, model, text)
    out, final, deltas = _run(core, SessionConfig(model=model, filter_mode=FilterMode.REDACT), ids)
    assert out == "My card is [REDACTED:card] and my mail is [REDACTED:email], bye."
    assert final.redactions == 2
    assert not any("4111" in d or "jane" in d for d in deltas)


def test_block_ends_the_stream_with_content_filter(core):
    text = "Call me at +44 20 7946 0958 tomorrow, and then lots more text."
    ids = _ids(core, SMOL, text)
    out, final, _ = _run(core, SessionConfig(model=SMOL, filter_mode=FilterMode.BLOCK), ids)
    assert out == "Call me at "
    assert final.finish_reason is FinishReason.CONTENT_FILTER
    assert final.redactions == 1
    assert final.completion_tokens < len(ids)


def test_default_filter_mode_applies_when_unspecified(tokenizers):
    ids = tokenizers[SMOL].tokenizer.encode("card 4111111111111111 ok", add_special_tokens=False).ids
    redacting = PostprocessCore(tokenizers)  # default: redact
    assert _run(redacting, SessionConfig(), ids)[0] == "card [REDACTED:card] ok"
    assert _run(redacting, SessionConfig(filter_mode=FilterMode.OFF), ids)[0] == "card 4111111111111111 ok"
    passing = PostprocessCore(tokenizers, default_filter_mode=FilterMode.OFF)
    assert _run(passing, SessionConfig(), ids)[0] == "card 4111111111111111 ok"


@settings(max_examples=60, deadline=None)
@given(skip=st.integers(0, 80), chunk=st.integers(1, 5))
def test_skip_chars_suppresses_exactly_what_was_delivered(tokenizers, skip, chunk):
    core = PostprocessCore(tokenizers)
    text = "Replay: 你好 😀 card 4111 1111 1111 1111, stop here: END and never this."
    ids = tokenizers[TINY].tokenizer.encode(text, add_special_tokens=False).ids
    config = SessionConfig(model=TINY, stop=("END",))
    full, final_full, _ = _run(core, config, ids, [chunk] * len(ids))
    replay, final_replay, _ = _run(core, SessionConfig(model=TINY, stop=("END",), skip_chars=skip), ids,
                                   [chunk] * len(ids))
    assert full == "Replay: 你好 😀 card [REDACTED:card], stop here: "
    assert replay == full[skip:]
    assert final_replay == final_full


@pytest.mark.parametrize(("model", "eos"), [(SMOL, 2), (TINY, 1)])
def test_special_tokens_in_stream(core, model, eos):
    ids = [*_ids(core, model, "Paris."), eos]
    assert _run(core, SessionConfig(model=model), ids)[0] == "Paris."
    # Kept, the EOS token's text can itself be a stop string (DeepSeek's decodes with
    # spaces for its ▁ marks, so the stop is taken from the tokenizer, not spelled here).
    eos_text = core.models[model].tokenizer.decode([eos], skip_special_tokens=False)
    kept = _run(core, SessionConfig(model=model, skip_special_tokens=False, stop=(eos_text,)), ids)
    assert kept[0] == "Paris." and kept[1].matched_stop == eos_text


@pytest.mark.parametrize(("model", "eos"), [(SMOL, 2), (TINY, 1)])
def test_streams_share_single_token_texts_per_model_and_special_token_setting(tokenizers, model, eos):
    core = PostprocessCore(tokenizers, default_filter_mode=FilterMode.OFF)
    tok = core.models[model].tokenizer
    # A special token mid-stream: its text is empty when skipped and not when kept, so
    # one table for both settings would give the kept stream the wrong window.
    ids = [*_ids(core, model, "Paris."), eos, *_ids(core, model, " Then Rome.")]
    for skip in (True, False, True, False):  # each setting's table warm the second time
        text = _run(core, SessionConfig(model=model, skip_special_tokens=skip), ids)[0]
        assert text == tok.decode(ids, skip_special_tokens=skip)
    skipping = core.open(SessionConfig(model=model)).detokenizer.token_texts
    assert skipping is core.open(SessionConfig(model=model)).detokenizer.token_texts
    kept = core.open(SessionConfig(model=model, skip_special_tokens=False)).detokenizer.token_texts
    assert kept is not skipping
    assert kept[eos] == tok.decode([eos], skip_special_tokens=False) != ""
    assert skipping == {i: tok.decode([i], skip_special_tokens=True) for i in skipping}
    assert kept == {i: tok.decode([i], skip_special_tokens=False) for i in kept}


def test_validation_names_fields(core):
    with pytest.raises(NotFound, match=r"config\.model"):
        core.open(SessionConfig(model="nope"))
    for config, field in [
        (SessionConfig(stop=("a", "b", "c", "d")), "config.stop"),
        (SessionConfig(stop=("ok", "")), "config.stop[1]"),
        (SessionConfig(stop=("x" * 21,)), "config.stop[0]"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            core.open(config)
        assert err.value.field == field
    session = core.open(SessionConfig(model=TINY))
    with pytest.raises(InvalidArgument) as err:
        session.feed([5, 4096])
    assert err.value.field == "tokens.token_ids[1]"
    with pytest.raises(InvalidArgument) as err:
        session.feed([5] * 10_001)
    assert err.value.field == "tokens.token_ids"


_PIECES = ["Hello", " world", ", ", "你好", "😀", " card 4111 1111 1111 1111", " mail a.b@example.com",
           " STOP", "ST", "OP", "\n\n", " +44 20 7946 0958", " done."]


def _one_shot(text, stops, include, mode):
    """The reference: stop strings and the filter applied to the whole decoded text at once."""
    found = [(text.find(stop), -len(stop), stop) for stop in stops if stop in text]
    matched = ""
    if found:
        at, _, matched = min(found)
        text = text[:at + len(matched)] if include else text[:at]
    f = SensitiveDataFilter(mode)
    out = f.feed(text, final=True)
    reason = FinishReason.CONTENT_FILTER if f.blocked else FinishReason.STOP
    return out, reason, matched


@settings(max_examples=80, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_PIECES), max_size=14),
    chunk=st.lists(st.integers(1, 6), min_size=1, max_size=30),
    model=st.sampled_from([SMOL, TINY]),
    mode=st.sampled_from(list(FilterMode)),
    include=st.booleans(),
)
def test_streamed_pipeline_equals_one_shot_on_the_decoded_text(tokenizers, pieces, chunk, model, mode,
                                                                include):
    """Token by token, the session releases what stops + filter give on the whole text."""
    core = PostprocessCore(tokenizers)
    tok = tokenizers[model].tokenizer
    ids = tok.encode("".join(pieces), add_special_tokens=False).ids
    stops = ("STOP", "\n\n")
    config = SessionConfig(model=model, stop=stops, include_stop_str_in_output=include, filter_mode=mode)
    chunks = (chunk * (len(ids) // len(chunk) + 1))[:len(ids)]
    streamed, final, _ = _run(core, config, ids, chunks)
    expected, reason, matched = _one_shot(tok.decode(ids), stops, include, mode)
    assert streamed == expected
    assert final.finish_reason is reason
    if reason is FinishReason.STOP:
        assert final.matched_stop == matched


def test_redaction_callback_reports_each_kind_once(tokenizers):
    reported: list[str] = []
    core = PostprocessCore(tokenizers, on_redaction=reported.append)
    text = "a 4111 1111 1111 1111 b x@example.com c 5500 0055 5555 5559 d +44 20 7946 0958 e."
    ids = tokenizers[SMOL].tokenizer.encode(text, add_special_tokens=False).ids
    _, final, _ = _run(core, SessionConfig(model=SMOL), ids)
    assert sorted(reported) == ["card", "card", "email", "phone"]
    assert final.redactions == 4


@pytest.mark.parametrize("model", [SMOL, TINY])
@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("skip", [0, 9])
def test_a_plain_stream_releases_each_delta_as_token_by_token(tokenizers, model, chunk, skip):
    """No stop strings and no filter (the mesh's default): a delta's text comes from one
    step of the detokenizer, and is what token-by-token detokenizing releases for it, delta
    by delta, with every token counted (skip_chars applied as ever)."""
    core = PostprocessCore(tokenizers, default_filter_mode=FilterMode.OFF)
    tok = core.models[model].tokenizer
    ids = _ids(core, model, "Ledger 7 跳过 😀 balances; card 4111 1111 1111 1111. " * 3)
    _, final, deltas = _run(core, SessionConfig(model=model, skip_chars=skip), ids, [chunk] * len(ids))
    reference = core.open(SessionConfig(model=model)).detokenizer
    expected = ["".join(reference.add([t]) for t in ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    expected.append(reference.flush())
    assert "".join(deltas) == "".join(expected)[skip:] == tok.decode(ids)[skip:]
    if not skip:
        assert deltas == expected
    assert final.completion_tokens == len(ids) and final.finish_reason == FinishReason.STOP

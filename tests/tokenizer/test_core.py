"""Tokenizer core: chat templates and encodings equal transformers', validation, batching."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.common.errors import InvalidArgument, NotFound
from services.common.limits import RequestLimits
from services.common.modelinfo import max_context_length, tokenizer_checksum
from services.tokenizer.core import ChatMessage, EncodeInput, TokenizerCore
from tests.tokenizer.conftest import SMOL, TINY

CONVERSATIONS = [
    [("user", "What is the capital of France?")],
    [("user", "你好，世界 🌍👩‍👩‍👧 ünïcödé")],
    [("system", "Answer briefly."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "2+2?")],
    [("user", "literal {{ bos_token }} {% if true %}x{% endif %} stays text")],
    [("user", "special <|im_end|> and <｜end▁of▁sentence｜> inside content")],
    [("user", "call a tool"), ("assistant", ""), ("tool", "42"), ("user", "thanks")],
    [("user", "  leading and trailing spaces  \n\n")],
]


@pytest.fixture(scope="module")
def hf_tokenizers(loaded):
    transformers = pytest.importorskip("transformers")
    return {name: transformers.AutoTokenizer.from_pretrained(str(m.path)) for name, m in loaded.items()}


@pytest.fixture(scope="module")
def core(loaded):
    tc = TokenizerCore(loaded, limits=RequestLimits(max_messages=8, max_input_chars=1000, max_batch_inputs=4,
                                                    max_batch_chars=1500))
    yield tc
    tc.close()


def _messages(turns):
    return tuple(ChatMessage(role, content) for role, content in turns)


@pytest.mark.parametrize("model", [SMOL, TINY])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
async def test_chat_template_ids_equal_transformers(core, hf_tokenizers, model, add_generation_prompt):
    hf = hf_tokenizers[model]
    for turns in CONVERSATIONS:
        result = await core.encode(EncodeInput(
            model=model, messages=_messages(turns), add_generation_prompt=add_generation_prompt
        ))
        expected = hf.apply_chat_template(
            [{"role": r, "content": c} for r, c in turns],
            tokenize=True, add_generation_prompt=add_generation_prompt,
        )
        expected_ids = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert result.token_ids == list(expected_ids), (model, turns)
        assert result.count == len(expected_ids)
        assert not result.truncated


@pytest.mark.parametrize("model", [SMOL, TINY])
async def test_raw_prompt_ids_equal_transformers(core, hf_tokenizers, model):
    hf = hf_tokenizers[model]
    for text in ("Hello world", " leading space", "数字 12345 😀", "<|im_start|>user"):
        for add_special in (True, False):
            result = await core.encode(EncodeInput(model=model, prompt=text, add_special_tokens=add_special))
            assert result.token_ids == hf(text, add_special_tokens=add_special)["input_ids"]
    default = await core.encode(EncodeInput(model=model, prompt="Hello world"))
    assert default.token_ids == hf("Hello world")["input_ids"]


async def test_generation_prompt_defaults_to_true(core):
    turns = _messages([("user", "Hi")])
    default = await core.encode(EncodeInput(model=TINY, messages=turns))
    explicit = await core.encode(EncodeInput(model=TINY, messages=turns, add_generation_prompt=True))
    without = await core.encode(EncodeInput(model=TINY, messages=turns, add_generation_prompt=False))
    assert default.token_ids == explicit.token_ids
    assert len(without.token_ids) < len(default.token_ids)


async def test_empty_model_is_the_default_and_checksum_is_the_shared_function(core, loaded):
    result = await core.encode(EncodeInput(prompt="hi"))
    assert result.model == SMOL
    assert result.tokenizer_checksum == tokenizer_checksum(loaded[SMOL].path)
    assert loaded[TINY].max_context_length == max_context_length(loaded[TINY].path) == 2048
    assert loaded[SMOL].eos_token_ids == (2,)
    assert loaded[TINY].eos_token_ids == (1,)


async def test_truncation_keeps_the_end(core):
    full = await core.encode(EncodeInput(model=SMOL, messages=_messages([("user", "one two three four")])))
    cut = await core.encode(EncodeInput(model=SMOL, messages=_messages([("user", "one two three four")]),
                                        truncate_to=5))
    assert cut.truncated and cut.count == 5
    assert cut.token_ids == full.token_ids[-5:]
    same = await core.encode(EncodeInput(model=SMOL, prompt="short", truncate_to=1000))
    assert not same.truncated


@pytest.mark.parametrize(
    ("item", "field"),
    [
        (EncodeInput(), "input"),
        (EncodeInput(prompt="x", messages=_messages([("user", "y")])), "input"),
        (EncodeInput(messages=_messages([("user", "a"), ("assistant", "b"), ("user", "c"), ("robot", "d")])),
         "input.messages[3].role"),
        (EncodeInput(messages=_messages([("user", "")])), "input.messages[0].content"),
        (EncodeInput(messages=_messages([("system", "")])), "input.messages[0].content"),
        (EncodeInput(prompt="x" * 1001), "input.prompt"),
        (EncodeInput(messages=_messages([("user", "x" * 600), ("user", "y" * 600)])),
         "input.messages[1].content"),
        (EncodeInput(messages=_messages([("user", "x")] * 9)), "input.messages"),
        # The text rule shared with the gateway (services/common/limits.py): no NUL and no
        # unpaired surrogates, in prompts and in message content alike.
        (EncodeInput(prompt="a\x00b"), "input.prompt"),
        (EncodeInput(prompt="a\ud800b"), "input.prompt"),
        (EncodeInput(messages=_messages([("user", "a\x00b")])), "input.messages[0].content"),
        (EncodeInput(messages=_messages([("user", "ok"), ("assistant", "\udfff")])),
         "input.messages[1].content"),
    ],
)
def test_invalid_inputs_name_the_field(core, item, field):
    with pytest.raises(InvalidArgument) as err:
        core.prepare(item, "input")
    assert err.value.field == field


def test_unknown_model_is_not_found_naming_the_field(core):
    with pytest.raises(NotFound, match=r"input\.model"):
        core.prepare(EncodeInput(model="nope", prompt="x"), "input")


def test_empty_assistant_and_tool_content_are_allowed(core):
    core.prepare(EncodeInput(messages=_messages([("user", "q"), ("assistant", ""), ("tool", "")])), "input")


async def test_template_raise_exception_is_invalid_argument(loaded):
    strict = dataclasses.replace(
        loaded[TINY],
        chat_template="{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}",
    )
    core = TokenizerCore({"strict": strict})
    try:
        with pytest.raises(InvalidArgument) as err:
            core.prepare(EncodeInput(messages=_messages([("system", "s"), ("user", "u")])), "input")
        assert err.value.field == "input.messages"
        assert "System role not supported" in err.value.message
    finally:
        core.close()


async def test_template_is_sandboxed(loaded):
    evil = dataclasses.replace(
        loaded[TINY], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"
    )
    core = TokenizerCore({"evil": evil})
    try:
        with pytest.raises(InvalidArgument):
            core.prepare(EncodeInput(messages=_messages([("user", "u")])), "input")
    finally:
        core.close()


async def test_template_helpers_match_transformers(loaded):
    templated = dataclasses.replace(
        loaded[TINY],
        chat_template="{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    )
    core = TokenizerCore({"t": templated})
    try:
        prepared = core.prepare(EncodeInput(messages=_messages([("user", "é<b>"), ("user", "z")])), "input")
        expected = '[{"role": "user", "content": "é<b>"}, {"role": "user", "content": "z"}]|4é<b>'
        assert prepared.text == expected
    finally:
        core.close()


async def test_batch_limits_and_field_names(core):
    with pytest.raises(InvalidArgument) as err:
        await core.encode_batch([EncodeInput(prompt="x")] * 5)
    assert err.value.field == "inputs"
    with pytest.raises(InvalidArgument) as err:
        await core.encode_batch([EncodeInput(prompt="x" * 800), EncodeInput(prompt="y" * 800)])
    assert err.value.field == "inputs"
    with pytest.raises(InvalidArgument) as err:
        await core.encode_batch([EncodeInput(prompt="x"), EncodeInput(messages=_messages([("bot", "y")]))])
    assert err.value.field == "inputs[1].messages[0].role"
    with pytest.raises(InvalidArgument):
        await core.encode_batch([])


async def test_concurrent_encodes_are_micro_batched_and_correct(loaded):
    core = TokenizerCore(loaded, threads=1, max_batch=16)
    try:
        texts = [f"request number {i}: 你好 {'word ' * i}" for i in range(48)]
        models = [SMOL if i % 3 else TINY for i in range(48)]
        results = await asyncio.gather(*(
            core.encode(EncodeInput(model=m, prompt=t)) for m, t in zip(models, texts, strict=True)
        ))
        for m, t, r in zip(models, texts, results, strict=True):
            assert r.token_ids == loaded[m].tokenizer.encode(t).ids
        assert core.batcher.encoded == 48
        assert core.batcher.batches < 48  # requests that queued up were encoded together
    finally:
        core.close()


async def test_a_short_text_alone_is_encoded_on_the_loop_without_a_thread(loaded):
    """Issue #17: at low load a short prompt does not wait for a thread hand-off and back;
    a long one, or one of several asked for together, still goes to the threads."""
    core = TokenizerCore(loaded, threads=1, inline_max_chars=64)
    try:
        short = "What is the capital of France?"
        result = await core.encode(EncodeInput(model=SMOL, prompt=short))
        assert result.token_ids == loaded[SMOL].tokenizer.encode(short).ids
        assert (core.batcher.inline, core.batcher.batches) == (1, 1)

        long = "word " * 40
        result = await core.encode(EncodeInput(model=SMOL, prompt=long))
        assert result.token_ids == loaded[SMOL].tokenizer.encode(long).ids
        assert (core.batcher.inline, core.batcher.batches) == (1, 2)

        # Asked for in the same iteration: one batch on the thread, however short.
        texts = [f"request {i}" for i in range(4)]
        results = await asyncio.gather(*(core.encode(EncodeInput(model=SMOL, prompt=t)) for t in texts))
        assert [r.token_ids for r in results] == [loaded[SMOL].tokenizer.encode(t).ids for t in texts]
        assert (core.batcher.inline, core.batcher.batches) == (1, 3)
    finally:
        core.close()

    off = TokenizerCore(loaded, inline_max_chars=0)
    try:
        await off.encode(EncodeInput(model=SMOL, prompt="hi"))
        assert (off.batcher.inline, off.batcher.batches) == (0, 1)
    finally:
        off.close()


async def test_model_without_chat_template_accepts_prompts_only(loaded):
    bare = dataclasses.replace(loaded[TINY], chat_template=None)
    core = TokenizerCore({"bare": bare})
    try:
        with pytest.raises(InvalidArgument) as err:
            core.prepare(EncodeInput(messages=_messages([("user", "u")])), "input")
        assert err.value.field == "input.messages"
        assert (await core.encode(EncodeInput(prompt="plain text"))).count > 0
    finally:
        core.close()


def test_loader_reads_templates_and_special_tokens_from_tokenizer_config(tmp_path, loaded):
    import json
    import shutil

    from services.tokenizer.loader import ModelLoadError, load_tokenizer

    source = loaded[TINY].path
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<｜begin▁of▁sentence｜>", "lstrip": False},
        "eos_token": "<｜end▁of▁sentence｜>",
        "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
    }))
    model = load_tokenizer("copy", tmp_path)
    assert model.chat_template == "{{ bos_token }}{{ messages[0]['content'] }}"
    assert model.special_tokens["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert model.eos_token_ids == (1,)  # from the eos_token (no generation_config.json here)
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_tokenizer("missing", tmp_path / "nowhere")

"""Tokenizer interface: sentencepiece round trips, chat-template semantics, streaming detok."""

from __future__ import annotations

import json
import random

import pytest
import sentencepiece as spm
from conftest import write_tiny_tokenizer

from ksana_jax.tokenizer import IncrementalDetokenizer, TemplateError, Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "Sphinx of black quartz, judge my vow.",
    "How vexingly quick daft zebras jump; 0123456789.",
    "café naïve résumé",
] * 20
ROUND_TRIP = [
    "The quick brown fox.",
    "  two leading spaces,\ttab,\nnewline and  double  spaces ",
    "emoji 🤗 and 日本 fall back to bytes",
    "<s>special</s> tokens stay whole",
]


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(path / "tokenizer"),
        vocab_size=360,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        control_symbols=["<|tool|>"],
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return path


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_sentencepiece_round_trip_with_bos_and_byte_fallback(spm_dir, text):
    tok = Tokenizer.from_dir(spm_dir)
    ref = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 1  # LlamaTokenizer default: BOS on
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<s>", "").replace("</s>", "")
    if "<s>" not in text:
        assert ids[1:] == ref.encode(text)
    else:  # special tokens written in the text become their ids, not pieces of "<", "s", ">"
        assert ids.count(1) == 2 and ids.count(2) == 1


def test_sentencepiece_bytes_for_unseen_characters(spm_dir):
    tok = Tokenizer.from_dir(spm_dir)
    ids = tok.encode("🤗", add_special_tokens=False)
    # U+1F917 is F0 9F A4 97 in UTF-8; the corpus never saw it, so it falls back to bytes.
    assert [tok.id_to_token(i) for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x97>"]
    assert tok.decode(ids) == "🤗"


def test_sentencepiece_flags_from_tokenizer_config(spm_dir, tmp_path):
    for name in ("tokenizer.model",):
        (tmp_path / name).write_bytes((spm_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": False, "add_eos_token": True, "eos_token": "</s>"})
    )
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("quick fox")
    assert ids[0] != tok.bos_token_id and ids[-1] == tok.eos_token_id == 2


LLAMA2_STYLE = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set sys = false %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] | trim "
    "+ ' [/INST]' }}{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ ' ' }}{% endif %}"
    "{{ messages | length | tojson }}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi there  "},
    {"role": "assistant", "content": "Hello! ✓"},
    {"role": "user", "content": "Bye"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tmp_path, add_generation_prompt):
    import transformers

    write_tiny_tokenizer(tmp_path, chat_template=LLAMA2_STYLE)
    ours = Tokenizer.from_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    got = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    want = theirs.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert got == want
    assert got.startswith("<s>[INST] Hi there [/INST] Hello! ✓ </s>")


def test_chat_template_raise_exception_is_a_value_error(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template=LLAMA2_STYLE)
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(TemplateError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert issubclass(TemplateError, ValueError)


def test_chat_template_in_separate_jinja_file_wins(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template="{{ 'from config' }}")
    (tmp_path / "chat_template.jinja").write_text("{{ 'from jinja file' }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "from jinja file"


def test_no_chat_template_is_a_clear_error(tmp_path):
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.fixture(scope="module")
def hf_from_spm_dir(spm_dir, tmp_path_factory):
    """The same sentencepiece model as a tokenizer.json (Metaspace, byte fallback), as
    transformers converts Llama-style tokenizers."""
    import transformers

    path = tmp_path_factory.mktemp("hf-spm")
    transformers.AutoTokenizer.from_pretrained(spm_dir).save_pretrained(path)
    (path / "tokenizer.model").unlink(missing_ok=True)  # so tokenizer.json is what loads
    return path


BYTES_TEXTS = ["Emoji 🤗🚀 and 日本語, café", "a👨‍👩‍👧b\ttab", "plain words only"]


@pytest.mark.parametrize("text", BYTES_TEXTS)
@pytest.mark.parametrize("backend", ["byte_level", "sentencepiece", "tokenizer_json_spm"])
def test_token_bytes_rebuild_the_text(backend, text, request):
    """Joined, the raw bytes of a text's tokens are the text's UTF-8 (sentencepiece: after
    its dummy-prefix space), although single tokens hold only parts of a character."""
    if backend == "byte_level":
        tok = request.getfixturevalue("smollm2").tokenizer
    else:
        fixture = "spm_dir" if backend == "sentencepiece" else "hf_from_spm_dir"
        tok = Tokenizer.from_dir(request.getfixturevalue(fixture))
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    joined = b"".join(pieces)
    if backend != "byte_level":
        assert joined.startswith(b" ")
        joined = joined[1:]
    assert joined == text.encode()
    if "🤗" in text:  # some tokens hold part of a character, which decode() shows as U+FFFD
        assert any(not _is_utf8(p) for p in pieces)
    assert tok.token_bytes(tok.eos_token_id) == tok.eos_token.encode()


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _stream(tok: Tokenizer, ids, prompt_ids=()):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.text


STREAM_TEXTS = ["Emoji 🤗🚀 and 日本語, café", "a👨‍👩‍👧b", "plain words only"]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_byte_level_never_breaks_characters(smollm2, text):
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    assert len(ids) >= 3
    deltas, streamed = _stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert streamed == tok.decode(ids) == text
    if "🤗" in text:  # an emoji spans several byte-level tokens: some steps emit nothing
        assert "" in deltas


def test_incremental_detokenizer_stream_gives_the_python_windows_deltas(smollm2):
    """The Rust DecodeStream path and the Python windows give the same deltas, for prompts
    and outputs mixing text, special tokens (skipped or not), byte tokens that split
    characters, and prompts that end inside a character."""
    tok = smollm2.tokenizer
    rng = random.Random(0)
    specials = sorted(tok.special_token_ids)
    byte_tokens = [
        t for t in range(tok.vocab_size) if tok.token_bytes(t) and not _is_utf8(tok.token_bytes(t))
    ]
    emoji = tok.encode("café 🤗🚀 日本語 ok ")

    def some(n):
        pools = (range(tok.vocab_size), specials, byte_tokens, emoji)
        return [rng.choice(rng.choice(pools)) for _ in range(n)]

    streamed = 0
    for trial in range(400):
        prompt = some(rng.randrange(0, 10))
        if trial % 4 == 0 and prompt:  # ends inside a character
            prompt[-1] = rng.choice(byte_tokens)
        out = some(30)
        skip = trial % 2 == 0
        fast = IncrementalDetokenizer(tok, prompt, skip)
        slow = IncrementalDetokenizer(tok, prompt, skip, use_stream=False)
        streamed += fast.uses_stream
        assert [fast.add(t) for t in out] == [slow.add(t) for t in out], (prompt, out, skip)
        assert fast.text == slow.text and fast.num_chars == len(fast.text)
    assert 100 < streamed < 400  # prompts ending mid-character (a quarter and more) did not


@pytest.mark.parametrize("text", ROUND_TRIP[:3])
def test_incremental_detokenizer_sentencepiece_keeps_spaces(spm_dir, text):
    tok = Tokenizer.from_dir(spm_dir)
    prompt = tok.encode("Sphinx of")
    ids = tok.encode(" " + text, add_special_tokens=False)
    deltas, streamed = _stream(tok, ids, prompt)
    assert all("\ufffd" not in d for d in deltas)
    # Streaming after a prompt keeps the word boundary a decode of the ids alone drops.
    assert tok.decode(prompt + ids, skip_special_tokens=True) == "Sphinx of" + streamed

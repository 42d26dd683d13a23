"""Structured output in the engine, on a tiny random model with a byte-level BPE tokenizer
(smaller than the model's vocabulary, so padding ids exist): constrained greedy equals a
brute-force masked rollout, answers satisfy their constraint and finish with "stop", rows
with and without constraints share one batch without recompiling, async scheduling gives
the same tokens, and bad constraints are ValueErrors naming the field."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from conftest import write_tiny_hf
from workloads import record_compilations

import ksana_jax
from ksana_jax import LLM, SamplingParams, StructuredOutputsParams
from ksana_jax.sampling import apply_token_bitmask
from ksana_jax.step_programs import compile_count
from ksana_jax.structured import GrammarCompiler, fill_bitmasks

MODEL_VOCAB = 320
CHOICES = ["yes", "no", "maybe"]
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"enum": ["x", "yy"]},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
        "c": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]"
BASE = dict(
    max_model_len=128,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    context_buckets=(128,),
    token_buckets=(8, 64),
    seq_buckets=(8,),
)
PROMPT = [5, 70, 71, 72, 100, 9]


def write_byte_tokenizer(path) -> int:
    """A byte-level BPE (256 bytes + a few merges + 3 specials) saved by transformers;
    returns its vocabulary size."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ['{"a": "x", "b": 3, "c": [true, false]}', "yes no maybe", "abc-1 ab-2"] * 20
    backend.train_from_iterator(corpus, trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(path)
    return backend.get_vocab_size()


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bytes") / "hf"
    write_tiny_hf(path, initializer_range=0.2, vocab_size=MODEL_VOCAB)
    write_byte_tokenizer(path)  # replaces the word-level one
    return path


@pytest.fixture(scope="module")
def byte_model(byte_dir):
    model = ksana_jax.load(byte_dir)
    assert model.tokenizer.vocab_size < MODEL_VOCAB
    return model


def masked_choice_rollout(model, prompt, choices, max_tokens=16) -> list[int]:
    """Greedy decoding where a token is allowed iff the text stays a prefix of a choice (EOS
    iff the text is a choice), by brute force over the vocabulary; ends at EOS or when the
    text is a choice nothing extends."""
    tok = model.tokenizer
    targets = [c.encode() for c in choices]
    pieces = {t: tok.token_bytes(t) for t in range(tok.vocab_size)}
    out, text = [], b""
    eos = model.eos_token_ids[0]
    for _ in range(max_tokens):
        allowed = [
            t for t, b in pieces.items() if b and any(c.startswith(text + b) for c in targets)
        ]
        if text in targets:
            allowed.append(eos)
        logits = model.logits(list(prompt) + out)[-1]
        token = max(allowed, key=lambda t: logits[t])
        out.append(token)
        if token == eos:
            break
        text += pieces[token]
        if text in targets and not any(c != text and c.startswith(text) for c in targets):
            break
    return out


def mixed_batch():
    """Constrained (greedy and sampled, n=2) and unconstrained rows, in one batch."""
    so = StructuredOutputsParams
    return [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(choice=CHOICES)),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(
            n=2, temperature=0.8, seed=3, max_tokens=40, structured_outputs=so(regex=REGEX)
        ),
        SamplingParams(
            n=2, temperature=0.8, seed=5, max_tokens=40, structured_outputs=so(json=SCHEMA)
        ),
        SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(json_object=True)),
    ]


def check_answers(model, outs) -> None:
    choice, schema, free, regex, sampled_json, _, obj = outs
    assert choice.outputs[0].token_ids == masked_choice_rollout(model, PROMPT, CHOICES)
    assert choice.outputs[0].text in CHOICES
    for out in (schema, sampled_json):
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert c.finish_reason == "stop", c
    for c in regex.outputs:
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c
    want = ksana_jax.generate(model, PROMPT, max_tokens=12, stop_token_ids=[])
    assert free.outputs[0].token_ids == want
    if obj.outputs[0].finish_reason == "stop":  # a random model may write keys until the end
        assert isinstance(json.loads(obj.outputs[0].text), dict)


def test_mixed_batch_constrained_and_free_without_recompiling(byte_model):
    compiles = record_compilations()
    llm = LLM(byte_model, **BASE)
    warm = compile_count()
    compiles.clear()
    outs = llm.generate([PROMPT] * 7, mixed_batch(), use_tqdm=False)
    assert compile_count() == warm and compiles == []
    check_answers(byte_model, outs)  # (its references compile their own functions)
    # the same requests one at a time give the same tokens (seeded sampling included)
    for params, out in zip(mixed_batch(), outs, strict=True):
        alone = llm.generate([PROMPT], params, use_tqdm=False)[0]
        assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in out.outputs]


def test_async_scheduling_gives_the_same_tokens(byte_model):
    sync = LLM(byte_model, warm_up=False, **BASE).generate(
        [PROMPT] * 7, mixed_batch(), use_tqdm=False
    )
    overlapped = LLM(byte_model, warm_up=False, async_scheduling=True, **BASE)
    outs = overlapped.generate([PROMPT] * 7, mixed_batch(), use_tqdm=False)
    check_answers(byte_model, outs)
    for a, b in zip(sync, outs, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_masks_are_filled_while_the_forward_runs(byte_model):
    """With async scheduling, a constrained decode step dispatches its forward, then fetches
    the step before (whose token advances the grammar), then fills its bitmask and
    dispatches its sampling: the grammar's host work overlaps the forward."""
    llm = LLM(byte_model, warm_up=False, async_scheduling=True, **BASE)
    runner, events = llm.engine.runner, []
    for name, owner in [
        ("dispatch", runner),
        ("fetch", runner),
        ("bitmasks", runner.batch),
        ("sample", runner),
    ]:
        method = getattr(owner, name)
        setattr(owner, name, lambda *a, _m=method, _n=name: events.append(_n) or _m(*a))
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so_json())
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    overlapped = " ".join(events).count("dispatch fetch bitmasks sample")
    assert overlapped >= len(out.outputs[0].token_ids) - 2, events


def so_json() -> StructuredOutputsParams:
    return StructuredOutputsParams(json=SCHEMA)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "json"),
        (dict(json="{not json"), "json"),
        (dict(regex="[0-9"), "regex"),
        (dict(grammar="root ::= ("), "grammar"),
        (dict(json={"type": "string", "format": "no-such-format"}), "json"),
    ],
)
def test_invalid_constraint_is_a_value_error_naming_the_field(byte_model, spec, field):
    llm = LLM(byte_model, warm_up=False, **BASE)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} "):
        llm.engine.make_group("bad", PROMPT, params)


@pytest.mark.parametrize(
    "kw",
    [{}, {"json": "{}", "regex": "a"}, {"choice": "ab"}, {"choice": ["a", ""]}, {"choice": []}],
)
def test_structured_outputs_params_checks(kw):
    with pytest.raises(ValueError, match=r"^structured_outputs"):
        StructuredOutputsParams(**kw)


def _is_text(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_padding_ids_are_never_allowed_and_the_mask_applies_as_data(byte_model):
    tok = byte_model.tokenizer
    compiler = GrammarCompiler(tok, MODEL_VOCAB, byte_model.eos_token_ids)
    anything = compiler.matcher(StructuredOutputsParams(regex=r"(.|\n)*"))
    masks = np.full((3, -(-MODEL_VOCAB // 32)), -1, np.int32)
    fill_bitmasks([(anything, 1)], masks)
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :MODEL_VOCAB]
    assert allowed[0].all() and allowed[2].all()  # rows without a matcher: untouched
    assert not allowed[1, tok.vocab_size :].any()  # the model's padding ids
    text_pieces = [t for t in range(3, tok.vocab_size) if _is_text(tok.token_bytes(t))]
    assert len(text_pieces) > 150 and allowed[1, text_pieces].all()
    logits = np.random.default_rng(0).normal(size=(3, MODEL_VOCAB)).astype(np.float32)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(masks)))
    np.testing.assert_array_equal(got, np.where(allowed == 1, logits, -np.inf))
    assert compiler.num_compiled == 1
    compiler.matcher(StructuredOutputsParams(regex=r"(.|\n)*"))
    assert compiler.num_compiled == 1  # cached


OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
NODE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"],
}
# (schema, a JSON text that satisfies it, one that breaks the keyword): docs/structured_output.md
ENFORCED = {
    "format": ({"type": "string", "format": "email"}, '"a@b.io"', '"not an email"'),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "4"),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, "1", "0"),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        '{"xa": 1}',
        '{"xa": "s"}',
    ),
    "minProperties": ({"type": "object", "minProperties": 1}, '{"a": 1}', "{}"),
    "allOf": ({"allOf": [OBJ_AB, {"required": ["a"]}]}, '{"a": 1}', "{}"),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        '[1, "a"]',
        '["a"]',
    ),
    "oneOf, disjoint": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "1", "[]"),
    "$ref recursion": (
        NODE,
        '{"v": 1, "next": {"v": 2, "next": null}}',
        '{"v": 1, "next": {"v": "x", "next": null}}',
    ),
}
REFUSED = {
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # branches that overlap
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "if": {**OBJ_AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "not": {"not": {"type": "string"}},
    "contains": {"type": "array", "contains": {"const": 1}},
    "dependentRequired": {**OBJ_AB, "dependentRequired": {"a": ["b"]}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "unevaluatedProperties": {**OBJ_AB, "unevaluatedProperties": False},
    "https://": {"$ref": "https://example.com/schema.json"},
}


@pytest.fixture(scope="module")
def compiler(byte_model):
    return GrammarCompiler(byte_model.tokenizer, MODEL_VOCAB, byte_model.eos_token_ids)


def _accepts(compiler, byte_model, schema: dict, text: str) -> bool:
    matcher = compiler.matcher(StructuredOutputsParams(json=schema))
    tokens = byte_model.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(t) for t in [*tokens, byte_model.eos_token_ids[0]])


@pytest.mark.parametrize("keyword", ENFORCED)
def test_schema_keywords_llguidance_enforces(compiler, byte_model, keyword):
    schema, good, bad = ENFORCED[keyword]
    assert _accepts(compiler, byte_model, schema, good)
    assert not _accepts(compiler, byte_model, schema, bad)


@pytest.mark.parametrize("keyword", REFUSED)
def test_schema_keywords_llguidance_refuses_are_named(compiler, keyword):
    with pytest.raises(ValueError, match=r"^structured_outputs\.json is invalid") as e:
        compiler.matcher(StructuredOutputsParams(json=REFUSED[keyword]))
    assert keyword in str(e.value)


# --------------------------------------------------------------------------- offline chat

TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "description": "Pick",
        "parameters": {
            "type": "object",
            "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["b"],
            "additionalProperties": False,
        },
    },
}
CHAT_BASE = {**BASE, "max_model_len": 512, "context_buckets": (512,)}


def test_chat_renders_tools_and_a_named_tool_call_validates(byte_dir, byte_model):
    """LLM.chat with tools (vLLM's signature): the prompt is the template rendered with the
    tools, as transformers renders it; a structured output with the tool's parameters
    schema (what a named tool_choice enforces) gives valid arguments; continue_final_message
    leaves the last message open, as transformers does."""
    import transformers
    from test_tool_parsers import HERMES_TEMPLATE

    hf = transformers.AutoTokenizer.from_pretrained(byte_dir)
    llm = LLM(byte_model, warm_up=False, **CHAT_BASE)
    messages = [{"role": "user", "content": "Pick b."}]
    schema = json.dumps(TOOL["function"]["parameters"])
    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=schema)
    )
    (out,) = llm.chat(messages, params, use_tqdm=False, tools=[TOOL], chat_template=HERMES_TEMPLATE)
    want = hf.apply_chat_template(
        messages, tools=[TOOL], chat_template=HERMES_TEMPLATE, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert '"name": "pick"' in want
    assert out.prompt_token_ids == hf.encode(want, add_special_tokens=False)
    jsonschema.validate(json.loads(out.outputs[0].text), TOOL["function"]["parameters"])
    assert out.outputs[0].finish_reason == "stop"

    partial = [*messages, {"role": "assistant", "content": '{"b": '}]
    (cont,) = llm.chat(
        partial,
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
        chat_template=HERMES_TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    want = hf.apply_chat_template(
        partial, chat_template=HERMES_TEMPLATE, tokenize=False, continue_final_message=True
    )
    assert want.endswith('{"b": ')
    assert cont.prompt_token_ids == hf.encode(want, add_special_tokens=False)
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(partial, continue_final_message=True, chat_template=HERMES_TEMPLATE)

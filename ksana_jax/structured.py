"""Structured output on the host (no jax): constraints compiled into grammar matchers, which
fill each step's token bitmasks and advance with each sampled token.

    StructuredOutputsParams      what a request asks for (vLLM's names): json | regex |
                                 choice | grammar | json_object, exactly one
    GrammarCompiler.matcher()    spec -> GrammarMatcher; compiled once per spec (cached),
                                 validated (ValueError naming the field) -- run it off the
                                 event loop (the engine's make_group runs in a worker)
    fill_bitmasks(pairs, masks)  each constrained row's allowed tokens into masks
                                 i32[S, ceil(V / 32)] (bit t % 32 of word t // 32 = token t)
    GrammarMatcher.accept(t)     after the scheduler appends a sampled token

The library is llguidance (measured against xgrammar: docs/structured_output.md). Its
tokenizer is built from the checkpoint's tokenizer.json (or, for sentencepiece and others it
cannot read, from each token's bytes) over the model's vocabulary V, which may exceed the
tokenizer's: ids past the tokenizer are never allowed. EOS is allowed only where the grammar
may end, so a constrained request finishes with "stop" when the answer is complete. JSON is compact
(", " and ": " separators, no free whitespace): a small model given free whitespace can pad
an answer with newlines until max_tokens.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np

from ksana_jax.sampling_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for `spec` (not yet validated against a tokenizer)."""
    kind = spec.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if kind == "json":
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json must be a JSON object, got {schema!r}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)
    except Exception as e:  # GBNF -> Lark conversion errors
        raise ValueError(f"structured_outputs.grammar is not a valid grammar: {e}") from None


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and the tokens so
    far (advanced by the scheduler as tokens are sampled)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        """Advances by a sampled token; False if the grammar did not allow it."""
        return self._matcher.consume_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (EOS consumed, or nothing else may follow)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (thread-safe; the llguidance
    tokenizer is built on first use, ~0.3 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = [int(t) for t in eos_token_ids]
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._cache: dict[tuple[str, Any], str] = {}
        self.num_compiled = 0  # grammars compiled (cache misses)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._ll

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The validated grammar of `spec` (cached); ValueError naming the field if invalid."""
        grammar = self._cache.get(spec.key)
        if grammar is not None:
            return grammar
        grammar = _grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer
        )
        if is_error:
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {messages[0]}")
        with self._lock:
            self.num_compiled += 1
            self._cache[spec.key] = grammar
        return grammar

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        m = llguidance.LLMatcher(self.ll_tokenizer, self.compile(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {m.get_error()}")
        return GrammarMatcher(m)


def _ll_tokenizer(tokenizer, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the engine's Tokenizer over `vocab_size` ids."""
    hf_json = tokenizer.to_json()
    if hf_json is not None:
        try:
            return llguidance.LLTokenizer(hf_json, n_vocab=vocab_size, eos_token=eos)
        except ValueError:  # a tokenizer.json llguidance cannot read (no decoder): bytes
            pass
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_BytesVocab(tokenizer, vocab_size, eos[0])),
        n_vocab=vocab_size,
        eos_token=eos,
    )


class _BytesVocab:
    """What llguidance's TokenizerWrapper reads, from a tokenizer without tokenizer.json."""

    def __init__(self, tokenizer, vocab_size: int, eos: int):
        self._tokenizer = tokenizer
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id
        # ids past the tokenizer's (model vocabulary padding) hold a byte string no text
        # contains, so no grammar allows them
        num = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) for i in range(num)]
        self.tokens += [b"\xff<pad %d>" % i for i in range(num, vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def fill_bitmasks(rows: Sequence[tuple[GrammarMatcher, int]], masks: np.ndarray) -> None:
    """Writes each (matcher, row)'s allowed next tokens into masks i32[S, W] (in parallel
    threads); other rows are left as they are."""
    assert masks.dtype == np.int32 and masks.flags["C_CONTIGUOUS"], masks
    _executor().unsafe_compute_mask_ptr(
        [(m._matcher, row) for m, row in rows],
        masks.ctypes.data,
        masks.shape[1] * 4,
        masks.shape[0],
    )

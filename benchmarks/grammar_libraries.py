"""xgrammar vs llguidance on one tokenizer: grammar compile time per JSON schema and the
per-token mask fill time while a valid answer is consumed token by token.

    python benchmarks/grammar_libraries.py CHECKPOINT_DIR

Both libraries get the same vocabulary (the checkpoint's tokenizer, each token's raw bytes)
and fill an int32 bitmask of ceil(V / 32) words per token, as the engine uses it. xgrammar is
measured when installed (it is not a ksana-jax dependency: it imports torch and transformers).
Prints one table; the library ksana-jax uses (llguidance) is the peer of the ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from ksana_jax.tokenizer import Tokenizer

SCHEMAS = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested+array+enum": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "tags": {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 1,
                    "maxItems": 4,
                },
                "kind": {"enum": ["town", "city", "village"]},
                "where": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                },
            },
            "required": ["city", "tags", "kind", "where"],
        },
        {
            "city": "Paris",
            "tags": ["old", "big"],
            "kind": "city",
            "where": {"lat": 48.8, "lon": 2.3},
        },
    ),
    "anyOf+nullable+pattern": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "score": {
                    "anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "null"}]
                },
                "note": {"type": ["string", "null"]},
            },
            "required": ["id", "score", "note"],
        },
        {"id": "ABC-1234", "score": 77, "note": None},
    ),
}


def _llguidance(tokenizer: Tokenizer, vocab: int):
    import llguidance

    tok = llguidance.LLTokenizer(
        tokenizer._backend.to_str(), n_vocab=vocab, eos_token=tokenizer.eos_token_id
    )

    def compile_(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(grammar):
        m = llguidance.LLMatcher(tok, grammar)

        def fill(mask):
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

        return fill, m.consume_token, m.is_accepting

    return compile_, matcher


def _xgrammar(tokenizer: Tokenizer, vocab: int):
    import xgrammar

    info = xgrammar.TokenizerInfo(
        [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)],
        xgrammar.VocabType.RAW,
        vocab_size=vocab,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_(schema):
        return compiler.compile_json_schema(json.dumps(schema))

    def matcher(compiled):
        m = xgrammar.GrammarMatcher(compiled)

        def fill(mask):
            m.fill_next_token_bitmask(mask[None])

        return fill, m.accept_token, m.is_terminated

    return compile_, matcher


def measure(name: str, make, tokenizer: Tokenizer, vocab: int) -> dict[str, tuple[float, float]]:
    """{schema: (compile ms, first mask fill us, median mask fill us per token)}."""
    t = time.perf_counter()
    compile_, matcher = make(tokenizer, vocab)
    print(f"{name}: tokenizer setup {1e3 * (time.perf_counter() - t):.0f} ms", file=sys.stderr)
    out = {}
    for key, (schema, answer) in SCHEMAS.items():
        t = time.perf_counter()
        grammar = compile_(schema)
        compile_ms = 1e3 * (time.perf_counter() - t)
        fill, consume, _ = matcher(grammar)
        mask = np.zeros(-(-vocab // 32), np.int32)
        times = []
        tokens = [*tokenizer.encode(json.dumps(answer), add_special_tokens=False)]
        for token in tokens:
            t = time.perf_counter()
            fill(mask)
            times.append(time.perf_counter() - t)
            assert (mask[token // 32] >> (token % 32)) & 1, (name, key, token)
            assert consume(token), (name, key, token)
        out[key] = (compile_ms, 1e6 * times[0], 1e6 * statistics.median(times[1:]))
    return out


def main(checkpoint: str) -> None:
    tokenizer = Tokenizer.from_dir(checkpoint)
    with open(f"{checkpoint}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    results = {"llguidance": measure("llguidance", _llguidance, tokenizer, vocab)}
    try:
        results["xgrammar"] = measure("xgrammar", _xgrammar, tokenizer, vocab)
    except ImportError:
        print("xgrammar not installed: skipped", file=sys.stderr)
    print("| schema | library | compile ms | first fill us | median fill us | vs llguidance |")
    print("|---|---|---|---|---|---|")
    for key in SCHEMAS:
        base = results["llguidance"][key][2]
        for lib, res in results.items():
            c, first, f = res[key]
            print(f"| {key} | {lib} | {c:.1f} | {first:.0f} | {f:.1f} | {f / base:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1])

"""Structured output's cost: concurrent requests with a JSON schema vs the same without one,
and grammar compile time per schema (first and cached).

On the demo model (SmolLM2-135M) by default: N chat requests (default 16) submitted at once,
each generating exactly M tokens (default 64): the free run ignores EOS, the constrained
run's schema is an array of at least 100 short strings, so neither ends early and both
generate N x M tokens under the same continuous batching. Each run is done once untimed
(steps compiled, grammar compiled and cached) and then timed R times (default 2; the best
counts). Prints one table: output
tokens/s of each run and its ratio to the free run; then, per schema, the time to compile a
grammar (a fresh GrammarCompiler: llguidance's tokenizer is built before timing) the first
time and from the cache.

    python benchmarks/structured.py [--requests 16] [--output 64] [--repeats 2] [--model DIR]
                                    [--async-scheduling]
"""

from __future__ import annotations

import argparse
import time

from ksana_jax import LLM, SamplingParams, StructuredOutputsParams
from ksana_jax.demo import demo_checkpoint
from ksana_jax.structured import GrammarCompiler

LONG_LIST = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 100,
        }
    },
    "required": ["words"],
    "additionalProperties": False,
}
SCHEMAS = {
    "long list": LONG_LIST,
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": ["string", "null"], "pattern": "^[a-z]+@[a-z]+\\.com$"},
        },
        "required": ["name", "age", "email"],
    },
    "nested anyOf": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 5,
                "items": {
                    "anyOf": [
                        {"type": "object", "properties": {"id": {"type": "integer"}}},
                        {"enum": ["none", "all"]},
                    ]
                },
            },
            "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
        },
    },
}


def timed_run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, int]:
    """(seconds, output tokens) of one batch, submitted at once."""
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(c.token_ids) for o in outs for c in o.outputs)


def throughput(llm: LLM, args: argparse.Namespace) -> dict[str, float]:
    """Output tokens/s of the free and the constrained run."""
    prompts = [
        [{"role": "user", "content": f"List {100 + i} words about the sea as JSON."}]
        for i in range(args.requests)
    ]
    runs = {
        "free": SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True),
        "json schema": SamplingParams(
            temperature=0,
            max_tokens=args.output,
            structured_outputs=StructuredOutputsParams(json=LONG_LIST),
        ),
    }
    result = {}
    for name, params in runs.items():
        timed_run(llm, prompts, params)  # untimed: compiles, caches the grammar
        rates = []
        for _ in range(args.repeats):  # the best of a few: the machine may be shared
            seconds, tokens = timed_run(llm, prompts, params)
            assert tokens == args.requests * args.output, (name, tokens)
            rates.append(tokens / seconds)
        result[name] = max(rates)
    return result


def compile_times(llm: LLM) -> dict[str, tuple[float, float]]:
    """Per schema: (first, cached) seconds to get a request's matcher."""
    engine = llm.engine
    compiler = GrammarCompiler(
        engine.tokenizer, engine.model.config.vocab_size, engine.model.eos_token_ids
    )
    compiler.ll_tokenizer  # noqa: B018 (built once per engine, not per schema)
    out = {}
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            compiler.matcher(spec)
            times.append(time.perf_counter() - start)
        out[name] = (times[0], times[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (best is kept)")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: SmolLM2)")
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args()
    llm = LLM(
        args.model or demo_checkpoint(),
        max_model_len=512,
        max_num_seqs=args.requests,
        max_num_batched_tokens=256,
        async_scheduling=args.async_scheduling,
    )
    rates = throughput(llm, args)
    print(f"\n{args.requests} concurrent requests x {args.output} tokens, greedy")
    print("| run | output tok/s | vs free |")
    print("|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / rates['free']:.2f}x |")
    print("\n| schema | first compile ms | cached ms |")
    print("|---|---|---|")
    for name, (first, cached) in compile_times(llm).items():
        print(f"| {name} | {1e3 * first:.2f} | {1e3 * cached:.3f} |")


if __name__ == "__main__":
    main()

"""Prefix cache: many requests sharing a long system prompt, with the cache off and on.

A seeded workload on the demo model (SmolLM2-135M): every request is the same system prompt
(default 1,024 random tokens) plus its own tokens (default 32), and generates a fixed number
of tokens (default 32, EOS ignored). The engine runs it twice on the same model, buckets and
compiled steps, with `enable_prefix_caching` off and on. Each run first serves one request
made of the system prompt alone, untimed (a server has seen its system prompt before;
`--cold` skips this), then submits all the requests at once and steps to the end (continuous
batching, chunked prefill). Prints per run: wall time, output and total token throughput,
time to first token (submission to the step that returned it) and the prefix-cache hit rate
of the timed requests; the greedy outputs of the two runs are compared (in float32, the
default, they agree; in bfloat16 the shared prefix's K/V, computed in other chunk shapes,
round differently and can flip a near-tied greedy token).

CPU note: the reference attention gathers each new token's whole context, so a step costs
about tokens x context bucket; a long shared prompt makes every prefill step expensive
with or without the cache, which only removes most of them.

    python benchmarks/prefix_cache.py [--requests 4] [--shared 1024] [--unique 32]
                                      [--output 32] [--cold] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from ksana_jax import LLM, SamplingParams, load
from ksana_jax.demo import demo_checkpoint
from ksana_jax.engine import LLMEngine


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    """The system prompt, and each request's prompt (the system prompt + its own tokens)."""
    rng = np.random.default_rng(args.seed)
    system = [int(t) for t in rng.integers(100, vocab, args.shared)]
    own = [[int(t) for t in rng.integers(100, vocab, args.unique)] for _ in range(args.requests)]
    return system, [system + tokens for tokens in own]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submits every prompt at once and steps to the end; returns timings and outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    hits, queries = engine.stats.prefix_cache_hits, engine.stats.prefix_cache_queries
    ids = [f"r{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    ttft: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - start
            if out.outputs[0].token_ids and out.request_id not in ttft:
                ttft[out.request_id] = now
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    assert all(len(outputs[i]) == max_tokens for i in ids)
    return {
        "seconds": seconds,
        "ttft": sorted(ttft.values()),
        "outputs": [outputs[i] for i in ids],
        "hits": engine.stats.prefix_cache_hits - hits,
        "queries": engine.stats.prefix_cache_queries - queries,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--shared", type=int, default=1024, help="system prompt tokens")
    parser.add_argument("--unique", type=int, default=32, help="tokens of each request's own")
    parser.add_argument("--output", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cold", action="store_true", help="no untimed system-prompt request")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = parser.parse_args()

    checkpoint = demo_checkpoint()
    model = load(checkpoint, dtype=args.dtype)
    system, prompts = workload(args, model.config.vocab_size)
    page_size = 16
    max_model_len = -(-(args.shared + args.unique + args.output) // page_size) * page_size
    config = dict(
        dtype=args.dtype,
        page_size=page_size,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seq_buckets=(args.max_num_seqs,),  # one row bucket keeps warm-up short
        compilation_cache_dir=str(checkpoint.parent / "jax-cache"),
    )
    results = {}
    for caching in (False, True):
        start = time.perf_counter()
        llm = LLM(model, enable_prefix_caching=caching, **config)
        warm_up = time.perf_counter() - start
        if not args.cold:
            run(llm.engine, [system], 1)
        results[caching] = run(llm.engine, prompts, args.output) | {"warm_up": warm_up}
        del llm

    mismatched = sum(
        a != b for a, b in zip(results[False]["outputs"], results[True]["outputs"], strict=True)
    )
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = args.requests * args.output
    print(
        f"\n{args.requests} requests x ({args.shared} shared + {args.unique} own) prompt "
        f"tokens, {args.output} output tokens each, all at once"
        f"{' (cold: system prompt not seen before)' if args.cold else ''}; SmolLM2-135M "
        f"{args.dtype} on {jax.devices()[0].platform}; max_num_batched_tokens "
        f"{args.max_num_batched_tokens}"
    )
    header = ("prefix cache", "seconds", "out tok/s", "all tok/s", "TTFT mean", "TTFT p50")
    print(
        f"{header[0]:<14}" + "".join(f"{h:>11}" for h in header[1:]) + f"{'TTFT p90':>11}"
        f"{'hit rate':>10}"
    )
    for caching, r in results.items():
        ttft = r["ttft"]
        hit_rate = r["hits"] / r["queries"] if r["queries"] else 0.0
        print(
            f"{'on' if caching else 'off':<14}{r['seconds']:>11.1f}"
            f"{output_tokens / r['seconds']:>11.1f}"
            f"{(prompt_tokens + output_tokens) / r['seconds']:>11.1f}"
            f"{statistics.mean(ttft):>11.2f}{statistics.median(ttft):>11.2f}"
            f"{np.percentile(ttft, 90):>11.2f}{hit_rate:>10.1%}"
        )
    off, on = results[False], results[True]
    print(
        f"\ncache on vs off: {off['seconds'] / on['seconds']:.2f}x throughput, "
        f"{statistics.mean(off['ttft']) / statistics.mean(on['ttft']):.2f}x mean TTFT, "
        f"{statistics.median(off['ttft']) / statistics.median(on['ttft']):.2f}x median TTFT; "
        f"hits {on['hits']} of {on['queries']} prompt tokens; "
        f"{mismatched} of {args.requests} greedy outputs differ between the runs; "
        f"warm-up {off['warm_up']:.0f} s / {on['warm_up']:.0f} s"
    )


if __name__ == "__main__":
    main()

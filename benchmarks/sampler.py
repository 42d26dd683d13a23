"""The sampler alone: one jitted call per sampler plan (sampling.SamplerPlan) on random logits
f32[rows, vocab], beside XLA's own `jnp.argmax` as the peer, and the greedy argmax as the
engine computes it (`sampling._argmax`) beside the same without the optimization barrier on
its blocks' maxima (XLA then folds the row's max back into a second pass over the logits).

Each plan's rows are what plan_for would give it: greedy rows (GREEDY), temperature 0.8 and
top-p 0.95 (RANDOM), either asking for logprobs (GREEDY_LOGPROBS, RANDOM_LOGPROBS), and the
full plans with a presence penalty on every row (FULL_GREEDY greedy, FULL sampling). The
logits are peaked as a model's are (a few tokens far above the rest: the top-p nucleus holds
under FILTER_PREFIXES[0] tokens, so a CPU's filters need no sort); "flat" is the RANDOM plan on
standard normal logits, whose nucleus spans most of the vocabulary (a CPU sorts). On a
GPU the full plans run the passes a CPU skips with conditionals (`sampling.if_needed`): what
a penalty or a token mask costs there. Times are the best of `--repeats` rounds of calls
(a shared machine's load moves the median more than the best).

    python benchmarks/sampler.py [--rows 1 64 256] [--vocab 49152] [--repeats 7]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import sampling
from ksana_jax.sampling import ARGMAX_BLOCK, PenaltyCounts, SamplerPlan, SamplingInputs

MAX_LOGPROBS = 5


def argmax_folded(x: jax.Array) -> jax.Array:
    """sampling._argmax without the barrier: what it computed before."""
    rows, vocab = x.shape
    num_blocks = -(-vocab // ARGMAX_BLOCK)
    x = jnp.pad(x, ((0, 0), (0, num_blocks * ARGMAX_BLOCK - vocab)), constant_values=-jnp.inf)
    blocks = x.reshape(rows, num_blocks, ARGMAX_BLOCK)
    block = jnp.minimum(sampling._first_max(jnp.max(blocks, axis=-1)), num_blocks - 1)
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    first = block * ARGMAX_BLOCK + sampling._first_max(inside)
    return jnp.minimum(first, vocab - 1)


def rows_for(plan: SamplerPlan, rows: int, vocab: int) -> SamplingInputs:
    """Sampling inputs whose plan (plan_for) is `plan`."""
    full = np.full
    s = SamplingInputs(
        temperature=full(rows, 0.0 if plan.greedy else 0.8, np.float32),
        top_k=full(rows, 0, np.int32),
        top_p=full(rows, 1.0 if plan.greedy else 0.95, np.float32),
        min_p=full(rows, 0.0, np.float32),
        repetition_penalty=full(rows, 1.0, np.float32),
        presence_penalty=full(rows, 0.5 if plan.full else 0.0, np.float32),
        frequency_penalty=full(rows, 0.0, np.float32),
        seeds=np.arange(rows, dtype=np.uint32),
        num_generated=full(rows, 3, np.int32),
        num_prompt_tokens=full(rows, 16, np.int32),
        num_logprobs=full(rows, MAX_LOGPROBS if plan.logprobs else -1, np.int32),
        suppressed_ids=full((rows, 1), -1, np.int32),
        slots=np.arange(rows, dtype=np.int32),
        bias_ids=full((rows, 1), -1, np.int32),
        bias_values=full((rows, 1), 0.0, np.float32),
        token_bitmask=full((rows, -(-vocab // 32)), -1, np.int32),
    )
    assert sampling.plan_for(s, masked=False) is plan, plan
    return jax.tree.map(jnp.asarray, s)


def best_ms(fn, *args, repeats: int) -> float:
    """The best of `repeats` rounds, each of as many calls as fill ~0.1 s (at least one)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, int(0.1 / (time.perf_counter() - start)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    print(f"{platform}, vocabulary {args.vocab}; ms a call, the best of {args.repeats} rounds")
    print(f"{'rows':>5} {'what':24} {'ms':>8} {'/ jnp.argmax':>13}", flush=True)
    rng = np.random.default_rng(0)
    for rows in args.rows:
        flat = rng.standard_normal((rows, args.vocab), np.float32)
        peaked = flat.copy()
        for row in peaked:
            row[rng.choice(args.vocab, 8, replace=False)] += 12.0
        logits = jnp.asarray(peaked)
        peer = best_ms(jax.jit(jnp.argmax, static_argnames="axis"), logits, 1, repeats=args.repeats)
        timed = {
            "jnp.argmax (peer)": peer,
            "_argmax": best_ms(jax.jit(sampling._argmax), logits, repeats=args.repeats),
            "_argmax, no barrier": best_ms(jax.jit(argmax_folded), logits, repeats=args.repeats),
        }
        counts = PenaltyCounts.zeros(rows, args.vocab)
        for plan in sampling.sampler_plans():
            s = rows_for(plan, rows, args.vocab)
            call = jax.jit(functools.partial(sampling.sample, max_logprobs=MAX_LOGPROBS, plan=plan))
            timed[f"plan {plan.value}"] = best_ms(call, logits, s, counts, repeats=args.repeats)
            if plan is SamplerPlan.RANDOM:
                flat_ms = best_ms(call, jnp.asarray(flat), s, counts, repeats=args.repeats)
                timed["plan random, flat"] = flat_ms
        for what, ms in timed.items():
            print(f"{rows:5d} {what:24} {ms:8.3f} {ms / peer:12.2f}x", flush=True)


if __name__ == "__main__":
    main()

"""On-device sampling inside the jitted step: logit bias, penalties, token bitmasks
(structured output), temperature, top-k/top-p/min-p, per-request seeds, top-N logprobs, and
prompt logprobs.

Penalties read per-row token counts (`PenaltyCounts`: which tokens the prompt holds, how
often each was generated), kept on device in the persistent batch (step_programs.BatchState) and
updated from each step's fed tokens (`count_tokens`), so no step ships a token history.

Every option is data (a per-row array), never structure, so a compiled step serves any mix
of requests. Which passes the sampler runs is decided on the host, from the step's rows
(`SamplerPlan`, a static argument: one compiled sampler per plan): a plain greedy batch (the
common serving case) only takes the argmax, which reduces blocks of the vocabulary first
(`_argmax`); a batch whose rows only sample (temperature, top-k/top-p/min-p, seeds) adds the
filters (`_filtered`: their cut-offs read from the largest logits) and the noise; either adds
log-softmax and top-N when some row wants logprobs (lm-eval, OpenAI `logprobs`); any other
batch (penalties, logit bias, banned ids, token masks) runs a full plan (on a GPU, a greedy
one for all-greedy rows). Within a full plan, work no row needs (the filters and noise when
every row is greedy, the penalty gathers when no row has a penalty, the mask when every row
allows every token, log-softmax and top-N when no row wants logprobs) is skipped by
`if_needed`: with `lax.cond` on CPU and TPU, where these passes over [S, V] are a large
share of a decode step; done anyway on a GPU, whose memory makes them small. No sampler a
GPU runs branches: XLA:GPU runs a conditional by copying its predicate to the host, so
dispatching a program that holds one waits for the work queued before it (the README has
an H200's numbers).

A row's randomness is `fold_in(key(seed), num_generated)` and its noise is indexed by token
id, so a request's tokens depend only on its seed and its own history, not on what else is
in the batch (nor on the plan). Logprobs are those of the model's raw distribution (before
logit bias, penalties and temperature), as vLLM returns them by default.

Prompt logprobs (`score_prompt`) come from a fixed number Q of a step's prompt positions
(EngineConfig.max_num_scored_tokens), gathered from the final hidden states: only they go
through the LM head, in the smallest size of `scored_sizes(Q)` that holds those in use
(static, chosen on the host: a program of its own per size, step_programs.score_step).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seeds",
        "num_generated",
        "num_prompt_tokens",
        "slots",
        "suppressed_ids",
        "num_logprobs",
        "bias_ids",
        "bias_values",
        "token_bitmask",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    temperature: jax.Array  # f32[S]  0 = greedy
    top_k: jax.Array  # i32[S]  <= 0 = disabled
    top_p: jax.Array  # f32[S]  1 = disabled
    min_p: jax.Array  # f32[S]  0 = disabled
    repetition_penalty: jax.Array  # f32[S]  1 = disabled
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]
    seeds: jax.Array  # u32[S]
    num_generated: jax.Array  # i32[S]  output tokens so far (the step's noise index)
    num_prompt_tokens: jax.Array  # i32[S]
    slots: jax.Array  # i32[S]  each row's row of the PenaltyCounts (its persistent slot)
    suppressed_ids: jax.Array  # i32[S, B]  tokens that must not be sampled now (EOS and stop
    #                                       ids while below min_tokens), padded with -1
    num_logprobs: jax.Array  # i32[S]  top-N logprobs wanted (0..max); -1 = no logprobs at all
    bias_ids: jax.Array  # i32[S, B]  logit_bias token ids, padded with -1
    bias_values: jax.Array  # f32[S, B]  their biases (0 for padding)
    token_bitmask: jax.Array  # i32[S, W]  W = ceil(V / 32): bit t % 32 of word t // 32 set =
    #                                       token t allowed (structured output); all ones = any


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["token_ids", "logprobs", "top_ids", "top_logprobs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SampledTokens:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]     raw logprob of each sampled token
    top_ids: jax.Array  # i32[S, N]  N = EngineConfig.max_logprobs
    top_logprobs: jax.Array  # f32[S, N]
    # (logprobs, top_ids and top_logprobs are zeros when no row of the batch wants logprobs)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["prompt_mask", "output_counts"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class PenaltyCounts:
    """Per slot (R persistent rows): the tokens seen so far, split as penalties need them."""

    prompt_mask: jax.Array  # bool[R, V]  token occurs in the prompt
    output_counts: jax.Array  # i32[R, V]  times the token was generated

    @classmethod
    def zeros(cls, num_slots: int, vocab: int) -> PenaltyCounts:
        return cls(
            jnp.zeros((num_slots, vocab), jnp.bool_), jnp.zeros((num_slots, vocab), jnp.int32)
        )


def count_tokens(
    counts: PenaltyCounts,
    slots: jax.Array,
    token_ids: jax.Array,
    is_output: jax.Array,
    reset_slots: jax.Array,
) -> PenaltyCounts:
    """Zeroes the rows `reset_slots` i32[S] (out of range: none), then counts token_ids i32[T]
    into rows `slots` i32[T] (out of range: dropped): as output tokens where is_output
    bool[T], else as prompt tokens."""
    vocab = counts.prompt_mask.shape[1]
    mask = counts.prompt_mask.at[reset_slots].set(False, mode="drop")
    num = counts.output_counts.at[reset_slots].set(0, mode="drop")
    ids = jnp.where((token_ids >= 0) & (token_ids < vocab), token_ids, vocab)
    mask = mask.at[slots, jnp.where(is_output, vocab, ids)].set(True, mode="drop")
    num = num.at[slots, jnp.where(is_output, ids, vocab)].add(1, mode="drop")
    return PenaltyCounts(mask, num)


def penalties_active(s: SamplingInputs) -> jax.Array:
    """bool[S]: rows with any penalty."""
    return (
        (s.repetition_penalty != 1.0) | (s.presence_penalty != 0.0) | (s.frequency_penalty != 0.0)
    )


def apply_penalties(logits: jax.Array, s: SamplingInputs, counts: PenaltyCounts) -> jax.Array:
    """Repetition (prompt + output tokens), presence and frequency (output tokens) penalties;
    row i reads its counts from row `s.slots[i]` of `counts`."""
    output_counts = counts.output_counts[s.slots].astype(jnp.float32)
    seen = counts.prompt_mask[s.slots] | (output_counts > 0)
    rp = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits -= s.frequency_penalty[:, None] * output_counts
    return logits - s.presence_penalty[:, None] * (output_counts > 0)


# How many of the largest logits _filtered seeks a row's cut-offs among, in turn, before
# sorting the row.
FILTER_PREFIXES = (256, 4096)

# What _filtered hands its candidates to: (values f32[S, n], ids i32[S, n] or None) -> result.
Candidates = Callable[[jax.Array, jax.Array | None], jax.Array]


def _filtered(logits: jax.Array, s: SamplingInputs, use: Candidates) -> jax.Array:
    """`use(values, ids)` on the fewest candidates that hold every sampling row's kept
    tokens: values f32[S, n] the temperature-scaled logits of the token ids i32[S, n], those
    outside top-k / top-p / min-p at -inf; ids None means every token (n = V, in id order).

    Applied in transformers' order: temperature, top-k, top-p, min-p. The cut-offs are read
    from the logits in descending order. A GPU sorts the vocabulary and passes every token.
    XLA:CPU sorts far slower than its top_k finds the largest few hundred
    (benchmarks/sampler.py), so elsewhere the cut-offs are sought among the largest
    FILTER_PREFIXES[0] logits (where a peaked distribution's nucleus lies); a row whose
    cut-off lies past them seeks it alone, among its largest of the next size, and only such
    a row whose cut-off lies past them all sorts, alone (lax.conds: exact either way). Where
    every row's kept tokens lie among its largest FILTER_PREFIXES[0], only those are passed:
    the noise is then drawn for them, not for V. A batch where no row has top-k or top-p
    needs no order at all (min-p reads the max). Greedy rows (temperature 0) take no part in
    the choice: their draw is not used.
    """
    logits = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    vocab = logits.shape[1]

    def everything(threshold: jax.Array) -> jax.Array:
        return use(jnp.where(logits >= threshold, logits, -jnp.inf), None)

    if branches_cost_a_sync():
        return everything(_sorted_cutoff(logits, s))
    sizes = tuple(n for n in FILTER_PREFIXES if n < vocab)
    return jax.lax.cond(
        jnp.any(((s.top_k > 0) & (s.top_k < vocab)) | (s.top_p < 1.0)),
        lambda: _among_largest(logits, s, sizes, use, everything),
        lambda: everything(jnp.max(logits, axis=-1, keepdims=True) + jnp.log(s.min_p)[:, None]),
    )


def _among_largest(
    logits: jax.Array,
    s: SamplingInputs,
    sizes: tuple[int, ...],
    use: Candidates,
    everything: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """_filtered's search for scaled `logits`: each row's cut-offs among its largest sizes[0]
    logits; those of the rows whose cut-offs lie past them, one row at a time (a lax.cond:
    such rows are few), among its largest sizes[1:], else from its sorted logits. The
    candidates are those largest where every row keeps no more (a row keeps all its logits
    >= its threshold, ties included), else every token."""
    if not sizes:  # a vocabulary no larger than the smallest size: every row sorted
        return everything(_sorted_cutoff(logits, s))
    largest, ids = jax.lax.top_k(logits, sizes[0])
    threshold, found = _cutoff(logits, largest, s)
    greedy = s.temperature == 0.0  # a greedy row's draw is not used: it needs nothing
    found |= greedy

    def candidates(threshold):
        kept = jnp.sum(logits >= threshold, axis=-1)
        return jax.lax.cond(
            jnp.all((kept <= sizes[0]) | greedy),
            lambda t: use(jnp.where(largest >= t, largest, -jnp.inf), ids),
            everything,
            threshold,
        )

    def row_by_row(threshold):
        order = jnp.nonzero(~found, size=found.shape[0], fill_value=0)[0]

        def seek(i, threshold):
            row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, order[i], 1), (logits, s))
            cutoff = _row_cutoff(*row, sizes[1:])
            return jax.lax.dynamic_update_slice_in_dim(threshold, cutoff, order[i], 0)

        return everything(jax.lax.fori_loop(0, jnp.sum(~found), seek, threshold))

    return jax.lax.cond(jnp.all(found), candidates, row_by_row, threshold)


def _row_cutoff(logits: jax.Array, s: SamplingInputs, sizes: tuple[int, ...]) -> jax.Array:
    """One row's least kept logit f32[1, 1] (`logits` f32[1, V]): sought among its largest
    sizes[0], then sizes[1:] (lax.conds), else read from its sorted logits. XLA:CPU sorts
    one row in about 1/S of the time it sorts S, and takes a top_k of 4,096 in 1/7 of a
    row's sort (benchmarks/sampler.py)."""
    if not sizes:
        return _sorted_cutoff(logits, s)
    threshold, found = _cutoff(logits, jax.lax.top_k(logits, sizes[0])[0], s)
    return jax.lax.cond(found[0], lambda: threshold, lambda: _row_cutoff(logits, s, sizes[1:]))


def _sorted_cutoff(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    return _cutoff(logits, -jnp.sort(-logits, axis=-1), s)[0]


def _cutoff(
    logits: jax.Array, largest: jax.Array, s: SamplingInputs
) -> tuple[jax.Array, jax.Array]:
    """Each row's least kept logit f32[S, 1] under top-k, top-p and min-p, read from `largest`
    f32[S, n], the row's n largest logits in descending order, and whether each row's
    cut-offs lie among them bool[S] (always, for n = V)."""
    vocab, n = logits.shape[1], largest.shape[1]
    # top-k: keep logits >= the k-th largest (disabled: every logit).
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(largest, (jnp.minimum(k, n) - 1)[:, None], axis=-1)
    kth = jnp.where((k == vocab)[:, None], -jnp.inf, kth)
    # top-p on what top-k kept (HF's and vLLM's order): the smallest prefix whose mass
    # reaches p; the first token is always kept, and p = 1 keeps everything.
    # (the max of the row, not largest's first: XLA:CPU sorts for a top_k sliced twice)
    top = jnp.max(logits, axis=-1, keepdims=True)
    mass = jnp.sum(jnp.where(logits >= kth, jnp.exp(logits - top), 0.0), axis=-1, keepdims=True)
    probs = jnp.where(largest >= kth, jnp.exp(largest - top), 0.0) / mass
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.sum(mass_before < s.top_p[:, None], axis=-1)
    found = ((k <= n) | (k == vocab)) & ((s.top_p >= 1.0) | (num_kept < n) | (n == vocab))
    num_kept = jnp.where(s.top_p >= 1.0, n, jnp.maximum(num_kept, 1))
    pth = jnp.take_along_axis(largest, (num_kept - 1)[:, None], axis=-1)
    pth = jnp.where((s.top_p >= 1.0)[:, None], -jnp.inf, pth)
    # min-p: keep tokens with prob >= min_p * max prob, i.e. logit >= max + log(min_p)
    # (log 0 = -inf: min_p = 0 drops nothing).
    mth = top + jnp.log(s.min_p)[:, None]
    return jnp.maximum(jnp.maximum(kth, pth), mth), found


def _noise(seeds: jax.Array, steps: jax.Array, ids: jax.Array | None, vocab: int) -> jax.Array:
    """Each row's Gumbel noise f32[S, n] at the token ids i32[S, n] (None: all V, in order).

    A row's noise at token t is -log(-log(u)), u in [tiny, 1) made from the threefry hash of
    the counter (0, t) under the row's key fold_in(key(seed), step): what
    jax.random.gumbel(key, (V,))[t] gives with jax's partitionable threefry (the default),
    but computed for the ids asked only, and the same whichever tokens are drawn beside t.
    """

    def row(seed, step, ids):
        key = jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), step))
        ids = ids.astype(jnp.uint32)
        bits = jnp.bitwise_xor(*threefry2x32_p.bind(key[0], key[1], jnp.zeros_like(ids), ids))
        mantissa = jax.lax.shift_right_logical(bits, jnp.uint32(32 - 23)) | jnp.uint32(0x3F800000)
        tiny = jnp.finfo(jnp.float32).tiny
        u = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0
        return -jnp.log(-jnp.log(jnp.maximum(tiny, u * (1.0 - tiny) + tiny)))

    if ids is None:
        return jax.vmap(row, in_axes=(0, 0, None))(seeds, steps, jnp.arange(vocab))
    return jax.vmap(row)(seeds, steps, ids)


def apply_logit_bias(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """Adds each row's logit_bias entries to its logits f32[S, V] (padding ids are dropped)."""
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], s.bias_ids.shape)
    ids = jnp.where(s.bias_ids >= 0, s.bias_ids, logits.shape[1])
    return logits.at[rows, ids].add(s.bias_values, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Logits f32[S, V] with the tokens bitmask i32[S, W] disallows set to -inf."""
    vocab = logits.shape[1]
    bits = jnp.arange(32, dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(bitmask, jnp.uint32)
    allowed = ((words[:, :, None] >> bits) & 1).reshape(bitmask.shape[0], -1)[:, :vocab]
    return jnp.where(allowed != 0, logits, -jnp.inf)


def branches_cost_a_sync() -> bool:
    """Whether this platform's XLA runs a conditional by copying its predicate to the host (a
    GPU), so that dispatching a program holding one waits for the work queued before it.
    CPU and TPU run conditionals where they are. (Read while tracing: exporting for another
    platform patches jax.default_backend, as the tests do.)"""
    return jax.default_backend() == "gpu"


def if_needed(needed: jax.Array, fn, skip, *operands):
    """fn(*operands) where `needed` (a traced bool) holds, else skip(*operands), which gives
    what fn would have made of them (fn's work changes nothing where no row needs it): a
    lax.cond where conditionals are free, fn always where they cost a sync (a GPU, for
    which these passes are cheap)."""
    if branches_cost_a_sync():
        return fn(*operands)
    return jax.lax.cond(needed, fn, skip, *operands)


def _with_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """apply_token_bitmask, skipped when every row allows every token (no constraint)."""
    return if_needed(jnp.any(bitmask != -1), apply_token_bitmask, lambda x, _: x, logits, bitmask)


def _with_penalties(logits: jax.Array, s: SamplingInputs, counts: PenaltyCounts) -> jax.Array:
    """apply_penalties, skipped when no row has a penalty (its [S, V] gathers are the cost)."""
    return if_needed(
        jnp.any(penalties_active(s)), apply_penalties, lambda x, *_: x, logits, s, counts
    )


ARGMAX_BLOCK = 128
# Up to this many rows the blocks' maxima are a tree of elementwise maxima, past it a max
# reduction (see _block_max).
TREE_MAX_ROWS = 8


def _first_max(x: jax.Array) -> jax.Array:
    """First index of each row's max, i32[S] (the row's length for a NaN row), from two
    plain reductions: XLA:CPU runs them far faster than argmax's (value, index) reduction."""
    n = x.shape[-1]
    is_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _block_max(blocks: jax.Array) -> jax.Array:
    """Each block's max f32[S, B] of blocks f32[S, B, ARGMAX_BLOCK]. XLA:CPU hands a max
    reduction to YNNPACK, which splits it over XLA's thread pool: at a few rows, in a step
    whose products ran on the C++ kernel's own threads, waking that pool took most of its
    0.06-0.12 ms a step (SmolLM2 int4 at batch 1, benchmarks/cpu_step_profile.py). A tree
    of elementwise maxima halving the block is one loop fusion on the calling thread (~0.01
    ms there); past TREE_MAX_ROWS rows the parallel reduction wins (benchmarks/sampler.py)."""
    if blocks.shape[0] > TREE_MAX_ROWS:
        return jnp.max(blocks, axis=-1)
    assert ARGMAX_BLOCK & (ARGMAX_BLOCK - 1) == 0, "halving needs a power of two"
    while blocks.shape[-1] > 1:
        half = blocks.shape[-1] // 2
        blocks = jnp.maximum(blocks[..., :half], blocks[..., half:])
    return blocks[..., 0]


def _argmax(x: jax.Array) -> jax.Array:
    """First index of each row's max of x f32[S, V], i32[S], as jnp.argmax gives for NaN-free
    rows, in two stages: each block of ARGMAX_BLOCK tokens' max, then the first block holding
    the row's max and the first max inside it. XLA:CPU reduces [S, V / 128, 128] over its
    last axis far faster than [S, V]. The blocks' maxima pass an optimization barrier: XLA
    would otherwise fold the row's max of them back into a max over the whole row, a second
    pass over the logits (benchmarks/sampler.py)."""
    rows, vocab = x.shape
    num_blocks = -(-vocab // ARGMAX_BLOCK)
    x = jnp.pad(x, ((0, 0), (0, num_blocks * ARGMAX_BLOCK - vocab)), constant_values=-jnp.inf)
    blocks = x.reshape(rows, num_blocks, ARGMAX_BLOCK)
    block_max = jax.lax.optimization_barrier(_block_max(blocks))
    block = jnp.minimum(_first_max(block_max), num_blocks - 1)
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    first = block * ARGMAX_BLOCK + _first_max(inside)
    return jnp.minimum(first, vocab - 1)  # a NaN row matches nothing: still a valid id


def _logprobs(
    logits: jax.Array, token_ids: jax.Array, max_logprobs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw logprob of each chosen token f32[S], top-N ids i32[S, N] and logprobs f32[S, N]."""
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, max_logprobs)
    chosen = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)[:, 0]
    return chosen, top_ids.astype(jnp.int32), top_logprobs


class SamplerPlan(enum.Enum):
    """What a step's sampler computes (static: one compiled sampler each), decided on the
    host from its rows (`plan_for`)."""

    GREEDY = "greedy"  # every row greedy with nothing else to do: the argmax
    RANDOM = "random"  # some row samples; none has a penalty, bias, ban, mask or logprobs
    GREEDY_LOGPROBS = "greedy+logprobs"  # GREEDY, and some row wants logprobs
    RANDOM_LOGPROBS = "random+logprobs"  # RANDOM, and some row wants logprobs
    FULL_GREEDY = "greedy+full"  # every row greedy, any other options (GPU only, see widened)
    FULL = "full"  # any options; work no row needs is skipped by if_needed

    @property
    def greedy(self) -> bool:
        """Every row is greedy: the argmax, no vocabulary sort."""
        return self in (SamplerPlan.GREEDY, SamplerPlan.GREEDY_LOGPROBS, SamplerPlan.FULL_GREEDY)

    @property
    def logprobs(self) -> bool:
        return self in (SamplerPlan.GREEDY_LOGPROBS, SamplerPlan.RANDOM_LOGPROBS)

    @property
    def full(self) -> bool:
        return self in (SamplerPlan.FULL_GREEDY, SamplerPlan.FULL)

    def widened(self) -> SamplerPlan:
        """The full plan serving this plan's rows with more options (a token mask): on a GPU
        FULL_GREEDY for greedy rows, so that no sampler sorts the vocabulary for them or
        branches; elsewhere FULL, which skips the sort with a lax.cond when every row is
        greedy (`if_needed`): one compiled sampler fewer per bucket."""
        if self.greedy and branches_cost_a_sync():
            return SamplerPlan.FULL_GREEDY
        return SamplerPlan.FULL


def sampler_plans() -> tuple[SamplerPlan, ...]:
    """The plans `plan_for` gives on this platform (warm-up compiles a sampler for each)."""
    gpu = branches_cost_a_sync()
    return tuple(p for p in SamplerPlan if gpu or p is not SamplerPlan.FULL_GREEDY)


def plan_for(s: SamplingInputs, masked: bool) -> SamplerPlan:
    """The plan of a step whose rows are `s` (host arrays; its token_bitmask is not read),
    `masked`: some row samples under a token bitmask."""
    greedy = bool(np.all(s.temperature == 0.0))
    if np.any(s.num_logprobs >= 0):
        plan = SamplerPlan.GREEDY_LOGPROBS if greedy else SamplerPlan.RANDOM_LOGPROBS
    else:
        plan = SamplerPlan.GREEDY if greedy else SamplerPlan.RANDOM
    if (
        masked
        or np.any(penalties_active(s))
        or np.any(s.bias_ids >= 0)
        or np.any(s.suppressed_ids >= 0)
    ):
        return plan.widened()
    return plan


def _no_logprobs(num_seqs: int, max_logprobs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    return (
        jnp.zeros(num_seqs, jnp.float32),
        jnp.zeros((num_seqs, max_logprobs), jnp.int32),
        jnp.zeros((num_seqs, max_logprobs), jnp.float32),
    )


def _choose(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """Each row's token i32[S]: a greedy row's argmax, else a draw from its filtered
    distribution: the first of its candidates' ids at the max of their filtered logits plus
    the row's Gumbel noise (_filtered's fewest candidates: the same token as over all V)."""
    vocab = logits.shape[1]

    def draw(values: jax.Array, ids: jax.Array | None) -> jax.Array:
        x = values + _noise(s.seeds, s.num_generated, ids, vocab)
        if ids is None:
            return _argmax(x)
        return jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), ids, vocab), axis=-1)

    return jnp.where(s.temperature == 0.0, _argmax(logits), _filtered(logits, s, draw))


def sample(
    logits: jax.Array,
    s: SamplingInputs,
    counts: PenaltyCounts,
    max_logprobs: int,
    plan: SamplerPlan = SamplerPlan.FULL,
) -> SampledTokens:
    """Samples one token per row of logits f32[S, V] as `plan` says (FULL serves any rows;
    the others only those plan_for gives them); `counts` holds every row's tokens so far
    (including this step's fed tokens) at its slot."""
    if plan.full:
        return _sample_full(logits, s, counts, max_logprobs, plan.greedy)
    token_ids = _argmax(logits) if plan.greedy else _choose(logits, s)
    if plan.logprobs:
        return SampledTokens(token_ids, *_logprobs(logits, token_ids, max_logprobs))
    return SampledTokens(token_ids, *_no_logprobs(logits.shape[0], max_logprobs))


def _sample_full(
    logits: jax.Array, s: SamplingInputs, counts: PenaltyCounts, max_logprobs: int, greedy: bool
) -> SampledTokens:
    """`sample` with every option (`greedy`: every row is)."""
    raw_logits = logits
    logits = _with_penalties(apply_logit_bias(logits, s), s, counts)
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], s.suppressed_ids.shape)
    banned = jnp.where(s.suppressed_ids >= 0, s.suppressed_ids, logits.shape[1])
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    logits = _with_bitmask(logits, s.token_bitmask)
    if greedy:
        token_ids = _argmax(logits)
    else:  # the filters and the noise are the expensive part; an all-greedy batch skips them
        token_ids = if_needed(
            jnp.any(s.temperature != 0.0), _choose, lambda x, _: _argmax(x), logits, s
        )
    chosen, top_ids, top_logprobs = if_needed(
        jnp.any(s.num_logprobs >= 0),
        functools.partial(_logprobs, max_logprobs=max_logprobs),
        lambda *_: _no_logprobs(logits.shape[0], max_logprobs),
        raw_logits,
        token_ids,
    )
    return SampledTokens(token_ids, chosen, top_ids, top_logprobs)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["logprobs", "ranks", "top_ids", "top_logprobs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class ScoredLogprobs:
    """Prompt logprobs at the first Z of a step's scored positions (Z = its scored_size;
    meaningless past those in use): each position's distribution over the next token, at
    that token (the target) and its top N."""

    logprobs: jax.Array  # f32[Z]     logprob of the target
    ranks: jax.Array  # i32[Z]     1 + tokens with a higher logprob than the target
    top_ids: jax.Array  # i32[Z, N]  N = EngineConfig.max_logprobs
    top_logprobs: jax.Array  # f32[Z, N]


def scored_sizes(num_scored: int) -> tuple[int, ...]:
    """The sizes score_prompt projects: 16, 64, ... below Q, then Q, so a few scored positions
    do not pay for the LM head over all Q."""
    sizes = []
    size = 16
    while size < num_scored:
        sizes.append(size)
        size *= 4
    return (*sizes, num_scored)


def scored_size(num_used: int, num_scored: int) -> int:
    """The smallest of scored_sizes(Q) that holds `num_used` positions (0 for none)."""
    return next((s for s in scored_sizes(num_scored) if s >= num_used), 0) if num_used else 0


def score_prompt(
    hidden: jax.Array, targets: jax.Array, to_logits, max_logprobs: int, size: int
) -> ScoredLogprobs:
    """Logprobs of `targets` i32[Q] (-1 past the positions in use, which come first) under the
    logits of their positions' hidden states f32[Q, D], for the first `size` (static) of them;
    `to_logits` maps hidden [R, D] -> logits f32[R, V]."""
    raw = jax.nn.log_softmax(to_logits(hidden[:size]), axis=-1)
    target = jnp.maximum(targets[:size], 0)
    chosen = jnp.take_along_axis(raw, target[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(raw > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(raw, max_logprobs)
    return ScoredLogprobs(chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)

"""Ragged paged attention for XLA:CPU (the "xla" backend): reference.py's semantics, with
the work grouped by sequence instead of by token.

The oracle gathers every token's whole cached context -- T x P * page_size slots per layer,
gigabytes a step for a 512-token prefill chunk. Here the step's queries are put in groups
that each belong to one sequence, so a group reads its sequence's keys once:

- decode groups: one per row with exactly one new token (S groups of one query);
- prefill groups: runs of up to `block_q` consecutive new tokens of a row with more
  (at most T / block_q plus one per such row), `groups_per_block` of them per iteration
  of a while loop, as many iterations as the batch needs.

A group attends over its sequence's positions `chunk` at a time, flash-attention style: a
while loop over chunks keeps a running max, sum and weighted value sum in float32, and runs
only as many chunks as the group's latest query position needs, so page-table padding costs
nothing. With a sliding window W each group's chunks start at the page holding the window
start of its earliest query (position - W + 1), so pages wholly before the window are never
gathered: decode over a long context reads about W positions, not the context. Scores are
soft-capped (c * tanh(s / c)) before the mask when the spec asks.

Position p comes from the pages (through the page table) when it was cached before this
step, and from k_new/v_new when it is one of the step's own tokens; a query sees the
positions up to its own (and within its window). What a sequence does not own is never
used: scores are masked with `where`, and values beyond the sequence or before the group's
window are zeroed before the product, so NaN there is harmless. Per chunk the gathered keys
and values are [K, groups, chunk, H], a few MB, so the temporaries stay small enough for the
allocator to reuse step after step (XLA:CPU page-faults freshly mapped temporaries on every
call, which dominates the oracle's time).

Quantized pages (int8 / fp8) are dequantized with their row scales as each chunk is gathered
(kv_cache.dequantize_rows) and enter the products as float32.

Precision: with a float32 KV everything is float32 (equal to the oracle within rounding);
with a 16-bit KV (float16 is the CPU's choice for bfloat16 models) queries, keys,
probabilities and values enter the two products as bfloat16, accumulating in float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ksana_jax.kv_cache import KVCache, dequantize_rows
from ksana_jax.pallas_kernels.attention_args import validate_attention_args
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec


def _cast(x: jax.Array, dtype) -> jax.Array:
    """x in `dtype`, clipped to its range first when that is float16 (never inf)."""
    if jnp.dtype(dtype) == jnp.float16:
        x = jnp.clip(x, -jnp.finfo(jnp.float16).max, jnp.finfo(jnp.float16).max)
    return x.astype(dtype)


class _Rows(NamedTuple):
    """Per-row facts of the step (S rows) that every group looks up by its row."""

    start: jax.Array  # i32[S] offset of the row's first new token in the step
    num_new: jax.Array  # i32[S]
    num_cached: jax.Array  # i32[S]
    page_table: jax.Array  # i32[S, P]


def _attend_groups(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    kv: KVCache,
    layer_index: jax.Array,
    rows: _Rows,
    group_rows: jax.Array,
    positions: jax.Array,
    *,
    spec: AttentionSpec,
    chunk: int,
) -> jax.Array:
    """Attention of query groups, each over its own sequence.

    Args:
      q: [G, B, N, H] queries, B slots per group.
      k_new, v_new: [T, K, H] the step's new keys and values.
      kv, layer_index: the paged KV cache and the layer to read.
      rows: the step's rows.
      group_rows: i32[G] the row every group belongs to.
      positions: i32[G, B] sequence position of each query; -1 for an empty slot.
    Returns: f32[G, B, N, H]; zeros for empty slots.
    """
    num_groups, block_q, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv.pages.shape[2], kv.pages.shape[4]
    group = num_heads // num_kv_heads
    num_tokens = k_new.shape[0]
    pages_per_chunk = chunk // page_size
    max_col = rows.page_table.shape[1] - 1
    start = rows.start[group_rows][:, None]  # [G, 1]
    num_cached = rows.num_cached[group_rows][:, None]  # [G, 1]
    tables = rows.page_table[group_rows]  # [G, P]
    last = jnp.max(positions, axis=1, keepdims=True)  # [G, 1] latest position a group reads
    if spec.sliding_window is None:
        lo = base = jnp.zeros((1, 1), jnp.int32)  # every group reads from position 0
    else:
        earliest = jnp.min(jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max), axis=1)
        lo = jnp.maximum(0, earliest - spec.sliding_window + 1)[:, None]  # [G, 1]
        lo = jnp.minimum(lo, jnp.maximum(last, 0))  # an empty group: 0
        base = lo - lo % page_size  # [G, 1] first position read: a page boundary
    # With a 16-bit KV (a bfloat16 model's) the products take bfloat16 operands, as the
    # model's own matmuls do (XLA:CPU would compute a float16 dot in float32, from operands
    # twice the size); with a float32 KV they are float32. Accumulation is always float32.
    dot_dtype = jnp.bfloat16 if jnp.dtype(kv.pages.dtype).itemsize == 2 else jnp.float32
    # [K, G, B * group, H]: each KV head's queries, the group-heads of a token side by side.
    qg = q.astype(jnp.float32).reshape(num_groups, block_q, num_kv_heads, group, head_dim)
    qg = qg.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, num_groups, block_q * group, head_dim)
    qg = _cast(qg * spec.sm_scale, dot_dtype)
    query_pos = jnp.repeat(positions, group, axis=1)  # [G, B * group]

    def chunk_step(i, carry):
        running_max, denominator, acc = carry
        pos = base + i * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [G or 1, C]
        cols = base // page_size + i * pages_per_chunk + jnp.arange(pages_per_chunk)
        cols = jnp.broadcast_to(jnp.minimum(cols, max_col), (num_groups, pages_per_chunk))
        pages = jnp.take_along_axis(tables, cols, axis=1)  # [G, pages_per_chunk]
        new_index = jnp.clip(start + pos - num_cached, 0, num_tokens - 1)  # [G, C]
        from_pages = (pos < num_cached)[None, :, :, None]  # [1, G, C, 1]

        def read(kv_index, new):  # keys (0) or values (1) of the chunk: [K, G, C, H]
            # Gathered on their own, each fuses into its select instead of being stored.
            cached = kv.pages[layer_index, kv_index, :, pages]  # [G, pages_per_chunk, K, ps, H]
            if kv.quantized:
                cached = dequantize_rows(cached, kv.scales[layer_index, kv_index, :, pages])
            cached = cached.transpose(2, 0, 1, 3, 4).reshape(
                num_kv_heads, num_groups, chunk, head_dim
            )
            new = new[new_index].transpose(2, 0, 1, 3)
            return jnp.where(from_pages, cached, new).astype(dot_dtype)

        # Keys on the left: the dot library repacks (transposes) its right operand on every
        # call, which for keys is the whole chunk, for queries a few rows. The barrier keeps
        # XLA from folding the transpose back into the dot; the probabilities must come out
        # [.., Q, C] with C last, or the second product falls back to a slow generic dot.
        scores = jnp.einsum(
            "kgch,kgqh->kgcq", read(0, k_new), qg, preferred_element_type=jnp.float32
        )
        scores = jax.lax.optimization_barrier(scores).transpose(0, 1, 3, 2)  # [K, G, Q, C]
        if spec.logit_softcap is not None:
            scores = spec.logit_softcap * jnp.tanh(scores / spec.logit_softcap)
        visible = pos[:, None, :] <= query_pos[:, :, None]  # [G, Q, C]
        if spec.sliding_window is not None:
            visible &= pos[:, None, :] > query_pos[:, :, None] - spec.sliding_window
        scores = jnp.where(visible[None], scores, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
        # A query that has seen nothing yet keeps max -inf; shift by 0 so exp gives 0, not NaN.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        probs = jnp.exp(scores - shift[..., None])
        rescale = jnp.exp(running_max - shift)
        denominator = denominator * rescale + jnp.sum(probs, axis=-1)
        # Positions past the group's last query, or before its window, may be NaN (not
        # owned, or poisoned by a test): zero, not mask.
        owned = (pos <= last) & (pos >= lo)  # [G, C]
        values = jnp.where(owned[None, :, :, None], read(1, v_new), 0)
        acc = acc * rescale[..., None] + jnp.einsum(
            "kgqc,kgch->kgqh", probs.astype(dot_dtype), values, preferred_element_type=jnp.float32
        )
        return new_max, denominator, acc

    stats_shape = (num_kv_heads, num_groups, block_q * group)
    init = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros((*stats_shape, head_dim), jnp.float32),
    )
    # Enough chunks for the group reading the most (0 when every slot is empty).
    num_chunks = jnp.max((last - base + chunk) // chunk, initial=0)
    _, denominator, acc = jax.lax.fori_loop(0, num_chunks, chunk_step, init)
    # Every real query sees at least its own key, so only empty slots have a zero sum.
    seen = denominator > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, denominator, 1.0)[..., None], 0.0)
    out = out.reshape(num_kv_heads, num_groups, block_q, group, head_dim)
    return out.transpose(1, 2, 0, 3, 4).reshape(num_groups, block_q, num_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("spec", "chunk", "block_q", "groups_per_block"))
def ragged_paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    kv: KVCache,
    layer_index: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_starts: jax.Array,
    *,
    spec: AttentionSpec,
    chunk: int = 128,
    block_q: int = 64,
    groups_per_block: int | None = None,
) -> jax.Array:
    """reference.ragged_paged_attention (same arguments and result), grouped by sequence.

    Tuning (keyword-only): `chunk` positions per loop step (a multiple of page_size);
    `block_q` queries per prefill group; `groups_per_block` prefill groups per outer loop
    step (default T // block_q + 2: one step for a batch of a few prefill chunks).
    Returns: f32[T, N, H]; zeros for padding tokens.
    """
    validate_attention_args(
        q, k_new, v_new, kv, jnp.asarray(layer_index), page_table, seq_lens, query_starts
    )
    page_size = kv.pages.shape[4]
    if chunk % page_size or chunk <= 0:
        raise ValueError(f"chunk={chunk} must be a positive multiple of page_size={page_size}")
    if block_q < 1:
        raise ValueError(f"block_q={block_q} must be >= 1")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if groups_per_block is None:
        groups_per_block = num_tokens // block_q + 2
    layer_index = jnp.asarray(layer_index, jnp.int32).reshape(())
    start = query_starts[:-1]
    num_new = query_starts[1:] - start
    rows = _Rows(start, num_new, seq_lens - num_new, page_table)
    attend = functools.partial(
        _attend_groups,
        k_new=k_new,
        v_new=v_new,
        kv=kv,
        layer_index=layer_index,
        rows=rows,
        spec=spec,
        chunk=chunk,
    )
    out = jnp.zeros((num_tokens, num_heads, head_dim), jnp.float32)

    # Decode groups: row s's single new token, when it has exactly one.
    decode = num_new == 1
    tokens = jnp.where(decode, start, num_tokens)  # out of range: dropped below
    decoded = attend(
        q[jnp.minimum(tokens, num_tokens - 1)][:, None],
        group_rows=jnp.arange(num_seqs, dtype=jnp.int32),
        positions=jnp.where(decode, seq_lens - 1, -1)[:, None],
    )
    out = out.at[tokens].set(decoded[:, 0], mode="drop")

    # Prefill groups: row s's new tokens in runs of block_q, when it has more than one.
    runs_per_row = jnp.where(num_new > 1, -(-num_new // block_q), 0)  # [S]
    runs_end = jnp.cumsum(runs_per_row)  # [S] runs of rows 0..s
    num_runs = runs_end[-1]

    def prefill_block(b, out):
        run = b * groups_per_block + jnp.arange(groups_per_block, dtype=jnp.int32)  # [G]
        row = jnp.minimum(jnp.searchsorted(runs_end, run, side="right"), num_seqs - 1)
        offset = (run - (runs_end[row] - runs_per_row[row]))[:, None] * block_q
        offset = offset + jnp.arange(block_q, dtype=jnp.int32)  # [G, B] index in the row
        real = (run < num_runs)[:, None] & (offset < num_new[row][:, None])
        tokens = jnp.where(real, start[row][:, None] + offset, num_tokens)
        block = attend(
            q[jnp.minimum(tokens, num_tokens - 1)],
            group_rows=row,
            positions=jnp.where(real, rows.num_cached[row][:, None] + offset, -1),
        )
        return out.at[tokens.reshape(-1)].set(block.reshape(-1, num_heads, head_dim), mode="drop")

    num_blocks = (num_runs + groups_per_block - 1) // groups_per_block
    return jax.lax.fori_loop(0, num_blocks, prefill_block, out)

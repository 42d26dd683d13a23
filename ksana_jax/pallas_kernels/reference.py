"""Pure-jnp oracles for the paged-attention kernels (and the CPU attention backend).

Semantics every backend must reproduce, for the ragged batch described in step_inputs.py:
token t of sequence s at position p attends, with grouped-query heads, to keys 0..p of that
sequence, read through its page table (earlier cached pages and the step's own new tokens,
which are written into the pages before attention). Slots a sequence does not own may hold
anything, NaN included: masking selects with `where`, it never multiplies. Padding tokens
(after query_starts[S]) produce zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv_pages(
    kv: jax.Array,
    layer_index: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_ids: jax.Array,
) -> jax.Array:
    """Scatters one layer's new K/V rows into their slots of the whole KV array.

    Args:
      kv: [L, 2, K, num_pages, page_size, H] the paged KV array.
      layer_index: i32[] the layer being written.
      k_new, v_new: [T, K, H] the step's new keys and values.
      slot_ids: i32[T] flat slot (page * page_size + offset) of each row.
    Returns: kv with exactly those T slots of that layer overwritten.
    """
    num_layers, _, num_kv_heads, num_pages, page_size, head_dim = kv.shape
    flat = kv.reshape(num_layers, 2, num_kv_heads, num_pages * page_size, head_dim)
    new = jnp.stack([k_new, v_new], axis=1).astype(kv.dtype)  # [T, 2, K, H]
    return flat.at[layer_index, :, :, slot_ids].set(new).reshape(kv.shape)


def token_rows_and_positions(
    seq_lens: jax.Array, query_starts: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token slot: its sequence row i32[T], its position i32[T], and whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = seq_lens.shape[0]
    rows = jnp.clip(jnp.searchsorted(query_starts, t, side="right") - 1, 0, num_seqs - 1)
    positions = seq_lens[rows] - (query_starts[rows + 1] - t)
    return rows, positions, t < query_starts[num_seqs]


def ragged_paged_attention(
    q: jax.Array,
    kv: jax.Array,
    layer_index: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_starts: jax.Array,
    *,
    sm_scale: float,
) -> jax.Array:
    """Causal grouped-query attention of a ragged batch over one layer of the paged KV.

    Args:
      q: [T, N, H] queries of the step's new tokens.
      kv: [L, 2, K, num_pages, page_size, H] the paged KV array (new K/V already written).
      layer_index: i32[] the layer to read; pages are gathered straight from `kv`, so no
        copy of the layer is made.
      page_table: i32[S, P] pages of each sequence.
      seq_lens: i32[S] context length of each sequence including its new tokens.
      query_starts: i32[S+1] offsets of each sequence's new tokens in q.
      sm_scale: softmax scale, usually H ** -0.5.
    Returns: f32[T, N, H]; zeros for padding tokens.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv.shape[2], kv.shape[4]
    group = num_heads // num_kv_heads
    pages_per_seq = page_table.shape[1]
    rows, positions, real = token_rows_and_positions(seq_lens, query_starts, num_tokens)

    # Every token's context, gathered in one go: [T, P, 2, K, page_size, H].
    context = kv[layer_index, :, :, page_table[rows]]
    context = context.transpose(0, 2, 3, 1, 4, 5).reshape(
        num_tokens, 2, num_kv_heads, pages_per_seq * page_size, head_dim
    )
    keys, values = context[:, 0], context[:, 1]  # [T, K, P * page_size, H]
    key_pos = jnp.arange(pages_per_seq * page_size, dtype=jnp.int32)
    visible = key_pos[None, :] <= positions[:, None]  # [T, P * page_size]

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgh,tklh->tkgl", qg, keys.astype(jnp.float32)) * sm_scale
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    # Padding tokens may see no key at all; give them a finite row, zeroed below.
    scores = jnp.where(real[:, None, None, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    values = jnp.where(visible[:, None, :, None], values.astype(jnp.float32), 0.0)
    out = jnp.einsum("tkgl,tklh->tkgh", probs, values).reshape(num_tokens, num_heads, head_dim)
    return jnp.where(real[:, None, None], out, 0.0)

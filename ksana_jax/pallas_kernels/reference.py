"""Pure-jnp oracles for the paged-attention kernels (and the CPU attention backend).

Semantics every backend must reproduce, for the ragged batch described in step_inputs.py:
token t of sequence s at position p attends, with grouped-query heads, to keys 0..p of that
sequence -- the ones cached in earlier steps, read from the KV pages through the page table,
and the step's own new keys, passed in directly as k_new/v_new. Slots a sequence does not own,
and the slots of the step's own tokens, may hold anything, NaN included: masking selects
with `where`, it never multiplies. Padding tokens (after query_starts[S]) produce zeros.

The KV is a `kv_cache.KVCache`: pages and, for int8 / fp8 pages, a float32 scale per row.
The writers quantize new rows on write (`kv_cache.quantize_rows`, given float K/V); attention
dequantizes cached rows after the gather (`kv_cache.dequantize_rows`) and takes this step's
k_new/v_new as they are (the model passes them quantized and dequantized already).

Writing: `write_layer_kv` puts one layer's new K/V into its slots (the model does this just
before that layer's attention, see `attend_layer` for why); `write_kv_pages` does every layer
at once, the oracle of the Pallas write kernels.

A layer's whole attention -- rotary on q and k_new, the write, then attention -- is
`attend_layer`, the composition every backend runs unless it has one call for it (the cpu
backend's, ragged_paged_attention_cpu.attend_layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ksana_jax.kv_cache import KVCache, dequantize_rows, quantize_rows, to_kv_dtype
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec


def _scatter_slots(x: jax.Array, index: tuple, new: jax.Array) -> jax.Array:
    """x[index] = new over the flattened slot axis of pages [L, 2, K, num_pages * page_size,
    H] (or of scales [L, 2, K, num_pages * page_size])."""
    flat = x.reshape(*x.shape[:3], x.shape[3] * x.shape[4], *x.shape[5:])
    return flat.at[index].set(new.astype(x.dtype)).reshape(x.shape)


def _write_rows(kv: KVCache, index: tuple, new: jax.Array) -> KVCache:
    """kv with rows new [..., H] at `index` of the slot-flattened pages; quantized pages get
    the rows quantized and their scales written at the same index."""
    if not kv.quantized:
        return KVCache(_scatter_slots(kv.pages, index, new), kv.scales)
    values, scales = quantize_rows(new, kv.pages.dtype)
    return KVCache(
        _scatter_slots(kv.pages, index, values), _scatter_slots(kv.scales, index, scales)
    )


def quantize_new_rows(kv: KVCache, new: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """New K/V rows new [..., H] as `kv`'s pages store them: for quantized pages, the
    quantized rows and their scales f32[...]; for float pages, new as it is and None. The
    Pallas writers store the first with their kernels and the scales with `write_scales`."""
    if not kv.quantized:
        return new, None
    return quantize_rows(new, kv.pages.dtype)


def write_scales(scales: jax.Array, layer_index, new_scales: jax.Array, slot_ids: jax.Array):
    """scales f32[L, 2, K, num_pages, page_size] with new row scales at `slot_ids` i32[T]:
    new_scales f32[L, 2, T, K] into every layer (layer_index None), or f32[2, T, K] into
    layer `layer_index`. A scatter: in place when the scales are donated."""
    if layer_index is None:
        slot_ids, new_scales = _two_rows_at_least(slot_ids, new_scales, axis=2)
        index = (slice(None), slice(None), slice(None), slot_ids)
        return _scatter_slots(scales, index, new_scales.swapaxes(2, 3))  # [L, 2, K, T]
    slot_ids, new_scales = _two_rows_at_least(slot_ids, new_scales, axis=1)
    index = (layer_index, slice(None), slice(None), slot_ids)
    return _scatter_slots(scales, index, new_scales.transpose(1, 0, 2))  # [T, 2, K]


def gather_layer_pages(kv: KVCache, layer_index, page_ids: jax.Array) -> jax.Array:
    """Pages `page_ids` i32[...] of one layer, dequantized if quantized: [..., 2, K,
    page_size, H] (the pages' dtype for float pages, float32 for quantized ones)."""
    pages = kv.pages[layer_index, :, :, page_ids]  # [..., 2, K, page_size, H]
    if not kv.quantized:
        return pages
    return dequantize_rows(pages, kv.scales[layer_index, :, :, page_ids])


def _two_rows_at_least(slot_ids: jax.Array, new: jax.Array, axis: int):
    """A one-row write, padded with a zero row into slot 0 (on page 0, kv_cache.SINK_PAGE,
    which holds nothing anyone reads). XLA turns a one-row scatter into a dynamic-update-slice,
    and copy insertion then copies the whole KV around the attention loops that read it:
    measured 15-19 s per step with SmolLM2's default KV, against 0.1 s at two rows."""
    if slot_ids.shape[0] != 1:
        return slot_ids, new
    pad = [(0, 0)] * new.ndim
    pad[axis] = (0, 1)
    return jnp.concatenate([slot_ids, jnp.zeros(1, slot_ids.dtype)]), jnp.pad(new, pad)


def write_kv_pages(kv: KVCache, new_kv: jax.Array, slot_ids: jax.Array) -> KVCache:
    """Scatters every layer's new K/V rows into their slots of the KV cache.

    Args:
      kv: the paged KV cache (pages [L, 2, K, num_pages, page_size, H] and scales).
      new_kv: [L, 2, T, K, H] each layer's new keys (index 0) and values (index 1), in the
        pages' dtype or (quantized pages) float, quantized here.
      slot_ids: i32[T] flat slot (page * page_size + offset) of each row.
    Returns: kv with exactly those T slots of every layer overwritten (a one-row write also
      zeroes slot 0, on the padding-sink page: see `_two_rows_at_least`).
    """
    slot_ids, new_kv = _two_rows_at_least(slot_ids, new_kv, axis=2)
    return _write_rows(
        kv, (slice(None), slice(None), slice(None), slot_ids), new_kv.swapaxes(2, 3)
    )  # [L, 2, K, T, H]


def write_layer_kv(
    kv: KVCache, layer_index: int, k_new: jax.Array, v_new: jax.Array, slot_ids: jax.Array
) -> KVCache:
    """write_kv_pages for one layer: k_new, v_new [T, K, H] into layer `layer_index`."""
    new = jnp.stack([k_new, v_new], axis=1)  # [T, 2, K, H]
    slot_ids, new = _two_rows_at_least(slot_ids, new, axis=0)
    return _write_rows(kv, (layer_index, slice(None), slice(None), slot_ids), new)


def token_rows_and_positions(
    seq_lens: jax.Array, query_starts: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token slot: its sequence row i32[T], its position i32[T], and whether it is real."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = seq_lens.shape[0]
    # Row of token t: how many later rows start at or before it (a vectorised searchsorted).
    rows = jnp.minimum(jnp.sum(query_starts[None, 1:num_seqs] <= t[:, None], axis=1), num_seqs - 1)
    positions = seq_lens[rows] - (query_starts[rows + 1] - t)
    return rows, positions, t < query_starts[num_seqs]


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
) -> jax.Array:
    """Causal grouped-query attention of a ragged batch over cached pages and new tokens.

    Args:
      q: [T, N, H] queries of the step's new tokens.
      k_new, v_new: [T, K, H] keys and values of the same tokens (not yet in the pages).
      kv: the paged KV cache holding earlier tokens (pages [L, 2, K, num_pages, page_size,
        H], scales when quantized).
      layer_index: i32[] the layer to read; pages are gathered straight from `kv`, so no
        copy of the layer is made.
      page_table: i32[S, P] pages of each sequence.
      seq_lens: i32[S] context length of each sequence including its new tokens.
      query_starts: i32[S+1] offsets of each sequence's new tokens in q.
      spec: the layer's softmax scale, sliding window and logit soft-cap (attention_spec.py).
    Returns: f32[T, N, H]; zeros for padding tokens.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv.pages.shape[2], kv.pages.shape[4]
    group = num_heads // num_kv_heads
    pages_per_seq = page_table.shape[1]
    rows, positions, real = token_rows_and_positions(seq_lens, query_starts, num_tokens)
    num_cached = seq_lens - (query_starts[1:] - query_starts[:-1])  # [S]

    # Cached context of every token, gathered in one go: [T, P, 2, K, page_size, H].
    context = gather_layer_pages(kv, layer_index, page_table[rows])
    context = context.transpose(0, 2, 3, 1, 4, 5).reshape(
        num_tokens, 2, num_kv_heads, pages_per_seq * page_size, head_dim
    )
    cached_pos = jnp.arange(pages_per_seq * page_size, dtype=jnp.int32)
    sees_cached = cached_pos[None, :] < num_cached[rows][:, None]  # [T, P * page_size]
    # The step's own tokens: same sequence, not later, not padding.  [T, T]
    sees_new = (rows[:, None] == rows[None, :]) & (positions[None, :] <= positions[:, None])
    sees_new &= real[None, :]
    if spec.sliding_window is not None:
        oldest = positions - spec.sliding_window  # [T]: keys at or before it are out of the window
        sees_cached &= cached_pos[None, :] > oldest[:, None]
        sees_new &= positions[None, :] > oldest[:, None]

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    cached_scores = jnp.einsum("tkgh,tklh->tkgl", qg, context[:, 0].astype(jnp.float32))
    new_scores = jnp.einsum("tkgh,ukh->tkgu", qg, k_new.astype(jnp.float32))
    visible = jnp.concatenate([sees_cached, sees_new], axis=1)  # [T, P * page_size + T]
    scores = jnp.concatenate([cached_scores, new_scores], axis=-1) * spec.sm_scale
    if spec.logit_softcap is not None:
        scores = spec.logit_softcap * jnp.tanh(scores / spec.logit_softcap)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    # Padding tokens may see no key at all; give them a finite row, zeroed below.
    scores = jnp.where(real[:, None, None, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)

    cached_values = jnp.where(sees_cached[:, None, :, None], context[:, 1], 0.0)
    out = jnp.einsum(
        "tkgl,tklh->tkgh", probs[..., : cached_pos.shape[0]], cached_values.astype(jnp.float32)
    )
    new_values = v_new.astype(jnp.float32)
    out += jnp.einsum("tkgu,ukh->tkgh", probs[..., cached_pos.shape[0] :], new_values)
    out = out.reshape(num_tokens, num_heads, head_dim)
    return jnp.where(real[:, None, None], out, 0.0)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding: x f32[T, heads, H], cos and sin f32[T, H/2] (of each
    token's position, models.layers.rope_tables) -> x * [cos, cos] + [-x2, x1] * [sin, sin]."""
    cos = jnp.concatenate([cos, cos], axis=-1)[:, None, :]  # [T, 1, H]
    sin = jnp.concatenate([sin, sin], axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def split_qkv(qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv f32[T, K, G + 2, H] (per KV head its G query heads, its key and its value: the
    fused q/k/v product's rows, models/fusion.py) -> q [T, K * G, H] (query head k * G + g),
    k [T, K, H], v [T, K, H]."""
    num_tokens, _, _, head_dim = qkv.shape
    return qkv[:, :, :-2].reshape(num_tokens, -1, head_dim), qkv[:, :, -2], qkv[:, :, -1]


def attend_layer(
    qkv: jax.Array,
    kv: KVCache,
    layer_index: int | jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slot_ids: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_starts: jax.Array,
    *,
    spec: AttentionSpec,
    write=write_layer_kv,
    attention=ragged_paged_attention,
) -> tuple[jax.Array, KVCache]:
    """One layer's attention: qkv f32[T, K, G + 2, H] split (`split_qkv`), q and k rotated by
    `rotate`, this step's K/V written into the layer's slots by `write` (write_layer_kv's
    signature), then `attention` (ragged_paged_attention's) -> (f32[T, K * G, H], kv).

    The write comes first and attention reads the written array (earlier tokens from the
    pages, this step's from k_new/v_new). That data dependency orders each layer's page
    reads before the next layer's write, so XLA updates the donated KV in place; reading
    first and writing after lets it schedule the write early and copy the whole array.
    """
    q, k_new, v_new = split_qkv(qkv)
    q, k_new = rotate(q, cos, sin), rotate(k_new, cos, sin)
    # Round through the KV dtype so this step attends to exactly what later steps will read:
    # float pages are written in their dtype; quantized ones are written from float (the
    # writer quantizes), then attention gets the same rows quantized and dequantized.
    dtype = kv.pages.dtype
    if not kv.quantized:
        k_new, v_new = to_kv_dtype(k_new, dtype), to_kv_dtype(v_new, dtype)
    kv = write(kv, layer_index, k_new, v_new, slot_ids)
    if kv.quantized:
        k_new, v_new = to_kv_dtype(k_new, dtype), to_kv_dtype(v_new, dtype)
    layer = jnp.asarray(layer_index, jnp.int32)
    out = attention(q, k_new, v_new, kv, layer, page_table, seq_lens, query_starts, spec=spec)
    return out, kv

"""The jnp oracle of paged attention, checked on cases worked out by hand."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ksana_jax.pallas_kernels.reference import ragged_paged_attention, write_kv_pages


def kv_array(num_pages, page_size, num_kv_heads=1, head_dim=2, fill=np.nan):
    return np.full((1, 2, num_kv_heads, num_pages, page_size, head_dim), fill, np.float32)


def attend(q, kv, page_table, seq_lens, query_starts):
    return np.asarray(
        ragged_paged_attention(
            jnp.asarray(q, jnp.float32),
            jnp.asarray(kv),
            jnp.int32(0),
            jnp.asarray(page_table, jnp.int32),
            jnp.asarray(seq_lens, jnp.int32),
            jnp.asarray(query_starts, jnp.int32),
            sm_scale=1.0,
        )
    )


def test_two_token_prefill_by_hand():
    """Keys k0=(0,0), k1=(ln 3,0); values v0=(4,0), v1=(0,8); both queries (1,0).
    Token 0 sees only k0 -> v0. Token 1 sees scores (0, ln 3) -> probs (1/4, 3/4)
    -> 0.25*v0 + 0.75*v1 = (1, 6). Pages of one slot each, in shuffled order [5, 2]."""
    kv = kv_array(num_pages=8, page_size=1)  # NaN everywhere the sequence does not own
    kv[0, 0, 0, 5, 0] = [0.0, 0.0]
    kv[0, 0, 0, 2, 0] = [math.log(3.0), 0.0]
    kv[0, 1, 0, 5, 0] = [4.0, 0.0]
    kv[0, 1, 0, 2, 0] = [0.0, 8.0]
    q = np.array([[[1.0, 0.0]], [[1.0, 0.0]]])  # [T=2, N=1, H=2]
    out = attend(q, kv, page_table=[[5, 2, 7]], seq_lens=[2], query_starts=[0, 2])
    np.testing.assert_allclose(out[:, 0], [[4.0, 0.0], [1.0, 6.0]], rtol=1e-6)


def test_decode_row_reads_cached_pages_and_gqa_heads_differ():
    """One decode token at position 2 (context 3, page_size 2: pages [3, 1]).
    Head 0 query (0,0): uniform over 3 values -> mean. Head 1 query (big, 0) picks the key
    with the largest first coordinate, k2, so its output is v2."""
    kv = kv_array(num_pages=4, page_size=2)
    keys = [[0.0, 1.0], [1.0, 0.0], [3.0, 0.0]]
    values = [[3.0, 0.0], [0.0, 3.0], [6.0, 6.0]]
    for pos, (k, v) in enumerate(zip(keys, values, strict=True)):
        page, slot = [3, 1][pos // 2], pos % 2
        kv[0, 0, 0, page, slot], kv[0, 1, 0, page, slot] = k, v
    q = np.array([[[0.0, 0.0], [100.0, 0.0]]])  # [T=1, N=2 (one KV head), H=2]
    out = attend(q, kv, page_table=[[3, 1]], seq_lens=[3], query_starts=[0, 1])
    np.testing.assert_allclose(out[0, 0], [3.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(out[0, 1], [6.0, 6.0], rtol=1e-6)


def test_ragged_rows_padding_rows_and_padding_tokens():
    """Row 0: one decode token (context 1) -> its only value. Row 1: padding row (no tokens).
    Token slots after query_starts[-1] are padding and come back as zeros."""
    kv = kv_array(num_pages=3, page_size=4)
    kv[0, :, 0, 2, 0] = [[9.0, 9.0], [7.0, -7.0]]
    q = np.ones((4, 1, 2))
    out = attend(q, kv, page_table=[[2], [0]], seq_lens=[1, 0], query_starts=[0, 1, 1])
    np.testing.assert_allclose(out[0, 0], [7.0, -7.0])
    assert np.all(out[1:] == 0.0)


def test_write_kv_pages_touches_only_the_given_slots():
    kv = jnp.zeros((2, 2, 1, 3, 2, 2), jnp.float32)
    k_new = jnp.array([[[1.0, 2.0]], [[3.0, 4.0]]])  # [T=2, K=1, H=2]
    v_new = -k_new
    out = np.asarray(write_kv_pages(kv, jnp.int32(1), k_new, v_new, jnp.array([5, 2])))
    expected = np.zeros(out.shape, np.float32)
    expected[1, 0, 0, 2, 1], expected[1, 1, 0, 2, 1] = [1.0, 2.0], [-1.0, -2.0]  # slot 5
    expected[1, 0, 0, 1, 0], expected[1, 1, 0, 1, 0] = [3.0, 4.0], [-3.0, -4.0]  # slot 2
    np.testing.assert_array_equal(out, expected)

"""The jnp oracle of paged attention, checked on cases worked out by hand."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ksana_jax.kv_cache import float_kv
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
from ksana_jax.pallas_kernels.reference import ragged_paged_attention, write_kv_pages

NAN = np.nan


def kv_array(num_pages, page_size, num_kv_heads=1, head_dim=2):
    """One layer of KV filled with NaN: every slot a test does not set is 'not owned'."""
    return np.full((1, 2, num_kv_heads, num_pages, page_size, head_dim), NAN, np.float32)


def attend(q, k_new, v_new, kv, page_table, seq_lens, query_starts, spec=None):
    def f32(x):
        return jnp.asarray(x, jnp.float32)

    return np.asarray(
        ragged_paged_attention(
            f32(q),
            f32(k_new),
            f32(v_new),
            float_kv(jnp.asarray(kv)),
            jnp.int32(0),
            jnp.asarray(page_table, jnp.int32),
            jnp.asarray(seq_lens, jnp.int32),
            jnp.asarray(query_starts, jnp.int32),
            spec=spec or AttentionSpec(1.0),
        )
    )


# Keys k0=(0,0), k1=(ln 3,0); values v0=(4,0), v1=(0,8); queries (1,0).
# Token 0 sees only k0 -> v0.  Token 1 sees scores (0, ln 3) -> probs (1/4, 3/4)
# -> 0.25*v0 + 0.75*v1 = (1, 6).
K0, K1 = [0.0, 0.0], [math.log(3.0), 0.0]
V0, V1 = [4.0, 0.0], [0.0, 8.0]


def test_two_token_prefill_by_hand():
    kv = kv_array(num_pages=8, page_size=1)  # nothing cached; the new slots hold NaN too
    q = [[[1.0, 0.0]], [[1.0, 0.0]]]  # [T=2, N=1, H=2]
    out = attend(q, [[K0], [K1]], [[V0], [V1]], kv, [[5, 2, 7]], [2], [0, 2])
    np.testing.assert_allclose(out[:, 0], [[4.0, 0.0], [1.0, 6.0]], rtol=1e-6)


def test_decode_token_merges_cached_page_and_its_own_key():
    """Same numbers, but token 0 was cached earlier in page 5 (page_size 1, shuffled table)."""
    kv = kv_array(num_pages=8, page_size=1)
    kv[0, 0, 0, 5, 0], kv[0, 1, 0, 5, 0] = K0, V0
    out = attend([[[1.0, 0.0]]], [[K1]], [[V1]], kv, [[5, 2]], [2], [0, 1])
    np.testing.assert_allclose(out[0, 0], [1.0, 6.0], rtol=1e-6)


def test_gqa_heads_share_keys_but_not_queries():
    """Context of 3 (page_size 2: positions 0,1 cached in page 3, position 2 new).
    Head 0 query (0,0): uniform -> mean of values. Head 1 query (100,0) picks k1=(3,0)."""
    kv = kv_array(num_pages=4, page_size=2)
    kv[0, 0, 0, 3, :2] = [[0.0, 1.0], [3.0, 0.0]]
    kv[0, 1, 0, 3, :2] = [[3.0, 0.0], [0.0, 3.0]]
    q = [[[0.0, 0.0], [100.0, 0.0]]]  # [T=1, N=2 (one KV head), H=2]
    out = attend(q, [[[1.0, 0.0]]], [[[6.0, 6.0]]], kv, [[3, 1]], [3], [0, 1])
    np.testing.assert_allclose(out[0, 0], [3.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(out[0, 1], [0.0, 3.0], rtol=1e-6)


def test_ragged_rows_padding_rows_and_padding_tokens():
    """Row 0: 2 cached + 1 new token; row 1: first token of a fresh sequence (its only key
    is itself -> its own value); row 2: padding row. Slots after query_starts[-1] are
    padding tokens and come back as zeros, even though the sink page holds NaN."""
    kv = kv_array(num_pages=4, page_size=4)
    kv[0, 0, 0, 2, :2] = [K0, K0]
    kv[0, 1, 0, 2, :2] = [V0, V0]
    q = np.ones((5, 1, 2))
    k_new = [[K1], [[5.0, 5.0]], [K0], [K0], [K0]]
    v_new = [[V1], [[7.0, -7.0]], [V0], [V0], [V0]]
    out = attend(q, k_new, v_new, kv, [[2, 3], [1, 0], [0, 0]], [3, 1, 0], [0, 1, 2, 2])
    # Row 0: scores (0, 0, ln 3) -> probs (1/5, 1/5, 3/5) -> (8/5, 24/5).
    np.testing.assert_allclose(out[0, 0], [1.6, 4.8], rtol=1e-6)
    np.testing.assert_allclose(out[1, 0], [7.0, -7.0], rtol=1e-6)
    assert np.all(out[2:] == 0.0)


def test_sliding_window_hides_keys_older_than_the_window():
    """Window 2: the token at position 2 sees positions 1 and 2 only (transformers' mask
    kv_idx > q_idx - W). Position 0 holds NaN, so reading it at all would poison the output."""
    kv = kv_array(num_pages=8, page_size=1)
    kv[0, 0, 0, 4, 0], kv[0, 1, 0, 4, 0] = K0, V0  # position 1 in page 4; position 0: page 6
    spec = AttentionSpec(1.0, sliding_window=2)
    out = attend([[[1.0, 0.0]]], [[K1]], [[V1]], kv, [[6, 4]], [3], [0, 1], spec=spec)
    np.testing.assert_allclose(out[0, 0], [1.0, 6.0], rtol=1e-6)
    # A prefill of three new tokens: the last one sees positions 1, 2 (window) only (new
    # tokens' values are finite by contract; position 0's would move the output if seen).
    kv = kv_array(num_pages=8, page_size=1)
    k_new, v_new = [[K1], [K0], [K1]], [[[1e3, 1e3]], [V0], [V1]]
    out = attend(np.ones((3, 1, 2)), k_new, v_new, kv, [[1, 2, 3]], [3], [0, 3], spec=spec)
    np.testing.assert_allclose(out[2, 0], [1.0, 6.0], rtol=1e-6)


def test_logit_softcap_bounds_scores():
    """Cap 1: the score 100 of k1 becomes tanh(100) ~ 1, so probabilities (1, e) / (1 + e)."""
    kv = kv_array(num_pages=8, page_size=1)
    kv[0, 0, 0, 5, 0], kv[0, 1, 0, 5, 0] = K0, V0
    spec = AttentionSpec(1.0, logit_softcap=1.0)
    out = attend([[[1.0, 0.0]]], [[[100.0, 0.0]]], [[V1]], kv, [[5, 2]], [2], [0, 1], spec=spec)
    p1 = math.e / (1 + math.e)
    np.testing.assert_allclose(out[0, 0], [4.0 * (1 - p1), 8.0 * p1], rtol=1e-6)


def test_write_kv_pages_touches_only_the_given_slots():
    kv = jnp.zeros((2, 2, 1, 3, 2, 2), jnp.float32)  # [L, 2, K, pages, page_size, H]
    k = np.array([[[1.0, 2.0]], [[3.0, 4.0]]])  # [T=2, K=1, H=2]
    new_kv = np.stack([np.stack([k, -k]), np.stack([10 * k, -10 * k])])  # [L, 2, T, K, H]
    out = write_kv_pages(float_kv(kv), jnp.asarray(new_kv, jnp.float32), jnp.array([5, 2]))
    out = np.asarray(out.pages)
    expected = np.zeros(out.shape, np.float32)
    for layer, scale in ((0, 1.0), (1, 10.0)):
        expected[layer, 0, 0, 2, 1], expected[layer, 1, 0, 2, 1] = scale * k[0, 0], -scale * k[0, 0]
        expected[layer, 0, 0, 1, 0], expected[layer, 1, 0, 1, 0] = scale * k[1, 0], -scale * k[1, 0]
    np.testing.assert_array_equal(out, expected)

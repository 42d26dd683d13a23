"""The paged forward: chunking, page placement and batch mates must not change logits; the
jitted step updates the KV in place (donated, no second KV-sized buffer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksana_jax.config import ModelConfig
from ksana_jax.kv_cache import KVCacheSpec, allocate_kv, resolve_kv_dtype
from ksana_jax.models import registry
from ksana_jax.step import logits_step
from ksana_jax.step_inputs import SequenceChunk, build_step_inputs

CFG = ModelConfig(
    model_type="llama",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)
PAGE = 4
PARAMS = registry.init_params(CFG, seed=3)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 97, 23)]


def run_all_positions(
    chunks_per_step, page_ids, num_pages=40, pages_per_seq=8, num_tokens=32, backend="reference"
):
    """Feeds one sequence in the given chunks; returns logits at every prompt position."""
    kv = allocate_kv(KVCacheSpec.for_model(CFG, num_pages, PAGE, "float32"))
    out, start = [], 0
    for size in chunks_per_step:
        chunk = PROMPT[start : start + size]
        inputs = build_step_inputs(
            [SequenceChunk(chunk, start, page_ids)], PAGE, num_tokens, 1, pages_per_seq
        )
        indices = jnp.arange(size, dtype=jnp.int32)
        logits, kv = logits_step(PARAMS, CFG, kv, inputs, indices, backend)
        out.append(np.asarray(logits))
        start += size
    return np.concatenate(out)


@pytest.mark.parametrize("backend", ["reference", "cpu", "xla"])
def test_chunked_prefill_and_shuffled_pages_match_one_prefill(backend):
    want = run_all_positions([23], list(range(1, 9)))
    shuffled = [int(p) for p in np.random.default_rng(7).permutation(np.arange(1, 40))[:8]]
    for chunks in ([23], [1] * 23, [4, 4, 4, 4, 7], [3, 5, 1, 9, 5], [16, 7]):
        got = run_all_positions(chunks, shuffled, backend=backend)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{backend}, chunks {chunks}")


def test_batch_mates_do_not_change_a_sequence():
    """A sequence decoded beside others (ragged batch, padding rows) equals it run alone."""
    want = run_all_positions([20, 1, 2], list(range(1, 9)))[-1]
    kv = allocate_kv(KVCacheSpec.for_model(CFG, 40, PAGE, "float32"))
    rng = np.random.default_rng(5)
    other = [int(t) for t in rng.integers(0, 97, 30)]
    pages_a, pages_b = list(range(30, 38)), list(range(10, 18))
    steps = [  # A's prefill beside B's; A's decode beside B's next chunk; A alone.
        [SequenceChunk(PROMPT[:20], 0, pages_a), SequenceChunk(other[:12], 0, pages_b)],
        [SequenceChunk(PROMPT[20:21], 20, pages_a), SequenceChunk(other[12:30], 12, pages_b)],
        [SequenceChunk(PROMPT[21:23], 21, pages_a)],
    ]
    for chunks in steps:
        inputs = build_step_inputs(chunks, PAGE, 32, 4, 8)
        last = np.asarray(inputs.query_starts[1 : len(chunks) + 1]) - 1
        logits, kv = logits_step(PARAMS, CFG, kv, inputs, jnp.asarray(last, jnp.int32))
    a_last = np.asarray(logits)[0]
    np.testing.assert_allclose(a_last, want, atol=1e-5)


def test_padding_tokens_never_touch_owned_pages():
    kv = allocate_kv(KVCacheSpec.for_model(CFG, 12, PAGE, "float32"))
    inputs = build_step_inputs([SequenceChunk(PROMPT[:5], 0, [3, 4])], PAGE, 16, 2, 2)
    _, kv = logits_step(PARAMS, CFG, kv, inputs, jnp.zeros(1, jnp.int32))
    kv = np.asarray(kv.pages)
    written = np.zeros(kv.shape[3:5], bool)  # [num_pages, page_size]
    written[3, :] = True
    written[4, 0] = True
    assert np.all(kv[:, :, :, written] != 0)  # the sequence's 5 slots were written
    untouched = ~written
    untouched[0] = False  # the sink page takes the padding tokens' writes
    assert np.all(kv[:, :, :, untouched] == 0)


# A one-token step too: XLA rewrites a one-row scatter as a dynamic-update-slice, which used
# to make copy insertion copy the whole KV around every layer's attention loops.
@pytest.mark.parametrize("num_tokens,num_rows", [(32, 4), (1, 1)])
@pytest.mark.parametrize("backend", ["reference", "cpu", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_donates_kv_and_holds_no_second_copy(dtype, backend, num_tokens, num_rows):
    # The KV dtype is what resolve_kv_dtype picks here (on CPU: float32, float16).
    kv_dtype = resolve_kv_dtype("auto", dtype, jax.default_backend())
    spec = KVCacheSpec.for_model(CFG, 2048, 16, kv_dtype)  # KV >> params and activations
    kv = allocate_kv(spec)
    params = jax.tree.map(lambda x: x.astype(dtype), PARAMS)
    chunk = SequenceChunk(PROMPT[:num_tokens], 0, range(1, 3))
    inputs = build_step_inputs([chunk], 16, num_tokens, num_rows, 8)
    idx = jnp.zeros(num_rows, jnp.int32)
    compiled = logits_step.lower(params, CFG, kv, inputs, idx, backend).compile()
    stats = compiled.memory_analysis()
    assert stats is not None
    # The KV output is aliased to the donated input...
    assert stats.alias_size_in_bytes >= spec.nbytes
    # ...and no temporary or extra output of KV size exists -- not even one layer's copy
    # (a quarter of the KV here), which would cost a full KV read per step.
    assert stats.temp_size_in_bytes < spec.nbytes // 4, stats
    assert stats.output_size_in_bytes - stats.alias_size_in_bytes < spec.nbytes // 4, stats
    _, new_kv = compiled(params, kv, inputs, idx)
    assert kv.pages.is_deleted()  # donated: the caller's buffer was consumed
    assert new_kv.pages.shape == spec.shape


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_recompile_for_same_bucket(dtype):
    params = jax.tree.map(lambda x: x.astype(dtype), PARAMS)
    kv = allocate_kv(KVCacheSpec.for_model(CFG, 40, PAGE, dtype))
    for n, start in ((5, 0), (3, 5), (8, 8)):
        inputs = build_step_inputs(
            [SequenceChunk(PROMPT[start : start + n], start, range(1, 9))], PAGE, 16, 2, 8
        )
        _, kv = logits_step(params, CFG, kv, inputs, jnp.zeros(2, jnp.int32))
    before = logits_step._cache_size()
    inputs = build_step_inputs([SequenceChunk(PROMPT[:2], 16, range(1, 9))], PAGE, 16, 2, 8)
    _, kv = logits_step(params, CFG, kv, inputs, jnp.zeros(2, jnp.int32))
    assert logits_step._cache_size() == before

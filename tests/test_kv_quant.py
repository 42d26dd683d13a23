"""Quantized KV caches (kv_cache_dtype int8 / fp8): the row quantizer's error bounds, every
backend that reads quantized pages (the Pallas ones in interpret mode) against the jnp oracle
given the dequantized pages, every writer, and the engine on a tiny model (greedy, zero
recompilations, prefix caching, chunked prefill)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_VOCAB, write_tiny_hf
from jax.experimental.pallas import tpu as pltpu
from workloads import record_compilations, run_varied_workload

import ksana_jax
from ksana_jax import LLM, EngineConfig, SamplingParams
from ksana_jax.kv_cache import (
    KVCache,
    KVCacheSpec,
    dequantize_rows,
    float_kv,
    quantize_rows,
    resolve_kv_dtype,
)
from ksana_jax.pallas_kernels import BACKENDS, ragged_paged_attention_tpu, reference
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
from ksana_jax.step_programs import compile_count

QUANTIZED = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
PAGE_SIZE, NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ = 8, 24, 4, 6
# Mosaic tiles 8-bit arrays in (32, 128): pallas_tpu reads int8 / fp8 pages of 32k rows.
BACKEND_PAGE_SIZE = {"pallas_tpu": 32}


def rows_for(page_size: int) -> list[tuple[int, int]]:
    """(cached, new) per row: page tails (5, page + 1, 2 pages + 1 cached), a decode row,
    a fresh prefill."""
    return [(2 * page_size + 1, 1), (page_size + 1, 6), (0, 5), (5, 3)]


ROWS = rows_for(PAGE_SIZE)


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantize_round_trip_error_is_bounded(name):
    dtype = QUANTIZED[name]
    x = jax.random.normal(jax.random.key(0), (64, 4, 64)) * jnp.exp(
        jax.random.normal(jax.random.key(1), (64, 4, 1))  # rows of very different sizes
    )
    x = x.at[3, 1].set(0.0)  # an all-zero row: scale 0, values 0
    values, scales = quantize_rows(x, dtype)
    assert values.dtype == dtype and scales.dtype == jnp.float32 and scales.shape == (64, 4)
    back = np.asarray(dequantize_rows(values, scales))
    x, scales = np.asarray(x), np.asarray(scales)[..., None]
    assert np.all(back[3, 1] == 0.0) and scales[3, 1] == 0.0
    err = np.abs(back - x)
    if name == "int8":  # round to nearest on a grid of step scale
        assert np.all(err <= 0.5 * scales * (1 + 1e-6))
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormals below 2^-6 on a 2^-9 grid
        assert np.all(err <= np.maximum(np.abs(x) * 2.0**-4, scales * 2.0**-10) * (1 + 1e-6))
    # The largest entry of each row is exact up to float rounding: it maps to +-qmax.
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(np.abs(back).max(-1), amax, rtol=1e-6)


def quantized_batch(dtype, num_kv_heads=2, group=2, head_dim=32, seed=0, page_size=PAGE_SIZE):
    """Attention arguments with quantized pages (NaN scales in every slot no row owns), and
    the same batch with the pages dequantized into a float KV."""
    PAGE_SIZE, ROWS = page_size, rows_for(page_size)  # the module's names, shadowed
    rng = np.random.default_rng(seed)
    num_pages = 1 + NUM_SEQS * PAGES_PER_SEQ
    pages = np.full((2, 2, num_kv_heads, num_pages, PAGE_SIZE, head_dim), np.nan, np.float32)
    page_table = np.zeros((NUM_SEQS, PAGES_PER_SEQ), np.int32)
    seq_lens = np.zeros(NUM_SEQS, np.int32)
    query_starts = np.zeros(NUM_SEQS + 1, np.int32)
    free = iter(rng.permutation(np.arange(1, num_pages)))
    offset = 0
    for s, (cached, new) in enumerate(ROWS):
        page_table[s, : -(-(cached + new) // PAGE_SIZE)] = [
            next(free) for _ in range(-(-(cached + new) // PAGE_SIZE))
        ]
        for pos in range(cached):
            slot = (1, slice(None), slice(None), page_table[s, pos // PAGE_SIZE], pos % PAGE_SIZE)
            pages[slot] = rng.standard_normal((2, num_kv_heads, head_dim)) * rng.uniform(0.1, 3)
        seq_lens[s], query_starts[s] = cached + new, offset
        offset += new
    query_starts[len(ROWS) :] = offset
    values, scales = quantize_rows(jnp.asarray(pages), dtype)  # NaN rows: NaN scales
    kv = KVCache(values, scales)
    dequantized = float_kv(dequantize_rows(values, scales))

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    k_new, v_new = (
        normal(NUM_TOKENS, num_kv_heads, head_dim),
        normal(NUM_TOKENS, num_kv_heads, head_dim),
    )
    rest = (jnp.int32(1), jnp.asarray(page_table), jnp.asarray(seq_lens), jnp.asarray(query_starts))
    q = normal(NUM_TOKENS, num_kv_heads * group, head_dim)
    return (q, k_new, v_new, kv, *rest), (q, k_new, v_new, dequantized, *rest)


READERS = [name for name, b in BACKENDS.items() if "int8" in b.kv_dtypes]
WRITERS = ["reference", *(name for name in READERS if BACKENDS[name].writer_module)]


def backend_fns(backend: str):
    """The backend's (attention, layer KV write, every-layer KV write), interpreted on CPU
    where it is a Pallas backend."""
    b = BACKENDS[backend]
    interpret = b.interpreted_here()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "runs in Pallas interpret mode"
        return b.attention(interpret), b.layer_kv_writer(interpret), b.kv_writer(interpret)


@pytest.mark.parametrize("name", sorted(QUANTIZED))
@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize(
    "spec",
    [AttentionSpec(32**-0.5), AttentionSpec(0.2, sliding_window=7, logit_softcap=5.0)],
    ids=["plain", "window_softcap"],
)
def test_backend_on_quantized_pages_equals_the_oracle_on_dequantized_ones(name, backend, spec):
    page_size = BACKEND_PAGE_SIZE.get(backend, PAGE_SIZE)
    args, dequantized_args = quantized_batch(QUANTIZED[name], page_size=page_size)
    want = np.asarray(reference.ragged_paged_attention(*dequantized_args, spec=spec))
    got = np.asarray(backend_fns(backend)[0](*args, spec=spec))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert np.all(got[sum(n for _, n in ROWS) :] == 0.0)  # padding tokens


def test_tpu_kernel_on_quantized_pages_under_tpu_interpret_semantics(capsys):
    """pltpu.InterpretParams (NaN-filled VMEM, a DMA lands only when waited on, the race
    detector): the scales' DMAs share the pages' semaphores and buffer slots."""
    args, dequantized_args = quantized_batch(jnp.int8, page_size=32)
    spec = AttentionSpec(0.2, sliding_window=40)
    attention = functools.partial(
        ragged_paged_attention_tpu.ragged_paged_attention,
        pages_per_block=2,
        interpret=pltpu.InterpretParams(detect_races=True),
    )
    want = np.asarray(reference.ragged_paged_attention(*dequantized_args, spec=spec))
    np.testing.assert_allclose(np.asarray(attention(*args, spec=spec)), want, rtol=0, atol=2e-5)
    assert "RACE DETECTED" not in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(QUANTIZED))
@pytest.mark.parametrize("backend", WRITERS)
@pytest.mark.parametrize("layers", ["one", "all"])
def test_quantized_write_stores_the_quantized_rows_and_their_scales(name, backend, layers):
    dtype, page_size = QUANTIZED[name], BACKEND_PAGE_SIZE.get(backend, PAGE_SIZE)
    spec = KVCacheSpec(2, 2, 5, page_size, 16, jnp.dtype(dtype).name)
    kv = KVCache(jnp.zeros(spec.shape, dtype), jnp.full(spec.scales_shape, 7.0))
    new = jax.random.normal(jax.random.key(0), (2, 2, 3, 2, 16))  # [L, 2, T, K, H]
    new *= jnp.exp(jax.random.normal(jax.random.key(1), (2, 2, 3, 2, 1)))  # rows' sizes differ
    slot_list = [page_size + 1, page_size + 2, 4 * page_size + 1]  # two pages, one shared
    slots = jnp.array(slot_list, jnp.int32)
    _, write_layer, write_all = backend_fns(backend)
    if layers == "one":
        out, written = write_layer(kv, 1, new[1, 0], new[1, 1], slots), [1]
    else:
        out, written = write_all(kv, new, slots), [0, 1]
    touched = np.zeros(spec.scales_shape, bool)
    for layer in written:
        values, scales = quantize_rows(new[layer], dtype)  # [2, T, K, H], [2, T, K]
        for t, slot in enumerate(slot_list):
            page, row = divmod(slot, page_size)
            touched[layer, :, :, page, row] = True
            for which in (0, 1):
                got = np.asarray(out.pages[layer, which, :, page, row].astype(jnp.float32))
                np.testing.assert_array_equal(got, values[which, t].astype(jnp.float32))
                np.testing.assert_array_equal(
                    out.scales[layer, which, :, page, row], scales[which, t]
                )
    assert np.all(np.asarray(out.scales)[~touched] == 7.0)  # nothing else moved
    untouched = ~np.broadcast_to(touched[..., None], spec.shape)
    assert np.all(np.asarray(out.pages.astype(jnp.float32))[untouched] == 0)


def test_quantized_kv_takes_fewer_bytes_and_more_pages_fit():
    cfg = ksana_jax.config.ModelConfig(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    )  # SmolLM2-135M's attention shapes
    per_token = {
        d: KVCacheSpec.for_model(cfg, 2, 16, resolve_kv_dtype(d, "float32", "cpu")).bytes_per_page
        // 16
        for d in ("bfloat16", "int8", "fp8")
    }
    # 30 layers x 2 x 3 heads x 64 x 2 bytes; quantized: 1 byte + 4 bytes of scale per row.
    assert per_token == {"bfloat16": 23040, "int8": 11520 + 720, "fp8": 11520 + 720}
    from ksana_jax.runner import resolve_num_pages

    budget = EngineConfig(kv_cache_memory_gib=0.5, max_model_len=1024)
    pages = {
        d: resolve_num_pages(budget, cfg, resolve_kv_dtype(d, "float32", "cpu"))
        for d in ("bfloat16", "int8")
    }
    assert abs(pages["int8"] - pages["bfloat16"] * 23040 / 12240) <= 1  # 1.88x the pages


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tinykv") / "hf"
    write_tiny_hf(path)
    return ksana_jax.load(path)


ENGINE = dict(
    max_model_len=256,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    context_buckets=(64, 256),
    num_pages=70,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [
    [int(t) for t in np.random.default_rng(i).integers(3, TINY_VOCAB, n)]
    for i, n in ((0, 37), (1, 5), (2, 22))
]
SHARED = PROMPTS[0][:24]  # six full pages a second prompt shares with the first


def greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_engine_with_a_quantized_kv_never_recompiles(tiny_model, name):
    compiles = record_compilations()
    llm = LLM(tiny_model, kv_cache_dtype=name, **ENGINE)
    assert llm.engine.runner.kv.pages.dtype == QUANTIZED[name]
    warm = compile_count()
    compiles.clear()
    run_varied_workload(llm.engine, TINY_VOCAB)
    assert compile_count() == warm and compiles == []
    # Its first greedy token is the argmax of the model's logits through the same KV dtype.
    model = ksana_jax.model.dataclasses.replace(tiny_model, kv_cache_dtype=name)
    got = greedy(llm, PROMPTS[:1])[0]
    assert got[0] == int(model.logits(PROMPTS[0])[-1].argmax())


def test_quantized_kv_with_prefix_caching_and_chunked_prefill(tiny_model):
    """Rows are quantized one by one, so what a page holds does not depend on how the
    prompt was split into chunks or whether its pages came from the prefix cache."""
    prompts = [*PROMPTS, SHARED + PROMPTS[1]]
    want = [
        greedy(LLM(tiny_model, kv_cache_dtype="int8", enable_prefix_caching=False, **ENGINE), [p])[
            0
        ]
        for p in prompts
    ]
    chunked = dict(ENGINE, max_num_batched_tokens=16, token_buckets=(16,))
    for caching in (True, False):
        llm = LLM(tiny_model, kv_cache_dtype="int8", enable_prefix_caching=caching, **chunked)
        assert greedy(llm, prompts[:1]) == want[:1]
        assert greedy(llm, prompts) == want
        assert (llm.engine.stats.prefix_cache_hits > 0) == caching


def test_bad_kv_cache_dtype_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ksana_jax.load("demo", kv_cache_dtype="fp16")
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match=r"page_size=4 must be a multiple of 32 for a int8"):
        LLM(tiny_model, kv_cache_dtype="int8", attention_backend="pallas_tpu", **ENGINE)


@pytest.mark.parametrize("capability,refused", [("8.0", True), ("8.6", True), ("8.9", False)])
def test_pallas_gpu_reads_fp8_pages_from_compute_capability_8_9(capability, refused):
    shape = (2, 2, 2, 9, 16, 64)
    check = functools.partial(BACKENDS["pallas_gpu"].check, compute_capability=capability)
    check(shape, "int8")
    if refused:
        with pytest.raises(ValueError, match=r"float8_e4m3fn KV cache only on compute capab"):
            check(shape, "float8_e4m3fn")
    else:
        check(shape, "float8_e4m3fn")

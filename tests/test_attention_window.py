"""Sliding-window and logit soft-cap attention: every backend equals the reference (the
Pallas kernels in interpret mode), and no backend reads a KV position before a row's window.

The oracle's window and soft-cap are checked on hand-worked cases in
test_reference_attention.py; here the kernels are held to it. Every cached position before
the window start of a row's earliest query is NaN (so pages wholly before the window are NaN
in every slot, and the window's first page is NaN up to the window start), as is every slot
the batch does not own: a kernel that reads such a slot and multiplies it by zero gives NaN.
The cpu kernel, and the TPU kernel under TPU interpret semantics, also get out-of-range page
ids for pages wholly before the window: the cpu kernel checks every page id it will read and
the TPU interpreter raises on an out-of-bounds DMA, so a read there would be an error.

One bucket (T=64 tokens, S=6 rows, P=8 pages of 8) and scale 0.1 (not head_dim ** -0.5:
Gemma's query_pre_attn_scalar) for every case, so each (backend, spec, heads) compiles once.
Windows of 5 (inside one page), 8 (one page) and 20 (starting mid-page) against contexts
shorter than, equal to and longer than them; decode rows, prefill chunks longer than the
window (the window inside the step's own new keys), chunks starting mid-page, mixed batches;
GQA ratios 1 and 4. Soft-cap alone and with a window.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from ksana_jax.kv_cache import float_kv
from ksana_jax.pallas_kernels import (
    paged_attention_gpu,
    ragged_paged_attention_cpu,
    ragged_paged_attention_tpu,
    ragged_paged_attention_xla,
    reference,
)
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec

PAGE_SIZE = 8
NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ = 64, 6, 8
NUM_PAGES = 1 + NUM_SEQS * PAGES_PER_SEQ  # page 0 is the sink
SCALE = 0.1
ATOL = 5e-5  # outputs of magnitude ~3 (queries and keys scaled by 3)

# Rows as (cached tokens, new tokens).
SCENARIOS = {
    # contexts 1, 5, 8, 20, 21, 37 (mid-page window starts), 63 (the page table's end)
    "decode": [(0, 1), (4, 1), (7, 1), (19, 1), (20, 1), (36, 1)],
    "decode_long": [(62, 1), (45, 1), (50, 1)],
    # fresh prefill longer than every window; chunks after a cached prefix, starting
    # mid-page and on a page boundary
    "prefill": [(0, 30), (13, 22), (24, 12)],
    "mixed": [(40, 1), (5, 27), (0, 1), (57, 1), (17, 15), (8, 8)],
}
SPECS = {
    "window5": AttentionSpec(SCALE, sliding_window=5),
    "window8": AttentionSpec(SCALE, sliding_window=8),
    "window20": AttentionSpec(SCALE, sliding_window=20),
    "softcap": AttentionSpec(SCALE, logit_softcap=2.0),
    "window20_softcap": AttentionSpec(SCALE, sliding_window=20, logit_softcap=1.5),
}
HEADS = [(2, 1, 64), (1, 4, 32)]  # (KV heads, query heads per KV head, head dim)

BACKENDS = {
    "cpu": ragged_paged_attention_cpu.ragged_paged_attention,
    # 16-position chunks: a window spans several loop steps.
    "xla": functools.partial(
        ragged_paged_attention_xla.ragged_paged_attention, chunk=16, block_q=16
    ),
    # 2-page blocks: a window starts inside a block; prefetch crosses rows.
    "pallas_tpu": functools.partial(
        ragged_paged_attention_tpu.ragged_paged_attention, pages_per_block=2, interpret=True
    ),
    # 16-key blocks and 2 key splits: windows start mid-block, some splits see nothing.
    "pallas_gpu": functools.partial(
        paged_attention_gpu.ragged_paged_attention, block_k=16, num_kv_splits=2, interpret=True
    ),
}


def window_start(num_cached: int, spec: AttentionSpec) -> int:
    """The earliest position any of a row's queries sees (its first new token's window)."""
    return 0 if spec.sliding_window is None else max(0, num_cached - spec.sliding_window + 1)


def make_batch(rows, spec, *, num_kv_heads, group, head_dim, seed=0, bad_page_ids=False):
    """The attention arguments for `rows`, with NaN in every KV slot the batch does not own
    and in every cached position before its row's window start; `bad_page_ids`: page-table
    entries of pages wholly before the window are out of range."""
    rng = np.random.default_rng(seed)
    kv = np.full((2, 2, num_kv_heads, NUM_PAGES, PAGE_SIZE, head_dim), np.nan, np.float32)
    page_table = rng.integers(0, NUM_PAGES, (NUM_SEQS, PAGES_PER_SEQ)).astype(np.int32)
    page_table[len(rows) :] = 0
    seq_lens = np.zeros(NUM_SEQS, np.int32)
    query_starts = np.zeros(NUM_SEQS + 1, np.int32)
    free_pages = iter(rng.permutation(np.arange(1, NUM_PAGES)))
    offset = 0
    for s, (num_cached, num_new) in enumerate(rows):
        num_pages = -(-(num_cached + num_new) // PAGE_SIZE)
        page_table[s, :num_pages] = [next(free_pages) for _ in range(num_pages)]
        start = window_start(num_cached, spec)
        for pos in range(start, num_cached):
            page = page_table[s, pos // PAGE_SIZE]
            kv[1, :, :, page, pos % PAGE_SIZE] = rng.standard_normal((2, num_kv_heads, head_dim))
        if bad_page_ids:
            page_table[s, : start // PAGE_SIZE] = NUM_PAGES + 7
        seq_lens[s] = num_cached + num_new
        query_starts[s] = offset
        offset += num_new
    query_starts[len(rows) :] = offset

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 3)

    num_heads = num_kv_heads * group
    return (
        normal(NUM_TOKENS, num_heads, head_dim),
        normal(NUM_TOKENS, num_kv_heads, head_dim),
        normal(NUM_TOKENS, num_kv_heads, head_dim),
        float_kv(jnp.asarray(kv)),
        jnp.int32(1),
        jnp.asarray(page_table),
        jnp.asarray(seq_lens),
        jnp.asarray(query_starts),
    )


@pytest.mark.parametrize("num_kv_heads,group,head_dim", HEADS)
@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backend_matches_reference(backend, spec_name, num_kv_heads, group, head_dim):
    spec = SPECS[spec_name]
    for seed, (name, rows) in enumerate(SCENARIOS.items()):
        args = make_batch(
            rows, spec, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, seed=seed
        )
        want = np.asarray(reference.ragged_paged_attention(*args, spec=spec))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = np.asarray(BACKENDS[backend](*args, spec=spec))
        assert not np.isnan(want).any(), "the oracle must not read the poisoned slots either"
        assert not np.isnan(got).any(), f"scenario {name!r}: read a slot outside the window"
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=f"scenario {name!r}")


def test_window_changes_the_result():
    """The cases above are not vacuous: a window or a cap changes what attention returns."""
    rows = SCENARIOS["mixed"]
    args = make_batch(rows, AttentionSpec(SCALE), num_kv_heads=2, group=1, head_dim=64)
    full = np.asarray(reference.ragged_paged_attention(*args, spec=AttentionSpec(SCALE)))
    for spec in SPECS.values():
        got = np.asarray(reference.ragged_paged_attention(*args, spec=spec))
        assert np.abs(got - full).max() > 1e-3, spec


def test_cpu_kernel_never_reads_pages_before_the_window():
    """Page ids before the window are out of range: the cpu kernel checks every id it will
    read (a bad one is an error, see test_pallas_attention.py), so these are never read."""
    spec = SPECS["window8"]
    for name in ("decode_long", "mixed"):
        args = make_batch(
            SCENARIOS[name], spec, num_kv_heads=2, group=1, head_dim=64, bad_page_ids=True
        )
        assert int(args[5].max()) >= NUM_PAGES
        clean = make_batch(SCENARIOS[name], spec, num_kv_heads=2, group=1, head_dim=64)
        got = ragged_paged_attention_cpu.ragged_paged_attention(*args, spec=spec)
        want = reference.ragged_paged_attention(*clean, spec=spec)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL)


def test_bf16_kv_with_window_and_softcap():
    spec = SPECS["window20_softcap"]
    for backend in ("cpu", "xla"):
        args = list(make_batch(SCENARIOS["mixed"], spec, num_kv_heads=2, group=1, head_dim=64))
        args[1:3] = [a.astype(jnp.bfloat16) for a in args[1:3]]
        args[3] = float_kv(args[3].pages.astype(jnp.bfloat16))
        want = np.asarray(reference.ragged_paged_attention(*args, spec=spec))
        got = np.asarray(BACKENDS[backend](*args, spec=spec))
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-2, err_msg=backend)


def test_kernels_under_a_layer_scan():
    """Window and cap stay static inside a lax.scan over layers (how models call them)."""
    spec = SPECS["window20_softcap"]
    args = make_batch(SCENARIOS["mixed"], spec, num_kv_heads=2, group=1, head_dim=64)
    want = np.asarray(reference.ragged_paged_attention(*args, spec=spec))
    for backend in ("cpu", "xla"):

        def body(carry, _, backend=backend):
            return carry, BACKENDS[backend](*args, spec=spec)

        _, got = jax.lax.scan(body, 0, None, length=2)
        np.testing.assert_allclose(np.asarray(got[1]), want, rtol=0, atol=ATOL)


def test_tpu_kernel_under_tpu_interpret_semantics(capsys):
    """TPU semantics (`pltpu.InterpretParams`): uninitialised VMEM is NaN, out-of-bounds
    reads raise, DMAs land only when waited on, races are reported -- with window blocks
    that start mid-row and prefetch that crosses rows. Pages wholly before the window have
    out-of-range page ids, so a DMA of one would raise."""
    spec = SPECS["window20_softcap"]
    attention = functools.partial(
        ragged_paged_attention_tpu.ragged_paged_attention,
        pages_per_block=2,
        interpret=pltpu.InterpretParams(detect_races=True),
    )
    for name in ("decode_long", "mixed"):
        rows = SCENARIOS[name]
        args = make_batch(rows, spec, num_kv_heads=1, group=4, head_dim=32, bad_page_ids=True)
        assert int(args[5].max()) >= NUM_PAGES
        clean = make_batch(rows, spec, num_kv_heads=1, group=4, head_dim=32)
        want = np.asarray(reference.ragged_paged_attention(*clean, spec=spec))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = np.asarray(attention(*args, spec=spec))
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=name)
    assert "RACE DETECTED" not in capsys.readouterr().out


@pytest.mark.tpu
@pytest.mark.gpu
@pytest.mark.parametrize("spec_name", ["window20", "window20_softcap"])
def test_compiled_kernel_matches_reference_on_device(spec_name):
    """The compiled kernel (not the interpreter) on the TPU or GPU this runs on."""
    kernels = {
        "tpu": ragged_paged_attention_tpu.ragged_paged_attention,
        "gpu": paged_attention_gpu.ragged_paged_attention,
    }
    platform = jax.default_backend()
    if platform not in kernels:
        pytest.skip(f"needs a TPU or GPU, running on {platform}")
    spec = SPECS[spec_name]
    with jax.default_matmul_precision("highest"):  # the oracle's f32 dots, not TF32/bf16
        for num_kv_heads, group, head_dim in HEADS:
            for seed, (name, rows) in enumerate(SCENARIOS.items()):
                args = make_batch(
                    rows, spec, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, seed=seed
                )
                want = np.asarray(reference.ragged_paged_attention(*args, spec=spec))
                got = np.asarray(kernels[platform](*args, spec=spec))
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-4, err_msg=name)

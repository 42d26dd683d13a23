"""Every attention kernel equals the jnp oracle: the Pallas ones in interpret mode on CPU, and
the CPU backends -- "cpu" (the C++ kernel, built here) and "xla" (the oracle's semantics
grouped by sequence) -- compiled.

(The oracle itself is checked on cases worked out by hand in test_reference_attention.py.)

One bucket shape for every case -- T=64 tokens, S=6 rows, P=8 pages of 16 -- so each
(kernel, heads, head dim, dtype) compiles once and the scenarios reuse it. Every KV slot
the batch does not own holds NaN: the other layer, unowned pages, the sink page that
padding rows point at, and the slots of the step's own new tokens (they are passed as
k_new/v_new, not read from the pages). Page tables are shuffled, and their unused
entries point at random pages.

Matrix (188 kernel-vs-oracle comparisons): 7 scenarios (decode rows at context 1,
page_size - 1, page_size, page_size + 1 and several pages; fresh prefills; chunks starting
mid-page, on a page boundary and crossing pages; mixed batches; a chunk filling the
bucket; no padding at all; all padding) x GQA ratios 1, 3, 4, 8 with head dims 64 and 128
x the four kernels in f32 (max abs diff <= 1e-5: 112); bf16 KV on 4 scenarios x 2 head
configs x 4 kernels (32); float16 KV (the CPU's for bfloat16 models) on the 7 scenarios x 2
head configs x the 2 CPU kernels (28); other tuning -- key splits, block sizes, pages per
block -- (8); TPU-semantics interpretation (`pltpu.InterpretParams`: NaN-filled
uninitialised VMEM, out-of-bounds reads raise, DMAs land only when waited on, race detector
on) (4); and the four kernels inside a lax.scan over layers (4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from ksana_jax import pallas_kernels
from ksana_jax.kv_cache import float_kv
from ksana_jax.models import layers
from ksana_jax.pallas_kernels import (
    paged_attention_gpu,
    paged_attention_gpu_launches,
    ragged_paged_attention_cpu,
    ragged_paged_attention_tpu,
    ragged_paged_attention_xla,
    reference,
)
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec

PAGE_SIZE = 16
NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ = 64, 6, 8  # T, S, P: one bucket for every case
NUM_PAGES = 1 + NUM_SEQS * PAGES_PER_SEQ  # page 0 is the sink
NUM_LAYERS, LAYER = 2, 1  # layer 0 is all NaN

# Rows as (cached tokens, new tokens); rows missing up to S are padding rows.
SCENARIOS = {
    # context lengths 1, ps - 1, ps, ps + 1, several pages, long
    "decode": [(0, 1), (14, 1), (15, 1), (16, 1), (52, 1), (100, 1)],
    "prefill_fresh": [(0, 15), (0, 16), (0, 17), (0, 1)],
    # chunks starting mid-page, on a page boundary, and crossing two pages
    "prefill_chunks": [(5, 20), (16, 9), (31, 24)],
    "mixed": [(52, 1), (7, 30), (0, 1), (100, 1), (17, 15)],
    "long_chunk": [(3, 61)],
    "no_padding": [(10, 10), (0, 10), (30, 10), (1, 10), (15, 10), (16, 14)],
    "all_padding": [],
}

# (KV heads, query heads per KV head, head dim): GQA ratios 1, 3, 4, 8; head dims 64, 128.
F32_HEADS = [(2, 1, 128), (2, 3, 64), (2, 4, 64), (1, 8, 128)]
BF16_HEADS = [(2, 3, 64), (1, 8, 128)]
BF16_ATOL = 2e-2  # q, new keys and probabilities rounded to bf16 inside the kernels

# Tuning for the main matrix: TPU with 3-page blocks (P=8 is not a multiple, rows span
# several blocks, prefetch crosses rows); GPU with its defaults (2 key splits here).
BACKENDS = {
    "pallas_tpu": functools.partial(
        ragged_paged_attention_tpu.ragged_paged_attention, pages_per_block=3, interpret=True
    ),
    "pallas_gpu": functools.partial(paged_attention_gpu.ragged_paged_attention, interpret=True),
    "cpu": ragged_paged_attention_cpu.ragged_paged_attention,
    # 32-position chunks: rows span several loop steps; 16-query prefill groups.
    "xla": functools.partial(
        ragged_paged_attention_xla.ragged_paged_attention, chunk=32, block_q=16
    ),
}


def make_batch(
    rows,
    *,
    num_kv_heads,
    group,
    head_dim,
    dtype=jnp.float32,
    seed=0,
    page_size=PAGE_SIZE,
    pages_per_seq=PAGES_PER_SEQ,
):
    """Arguments of the attention signature for `rows` [(cached, new)], KV NaN where unowned."""
    assert len(rows) <= NUM_SEQS and sum(n for _, n in rows) <= NUM_TOKENS
    rng = np.random.default_rng(seed)
    num_pages_total = 1 + NUM_SEQS * pages_per_seq  # page 0 is the sink
    kv = np.full(
        (NUM_LAYERS, 2, num_kv_heads, num_pages_total, page_size, head_dim), np.nan, np.float32
    )
    page_table = rng.integers(0, num_pages_total, (NUM_SEQS, pages_per_seq)).astype(np.int32)
    page_table[len(rows) :] = 0  # padding rows point at the sink
    seq_lens = np.zeros(NUM_SEQS, np.int32)
    query_starts = np.zeros(NUM_SEQS + 1, np.int32)
    free_pages = iter(rng.permutation(np.arange(1, num_pages_total)))
    offset = 0
    for s, (num_cached, num_new) in enumerate(rows):
        num_pages = -(-(num_cached + num_new) // page_size)
        page_table[s, :num_pages] = [next(free_pages) for _ in range(num_pages)]
        for pos in range(num_cached):
            page = page_table[s, pos // page_size]
            kv[LAYER, :, :, page, pos % page_size] = rng.standard_normal(
                (2, num_kv_heads, head_dim)
            )
        seq_lens[s] = num_cached + num_new
        query_starts[s] = offset
        offset += num_new
    query_starts[len(rows) :] = offset
    num_heads = num_kv_heads * group

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    return (
        jnp.asarray(normal(NUM_TOKENS, num_heads, head_dim)),
        jnp.asarray(normal(NUM_TOKENS, num_kv_heads, head_dim), dtype),
        jnp.asarray(normal(NUM_TOKENS, num_kv_heads, head_dim), dtype),
        float_kv(jnp.asarray(kv, dtype)),
        jnp.int32(LAYER),
        jnp.asarray(page_table),
        jnp.asarray(seq_lens),
        jnp.asarray(query_starts),
    )


def check_against_oracle(attention, args, atol):
    head_dim = args[0].shape[-1]
    want = np.asarray(reference.ragged_paged_attention(*args, spec=AttentionSpec(head_dim**-0.5)))
    got = np.asarray(attention(*args, spec=AttentionSpec(head_dim**-0.5)))
    assert got.shape == want.shape and got.dtype == np.float32
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    num_real = int(args[-1][-1])
    assert np.all(got[num_real:] == 0.0), "padding tokens must give exact zeros"
    return got


@pytest.mark.parametrize("num_kv_heads,group,head_dim", F32_HEADS)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_kernel_matches_oracle_f32(backend, num_kv_heads, group, head_dim):
    for seed, (name, rows) in enumerate(SCENARIOS.items()):
        args = make_batch(
            rows, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, seed=seed
        )
        try:
            check_against_oracle(BACKENDS[backend], args, atol=1e-5)
        except AssertionError as e:
            raise AssertionError(f"scenario {name!r}: {e}") from None


@pytest.mark.parametrize("num_kv_heads,group,head_dim", BF16_HEADS)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_kernel_matches_oracle_bf16_kv(backend, num_kv_heads, group, head_dim):
    for seed, name in enumerate(["decode", "prefill_chunks", "mixed", "no_padding"]):
        args = make_batch(
            SCENARIOS[name],
            num_kv_heads=num_kv_heads,
            group=group,
            head_dim=head_dim,
            dtype=jnp.bfloat16,
            seed=seed,
        )
        try:
            check_against_oracle(BACKENDS[backend], args, atol=BF16_ATOL)
        except AssertionError as e:
            raise AssertionError(f"scenario {name!r}: {e}") from None


@pytest.mark.parametrize(
    "attention",
    [
        functools.partial(
            ragged_paged_attention_tpu.ragged_paged_attention,
            block_q=32,
            pages_per_block=1,
            interpret=True,
        ),
        functools.partial(ragged_paged_attention_tpu.ragged_paged_attention, interpret=True),
        functools.partial(
            ragged_paged_attention_tpu.ragged_paged_attention,
            block_q=8,
            pages_per_block=8,
            interpret=True,
        ),
        functools.partial(
            paged_attention_gpu.ragged_paged_attention,
            block_q=8,
            block_k=16,
            num_kv_splits=3,
            interpret=True,
        ),
        functools.partial(
            paged_attention_gpu.ragged_paged_attention, num_kv_splits=1, interpret=True
        ),
        # 64-key chunks of 4 page ids: the long rows' cached keys span two chunks
        functools.partial(
            paged_attention_gpu.ragged_paged_attention,
            block_k=16,
            num_kv_splits=1,
            page_ids_per_chunk=4,
            num_warps=8,
            num_stages=4,
            interpret=True,
        ),
        ragged_paged_attention_xla.ragged_paged_attention,
        # one-page chunks, single-query groups, two groups per loop step (many steps)
        functools.partial(
            ragged_paged_attention_xla.ragged_paged_attention,
            chunk=16,
            block_q=1,
            groups_per_block=2,
        ),
        functools.partial(ragged_paged_attention_xla.ragged_paged_attention, chunk=128, block_q=64),
    ],
    ids=[
        "tpu_q32_1page",
        "tpu_defaults",
        "tpu_q8_8pages",
        "gpu_q8_k16_3splits",
        "gpu_1split",
        "gpu_k16_4ids",
        "xla_defaults",
        "xla_c16_q1_g2",
        "xla_c128_q64",
    ],
)
def test_other_tuning_matches_oracle(attention):
    for seed, name in enumerate(["mixed", "prefill_chunks"]):
        args = make_batch(SCENARIOS[name], num_kv_heads=2, group=3, head_dim=64, seed=seed)
        check_against_oracle(attention, args, atol=1e-5)


@pytest.mark.parametrize("page_size", [8, 24])
def test_gpu_kernel_chunks_page_ids_for_any_page_size(page_size):
    """The GPU kernel loads a chunk's page ids once and picks each block's from them. 16-key
    blocks, 2 key splits, 4 page ids a chunk. Page size 8: a block spans two pages, and
    32-key chunks give the long rows 2 chunks a split. Page size 24: blocks straddle pages;
    64-key chunks, and splits of 80 keys, so the second chunk (key 64) and the second
    split (key 80) start mid-page."""
    attention = functools.partial(
        paged_attention_gpu.ragged_paged_attention,
        block_k=16,
        num_kv_splits=2,
        page_ids_per_chunk=4,
        interpret=True,
    )
    pages_per_seq = -(-128 // page_size)
    for seed, name in enumerate(["decode", "mixed", "prefill_chunks"]):
        args = make_batch(
            SCENARIOS[name],
            num_kv_heads=2,
            group=3,
            head_dim=64,
            seed=seed,
            page_size=page_size,
            pages_per_seq=pages_per_seq,
        )
        try:
            check_against_oracle(attention, args, atol=1e-5)
        except AssertionError as e:
            raise AssertionError(f"scenario {name!r}: {e}") from None


def test_gpu_mixed_batch_runs_decode_rows_in_small_tiles():
    """A batch with rows of a few new tokens and longer ones takes two launches: rows of up
    to decode_block_q tokens (4 at 4 query heads per KV head) in 4-token tiles, the rest in
    16-token tiles, both writing one set of partial states. The rows of 4 and 5 new tokens
    sit on either side of the boundary; a pure decode bucket (one token a row) takes one
    launch."""
    attention = functools.partial(
        paged_attention_gpu.ragged_paged_attention, block_q=16, num_kv_splits=2, interpret=True
    )
    rows = [(20, 3), (9, 4), (30, 5), (0, 1), (50, 2), (17, 33)]
    args = make_batch(rows, num_kv_heads=2, group=4, head_dim=64, seed=7)
    check_against_oracle(attention, args, atol=1e-5)
    assert paged_attention_gpu_launches.decode_block_q(4) == 4
    q, kv, page_table = args[0], args[3], args[5]
    plan = paged_attention_gpu_launches.plan_launches(
        q.shape, kv.pages.shape, kv.pages.dtype, page_table.shape, block_q=16, num_kv_splits=2
    )
    assert [(p.new_tokens, p.tuning.block_q, p.tuning.num_kv_splits) for p in plan] == [
        ((-1, 4), 4, 2),
        ((4, NUM_TOKENS), 16, 2),
    ]
    launches = str(jax.make_jaxpr(functools.partial(attention, spec=AttentionSpec(0.125)))(*args))
    assert launches.count("pallas_call[") == 2
    decode = make_batch(SCENARIOS["decode"], num_kv_heads=2, group=4, head_dim=64)
    decode = (*(a[:NUM_SEQS] for a in decode[:3]), *decode[3:])  # T == S: one token a row
    check_against_oracle(attention, decode, atol=1e-5)
    launches = str(jax.make_jaxpr(functools.partial(attention, spec=AttentionSpec(0.125)))(*decode))
    assert launches.count("pallas_call[") == 1


def test_gpu_launch_tiles_cover_every_real_token_once():
    """An independent check of the tile lists: over random ragged batches, group sizes and
    tile sizes, the tiles of a plan's launches cover every real token exactly once (in a
    tile of its own row) and no padding token, within each launch's listed entries."""
    rng = np.random.default_rng(0)
    kv_shape = (1, 2, 2, 9, PAGE_SIZE, 64)
    for trial in range(120):
        num_tokens, num_seqs = int(rng.integers(1, 96)), int(rng.integers(1, 12))
        group = int(rng.choice([1, 2, 3, 4, 8]))
        block_q = int(rng.choice([0, 2, 4, 8, 16, 32, 64])) or None  # 0: the default
        if block_q and block_q * paged_attention_gpu_launches.next_pow2(group) < 16:
            continue
        real = int(rng.integers(0, num_tokens + 1))
        counts = rng.multinomial(real, np.ones(num_seqs) / num_seqs)
        counts = np.where(rng.random(num_seqs) < 0.4, np.minimum(counts, 1), counts)  # decode
        query_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        plan = paged_attention_gpu_launches.plan_launches(
            (num_tokens, 2 * group, 64), kv_shape, jnp.float32, (num_seqs, 8), block_q=block_q
        )
        covered = np.zeros(num_tokens, int)
        for launch in plan:
            rows, starts = map(np.asarray, launch.tiles(jnp.asarray(query_starts), num_tokens))
            for row, start in zip(rows, starts, strict=True):
                if row >= 0:
                    end = min(start + launch.tuning.block_q, query_starts[row + 1])
                    assert query_starts[row] <= start < end, (trial, launch)
                    covered[start:end] += 1
        assert (covered[: query_starts[-1]] == 1).all(), (trial, plan, counts)
        assert (covered[query_starts[-1] :] == 0).all(), (trial, plan, counts)


def test_gpu_default_splits_count_query_tiles():
    """Programs are query tiles x KV heads x splits: decode rows are split until there are
    about TARGET_PROGRAMS, a long prefill whose tiles already fill the GPU is not."""
    gpu = paged_attention_gpu_launches
    assert gpu.TARGET_PROGRAMS == 1024
    # 32 decode rows (32 tokens, 4-token tiles: one tile a row) x 8 KV heads at 4096 keys
    assert gpu.num_query_tiles(32, 32, 4) == 32
    assert gpu.default_num_kv_splits(32, 8, 4096, 64) == 4
    # a 4096-token prefill in 32-token tiles: 128 tiles x 8 KV heads = 1024 programs
    assert gpu.default_num_kv_splits(gpu.num_query_tiles(4096, 1, 32), 8, 8192, 64) == 1
    # a short context is never cut below MIN_KEYS_PER_SPLIT keys a split
    assert gpu.default_num_kv_splits(1, 1, 600, 64) == 600 // gpu.MIN_KEYS_PER_SPLIT


def test_gpu_tuning_defaults_and_overrides():
    """16-bit KV: 64-key blocks, tiles up to 128 query rows, 3 stages up to head dim 128;
    float32 KV (3xTF32 dots, wider in registers): 32-key blocks, tiles up to 4096 / head_dim
    rows. Named values win."""
    resolve = paged_attention_gpu_launches.resolve_tuning
    kv = (1, 2, 8, 4097, 16, 128)  # Llama-3-8B-like: 8 KV heads x 128, 32 query heads
    prefill = ((1024, 32, 128), kv, (1, 257))
    bf16 = resolve(prefill[0], kv, jnp.bfloat16, prefill[2])
    assert (bf16.block_q * 4, bf16.block_k, bf16.num_warps, bf16.num_stages) == (128, 64, 8, 3)
    f32 = resolve(prefill[0], kv, jnp.float32, prefill[2])
    assert (f32.block_q * 4, f32.block_k, f32.num_warps) == (4096 // 128, 32, 8)
    decode = resolve((32, 32, 128), kv, jnp.bfloat16, (32, 257))
    assert (decode.block_q, decode.num_warps, decode.num_stages) == (4, 4, 3)
    # a 256-wide head: key blocks and tile rows shrink in proportion
    wide_kv = (*kv[:5], 256)
    head256 = resolve((1024, 32, 256), wide_kv, jnp.bfloat16, (1, 257))
    assert (head256.block_q * 4, head256.block_k, head256.num_stages) == (64, 32, 2)
    head256 = resolve((1024, 32, 256), wide_kv, jnp.float32, (1, 257))
    assert (head256.block_q * 4, head256.block_k) == (16, 16)
    given = resolve(
        prefill[0],
        kv,
        jnp.bfloat16,
        prefill[2],
        block_q=8,
        block_k=16,
        num_kv_splits=5,
        num_warps=2,
        num_stages=1,
    )
    assert tuple(given) == (8, 16, 5, 2, 1)


def test_gpu_chunking_covers_every_page_a_chunk_touches():
    """An independent count: for every chunk start a key split can produce, the pages its
    keys touch fit in the page ids `_chunking` loads."""
    for page_size in (1, 3, 8, 16, 24, 100):
        for block_k in (16, 64):
            for page_ids in (4, 64):
                chunk_keys, chunk_pages = paged_attention_gpu._chunking(
                    block_k, page_size, page_ids
                )
                assert chunk_keys % block_k == 0 and chunk_pages & (chunk_pages - 1) == 0
                for start in range(0, 4 * page_size * block_k, block_k):
                    touched = (start + chunk_keys - 1) // page_size - start // page_size + 1
                    assert touched <= chunk_pages, (page_size, block_k, page_ids, start)
                if chunk_keys > block_k:  # one block alone may need more
                    assert chunk_pages <= page_ids


@pytest.mark.parametrize("num_kv_heads,group,head_dim", BF16_HEADS)
@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_cpu_backends_match_oracle_float16_kv(backend, num_kv_heads, group, head_dim):
    """The CPU's KV dtype for bfloat16 models (kv_cache.resolve_kv_dtype)."""
    for seed, (name, rows) in enumerate(SCENARIOS.items()):
        args = make_batch(
            rows,
            num_kv_heads=num_kv_heads,
            group=group,
            head_dim=head_dim,
            dtype=jnp.float16,
            seed=seed,
        )
        try:
            check_against_oracle(BACKENDS[backend], args, atol=BF16_ATOL)
        except AssertionError as e:
            raise AssertionError(f"scenario {name!r}: {e}") from None


@pytest.mark.parametrize("page_size", [8, 16, 24])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_cpu_kernel_float32_pages_read_in_place_or_copied(head_dim, page_size):
    """With float32 pages the CPU kernel reads a tile of 16 positions where it lies when the
    tile is one run of a page (page size 16 or 24), else copies it (page size 8: every tile
    spans two pages; 24: every other one does). Unowned page rows are NaN, so a tile read
    from the wrong place, or past its positions, shows."""
    pages_per_seq = -(-128 // page_size)
    for seed, name in enumerate(["decode", "prefill_chunks", "mixed", "long_chunk"]):
        args = make_batch(
            SCENARIOS[name],
            num_kv_heads=2,
            group=2,
            head_dim=head_dim,
            seed=seed,
            page_size=page_size,
            pages_per_seq=pages_per_seq,
        )
        try:
            check_against_oracle(BACKENDS["cpu"], args, atol=1e-5)
        except AssertionError as e:
            raise AssertionError(f"scenario {name!r}: {e}") from None


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 3, 64), (1, 8, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_cpu_kernel_large_steps_on_the_pool(dtype, num_kv_heads, group, head_dim):
    """SCENARIOS' steps are all below the CPU kernel's kParallelWork (16384 positions x
    queries), so it runs them on the caller's thread; these rows (~20-26 k) go to the pool."""
    rows = [(100, 27), (90, 20), (60, 17)]
    args = make_batch(rows, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype)
    check_against_oracle(BACKENDS["cpu"], args, atol=1e-5 if dtype == jnp.float32 else BF16_ATOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_tpu_kernel_under_tpu_interpret_semantics(dtype, capsys):
    """pltpu.InterpretParams: uninitialised VMEM is NaN, out-of-bounds reads raise, a DMA's
    data lands only when it is waited on, and the race detector watches every DMA against
    the compute reading the other buffer -- closer to the hardware than interpret=True."""
    attention = functools.partial(
        ragged_paged_attention_tpu.ragged_paged_attention,
        pages_per_block=3,
        interpret=pltpu.InterpretParams(detect_races=True),
    )
    atol = 1e-5 if dtype == jnp.float32 else BF16_ATOL
    for seed, name in enumerate(["mixed", "prefill_chunks"]):
        args = make_batch(
            SCENARIOS[name], num_kv_heads=2, group=3, head_dim=64, dtype=dtype, seed=seed
        )
        check_against_oracle(attention, args, atol=atol)
    assert "RACE DETECTED" not in capsys.readouterr().out


# ----------------------------------------------------------------------------- on device

DEVICE_KERNELS = {
    "tpu": ragged_paged_attention_tpu.ragged_paged_attention,
    "gpu": paged_attention_gpu.ragged_paged_attention,
}


@pytest.mark.tpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_kernel_matches_oracle_on_device(dtype):
    """The compiled kernel (not the interpreter) on the TPU or GPU this runs on."""
    platform = jax.default_backend()
    if platform not in DEVICE_KERNELS:
        pytest.skip(f"needs a TPU or GPU, running on {platform}")
    atol = 1e-5 if dtype == jnp.float32 else BF16_ATOL
    with jax.default_matmul_precision("highest"):  # the oracle's f32 dots, not TF32/bf16
        for num_kv_heads, group, head_dim in F32_HEADS:
            for seed, (name, rows) in enumerate(SCENARIOS.items()):
                args = make_batch(
                    rows,
                    num_kv_heads=num_kv_heads,
                    group=group,
                    head_dim=head_dim,
                    dtype=dtype,
                    seed=seed,
                )
                try:
                    check_against_oracle(DEVICE_KERNELS[platform], args, atol=atol)
                except AssertionError as e:
                    raise AssertionError(f"{name}, heads {(num_kv_heads, group)}: {e}") from None


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "attention",
    [BACKENDS["pallas_tpu"], BACKENDS["pallas_gpu"], BACKENDS["cpu"], BACKENDS["xla"]],
    ids=["tpu", "gpu", "cpu", "xla"],
)
def test_bad_inputs_raise_clear_errors(attention):
    args = list(make_batch([(3, 2)], num_kv_heads=2, group=3, head_dim=64))
    with pytest.raises(ValueError, match="k_new"):
        attention(args[0], args[1][:, :1], *args[2:], spec=AttentionSpec(1.0))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention(args[0][:, :5], *args[1:], spec=AttentionSpec(1.0))
    with pytest.raises(ValueError, match="seq_lens"):
        attention(*args[:6], args[6][:-1], args[7], spec=AttentionSpec(1.0))
    with pytest.raises(ValueError, match="page_table must be int32"):
        attention(*args[:5], args[5].astype(jnp.int16), *args[6:], spec=AttentionSpec(1.0))


def test_cpu_kernel_rejects_steps_that_would_read_out_of_bounds():
    """Values, not shapes: the C++ kernel checks every row before it reads, so a bad step is
    an error naming the argument, never a stray read or a crash."""
    args = make_batch(SCENARIOS["mixed"], num_kv_heads=2, group=3, head_dim=64)
    bad = {
        5: (args[5].at[0, 0].set(NUM_PAGES), "page_table: a page id is out of range"),
        6: (args[6].at[0].set(10**6), "seq_lens: a row's cached tokens exceed its page table"),
        7: (args[7].at[1].set(NUM_TOKENS + 1), "query_starts must be non-decreasing"),
        4: (jnp.int32(NUM_LAYERS), "layer_index out of range"),
    }
    for index, (value, message) in bad.items():
        broken = list(args)
        broken[index] = value
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            np.asarray(
                ragged_paged_attention_cpu.ragged_paged_attention(*broken, spec=AttentionSpec(1.0))
            )


def test_xla_rejects_chunk_off_the_page_size():
    args = make_batch([(3, 2)], num_kv_heads=2, group=3, head_dim=64)
    with pytest.raises(ValueError, match="chunk=24 must be a positive multiple of page_size=16"):
        ragged_paged_attention_xla.ragged_paged_attention(*args, spec=AttentionSpec(1.0), chunk=24)


def test_tpu_rejects_page_size_off_the_mosaic_tiling():
    with pytest.raises(ValueError, match="page_size=12 must be a multiple of 16"):
        ragged_paged_attention_tpu.kv_layout(
            num_layers=1, num_kv_heads=1, num_pages=4, page_size=12, head_dim=64, dtype=jnp.bfloat16
        )
    args = list(make_batch([(3, 2)], num_kv_heads=2, group=3, head_dim=64))
    with pytest.raises(ValueError, match="block_q=12"):
        ragged_paged_attention_tpu.ragged_paged_attention(
            *args, spec=AttentionSpec(1.0), block_q=12
        )


def test_gpu_rejects_head_dim_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="head_dim=80"):
        paged_attention_gpu.kv_layout(
            num_layers=1, num_kv_heads=1, num_pages=4, page_size=16, head_dim=80, dtype=jnp.float32
        )


def test_layouts_match_kv_cache_layout():
    from ksana_jax.kv_cache import KVCacheSpec

    spec = KVCacheSpec(
        num_layers=30, num_kv_heads=3, num_pages=9, page_size=16, head_dim=64, dtype="bfloat16"
    )
    for module in (ragged_paged_attention_tpu, paged_attention_gpu):
        layout = module.kv_layout(
            num_layers=30,
            num_kv_heads=3,
            num_pages=9,
            page_size=16,
            head_dim=64,
            dtype=jnp.bfloat16,
        )
        assert layout.shape == spec.shape and layout.dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- in a scan


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "cpu", "xla"])
def test_registry_attention_runs_inside_a_layer_scan(backend):
    """The engine calls attention inside lax.scan with a traced layer index."""
    args = make_batch(SCENARIOS["mixed"], num_kv_heads=2, group=3, head_dim=64)
    q, k_new, v_new, kv, _, page_table, seq_lens, query_starts = args
    if backend in ("cpu", "xla"):
        attention = pallas_kernels.get_attention(backend)
    else:
        with pytest.warns(UserWarning):
            attention = pallas_kernels.get_attention(backend, interpret=True)

    def body(layer_index, _):
        out = attention(
            q,
            k_new,
            v_new,
            kv,
            layer_index,
            page_table,
            seq_lens,
            query_starts,
            spec=AttentionSpec(64**-0.5),
        )
        return layer_index + 1, out

    _, outs = jax.lax.scan(body, jnp.int32(0), length=NUM_LAYERS)
    want = reference.ragged_paged_attention(*args, spec=AttentionSpec(64**-0.5))
    np.testing.assert_allclose(np.asarray(outs[LAYER]), np.asarray(want), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- a whole layer
# The cpu backend's attend_layer (rotary, rounding to the KV dtype, the write and attention
# in one call) against reference.attend_layer, the composition every other backend runs.

ATTEND_HEADS = dict(num_kv_heads=2, group=3, head_dim=64)


def attend_layer_args(rows, dtype, seed, scale=1.0):
    """attend_layer's arguments for `rows`: qkv [T, K, G + 2, H] random (times `scale`), the
    tokens' slots from their pages as the engine computes them (padding tokens: the sink)."""
    _, _, _, kv, layer, page_table, seq_lens, query_starts = make_batch(
        rows, dtype=dtype, seed=seed, **ATTEND_HEADS
    )
    k, g, h = ATTEND_HEADS["num_kv_heads"], ATTEND_HEADS["group"], ATTEND_HEADS["head_dim"]
    rng = np.random.default_rng(seed + 100)
    qkv = jnp.asarray(rng.standard_normal((NUM_TOKENS, k, g + 2, h)) * scale, jnp.float32)
    token_rows, positions, real = reference.token_rows_and_positions(
        seq_lens, query_starts, NUM_TOKENS
    )
    pages = page_table[token_rows, positions // PAGE_SIZE]
    slots = jnp.where(real, pages * PAGE_SIZE + positions % PAGE_SIZE, 0)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, h, 2) / h)).astype(np.float32)
    cos, sin = layers.rope_tables(positions, inv_freq)
    return qkv, kv, layer, cos, sin, slots, page_table, seq_lens, query_starts


def check_attend_layer(args, spec):
    want_out, want_kv = jax.jit(reference.attend_layer, static_argnames="spec")(*args, spec=spec)
    got_out, got_kv = jax.jit(ragged_paged_attention_cpu.attend_layer, static_argnames="spec")(
        *args, spec=spec
    )
    # The pages bit for bit, NaN where neither wrote; the sink page (page 0) aside, which
    # padding tokens write in an order a scatter leaves open.
    np.testing.assert_array_equal(
        np.asarray(got_kv.pages[:, :, :, 1:].astype(jnp.float32)),
        np.asarray(want_kv.pages[:, :, :, 1:].astype(jnp.float32)),
    )
    assert got_out.shape == want_out.shape and got_out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=0, atol=1e-5)
    num_real = int(args[-1][-1])
    assert np.all(np.asarray(got_out[num_real:]) == 0.0)
    return got_kv


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cpu_attend_layer_matches_the_composition(dtype):
    specs = [AttentionSpec(0.125), AttentionSpec(0.125, sliding_window=20, logit_softcap=30.0)]
    for seed, (name, rows) in enumerate(SCENARIOS.items()):
        try:
            check_attend_layer(attend_layer_args(rows, dtype, seed), specs[seed % 2])
        except AssertionError as e:
            raise AssertionError(f"scenario {name!r}: {e}") from None


def test_cpu_attend_layer_clips_float16_keys_and_values():
    """Keys and values past float16's range are written as +-65504, never inf, as
    kv_cache.to_kv_dtype rounds them."""
    args = attend_layer_args(SCENARIOS["mixed"], jnp.float16, seed=3, scale=1e5)
    got_kv = check_attend_layer(args, AttentionSpec(1e-6))
    written = np.asarray(got_kv.pages[LAYER, :, :, 1:].astype(jnp.float32))
    assert np.nanmax(np.abs(written)) == 65504.0 and not np.isinf(written).any()


def test_cpu_attend_layer_is_one_call_writing_the_donated_kv():
    """Under a donating jit, as the engine's step runs it: one custom call (no split,
    rotary or convert fusions, no scatter), its second result the donated pages."""
    args = attend_layer_args(SCENARIOS["decode"], jnp.bfloat16, seed=4)
    spec = AttentionSpec(0.125)
    step = jax.jit(
        lambda *a: ragged_paged_attention_cpu.attend_layer(*a, spec=spec), donate_argnums=1
    )
    text = step.lower(*args).compile().as_text()
    assert text.count("custom_call_target=") == 1
    assert f'custom_call_target="{ragged_paged_attention_cpu.ATTEND_TARGET}"' in text
    assert "fusion" not in text and "scatter" not in text
    want = reference.attend_layer(*args, spec=spec)[1].pages
    pointer = args[1].pages.unsafe_buffer_pointer()
    got = step(*args)[1].pages
    assert got.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(
        np.asarray(got[:, :, :, 1:].astype(jnp.float32)),
        np.asarray(want[:, :, :, 1:].astype(jnp.float32)),
    )


def test_cpu_attend_layer_rejects_bad_shapes():
    qkv, kv, *rest = attend_layer_args(SCENARIOS["decode"], jnp.float32, seed=5)
    spec = AttentionSpec(0.125)
    with pytest.raises(ValueError, match="qkv must be"):
        ragged_paged_attention_cpu.attend_layer(qkv[:, :1], kv, *rest, spec=spec)
    layer, cos, sin, slots, *tables = rest
    with pytest.raises(ValueError, match=r"cos .* and sin .* must be"):
        ragged_paged_attention_cpu.attend_layer(
            qkv, kv, layer, cos[:, :4], sin, slots, *tables, spec=spec
        )
    with pytest.raises(ValueError, match="slot_ids must be"):
        ragged_paged_attention_cpu.attend_layer(
            qkv, kv, layer, cos, sin, slots[:3], *tables, spec=spec
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_attend_layer_reads_each_sequences_row_of_the_batchs_table(dtype):
    """With page_rows (StepInputs.page_rows: the persistent batch's table [R, P] read in
    place), sequence s's pages are row page_rows[s] of the table: the call's attention and
    pages equal those of the gathered [S, P] table exactly, the other rows (page ids past
    the KV, which the kernel would refuse) never read; a row past the table is an error."""
    spec = AttentionSpec(0.125, sliding_window=20)
    qkv, kv, layer, cos, sin, slots, table, seq_lens, starts = attend_layer_args(
        SCENARIOS["mixed"], dtype, seed=6
    )
    num_seqs, width = table.shape
    rng = np.random.default_rng(6)
    page_rows = jnp.asarray(rng.permutation(3 * num_seqs)[:num_seqs], jnp.int32)
    wide = jnp.full((3 * num_seqs, width), NUM_PAGES + 7, jnp.int32).at[page_rows].set(table)
    attend = jax.jit(ragged_paged_attention_cpu.attend_layer, static_argnames="spec")
    want_out, want_kv = attend(qkv, kv, layer, cos, sin, slots, table, seq_lens, starts, spec=spec)
    got_out, got_kv = attend(
        qkv, kv, layer, cos, sin, slots, wide, seq_lens, starts, spec=spec, page_rows=page_rows
    )
    np.testing.assert_array_equal(got_out, want_out)
    np.testing.assert_array_equal(
        np.asarray(got_kv.pages.astype(jnp.float32)), np.asarray(want_kv.pages.astype(jnp.float32))
    )
    past = page_rows.at[0].set(3 * num_seqs)
    with pytest.raises(Exception, match="page_rows: a row is out of the table"):
        np.asarray(
            attend(
                qkv, kv, layer, cos, sin, slots, wide, seq_lens, starts, spec=spec, page_rows=past
            )[0]
        )

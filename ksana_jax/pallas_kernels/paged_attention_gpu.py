"""Ragged paged attention for GPU in Pallas (Triton lowering): decode and prefill rows.

Same semantics as `reference.ragged_paged_attention` (read its docstring): T flattened new
tokens of S rows attend, with grouped-query heads, to their row's cached keys (read from
the paged KV array of layer `layer_index` through the page table) and causally to the
step's new keys of the same row (`k_new`/`v_new`, not yet in the pages). Padding tokens
give zeros.

Lowering: Triton (`compiler_params=triton.CompilerParams`), not jax 0.10.2's default
Mosaic GPU. Why: a paged kernel is a gather -- every key block reads token slots scattered
over pages named by the page table -- and Triton expresses that directly as a masked
pointer load (`kv[layer, 0|1, k, page_ids, slots, :]`), with out-of-range slots never
read; it runs on every CUDA GPU jax supports (Ampere, Hopper, Blackwell) and on ROCm, and
its software pipelining of the key loop needs no hand-written barriers. Mosaic GPU targets
Hopper+ only, gathers through TMA/async copies with explicit barriers and 64-row WGMMA
tiles, and `pl.pallas_call` for it is deprecated in favour of `plgpu.kernel` -- more code
and more hardware-specific for no gain at these shapes. The price: Triton IR has no
serialization-compatibility guarantee, so `jax.export` of this kernel must name the
custom call `__gpu$xla.gpu.triton` in `disabled_checks` (the lowering itself, with its
power-of-two shape checks, runs on a CPU-only machine).

Grid: (query tiles, K KV heads, key splits). A query tile is up to `block_q` consecutive
tokens of ONE row (the wrapper lists every row's tiles; a decode row is one tile; tiles
past the list exit at once), so no compute is spent on other rows' queries. Its queries
for KV head k form an [block_q * G_pad, H] matrix (G_pad = query heads per KV head padded
to a power of two, as Triton requires: G=3 computes 4 rows per token). A bucket with
several rows and more tokens than rows takes two launches (`plan_launches`): rows of a
few new tokens in decode-sized tiles, the others in `block_q` tiles, both writing one set
of partial states (the second aliases the first's). Key split s
takes the s-th of `num_kv_splits` equal slices (whole key blocks) of the longest possible
context, P * page_size, and stops at the row's cached length, so long-context decode of
few rows still keeps every SM busy; the last split also takes the step's new keys.

What each program loads, block by block (`block_k` keys):
  - cached keys/values: positions p of its split, pages page_table[row, p // page_size],
    slots p % page_size -- a gather with a mask (p < cached length), so slots the row does
    not own are never read. Quantized pages (int8, float8_e4m3fn) also gather their rows'
    float32 scales (kv.scales[layer, 0|1, k, page_ids, slots]) and are dequantized in
    registers (page * scale) before the dots. The page ids come CHUNK_PAGE_IDS at a time,
    loaded before the chunk's block loop, so no block's K/V copy waits on a page-table load
    and Triton's pipeliner keeps the next block's copies in flight (num_stages >= 3);
  - new keys/values: tokens from the row's first new token up to the tile's last token,
    masked causally (key token <= query token).
With a sliding window W (spec.sliding_window) both start at the window start of the tile's
first query (position - W + 1; the cached keys from the key block holding it), and the key
splits divide that span (< W + block_k keys) rather than the page table: decode over a long
context reads about W positions a row, and keys before the window are masked loads, never
read. Scores are soft-capped (c * tanh(s / c)) before the mask when the spec asks.
Online-softmax state in registers, f32: running max m [M], denominator l [M],
unnormalised output acc [M, H]. Masking selects (-inf scores, zero-filled loads), never
multiplies. Each split writes (acc, m, l); the wrapper merges splits with the usual
log-sum-exp rescaling and returns acc / l (0 where nothing was seen: padding tokens).

The launches and their tuning live in paged_attention_gpu_launches.py. Their defaults were
read off the kernel compiled by XLA:GPU for GPUs it only describes
(`benchmarks/gpu_aot_compile.py`, checked in CI by tests/test_gpu_aot.py);
`benchmarks/attention_sweep.py` times them on a GPU.

Dots run in the KV dtype accumulating in f32: for 16-bit KV the queries and
probabilities are rounded to it (tensor cores); for f32 KV each dot is three TF32 products
on the tensor cores (3xTF32: float32 accuracy; exact IEEE float32 in the interpreter).
For quantized KV they run in the queries' dtype on the dequantized keys and values.
Triton converts float8_e4m3fn only on compute capability 8.9 and newer (Ada, Hopper).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ksana_jax.kv_cache import KVCache
from ksana_jax.pallas_kernels.attention_args import validate_attention_args
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
from ksana_jax.pallas_kernels.paged_attention_gpu_launches import (
    MIN_DOT_DIM,
    Launch,
    next_pow2,
    plan_launches,
)

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
CHUNK_PAGE_IDS = 64  # page ids the cached-key loop holds in registers at a time


def kv_layout(
    *, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype
) -> jax.ShapeDtypeStruct:
    """The KV array this kernel reads: [L, 2, K, num_pages, page_size, H] (kv_cache.py's).

    Any page_size works (keys are gathered slot by slot); head_dim must be a power of two
    >= 16 (a Triton tensor dimension and a dot operand).
    """
    if head_dim < MIN_DOT_DIM or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two >= {MIN_DOT_DIM} for Triton")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    return jax.ShapeDtypeStruct(
        (num_layers, 2, num_kv_heads, num_pages, page_size, head_dim), dtype
    )


# ----------------------------------------------------------------------------- kernel phases


def _dot(a, b, dot_dtype, precision, contract_b: int):
    return lax.dot_general(
        a.astype(dot_dtype),
        b.astype(dot_dtype),
        (((1,), (contract_b,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def _dot_precision(dot_dtype, interpret: bool):
    """16-bit KV: the tensor cores' native products. Float32 KV: three TF32 products a dot
    (`TF32_TF32_F32_X3`, float32 accuracy on the tensor cores) compiled -- an IEEE float32
    dot is a loop of FMAs that spills 43 KB of registers at a 128-row prefill tile -- and
    exact float32 in the interpreter, since XLA:CPU has no TF32."""
    if dot_dtype != jnp.float32:
        return None
    return lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _online_softmax_update(state, q, k, v, visible, *, spec, dot_dtype, precision):
    """Folds one key block into (acc f32[M, H], m f32[M], l f32[M]).

    q [M, H]; k, v [block_k, H] with masked-out rows already zero; visible bool[M, block_k];
    spec: the scale and soft-cap.
    """
    acc, m_prev, l_prev = state
    scores = _dot(q, k, dot_dtype, precision, 1) * spec.sm_scale
    if spec.logit_softcap is not None:
        scores = spec.logit_softcap * jnp.tanh(scores / spec.logit_softcap)
    scores = jnp.where(visible, scores, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
    # Rows that have seen nothing keep m = -inf; shift them by 0 so exp gives 0, not NaN.
    m_shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp(scores - m_shift[:, None])
    alpha = jnp.exp(m_prev - m_shift)
    acc = alpha[:, None] * acc + _dot(p, v, dot_dtype, precision, 0)
    return acc, m_next, alpha * l_prev + jnp.sum(p, axis=1)


def _attend_cached_keys(
    state, q, kv_refs, page_table_ref, where, key_range, window, update, block_k, chunking
):
    """Phase 1: keys [lo, hi) of the row's cached context, gathered block by block from the
    pages. where = (layer, kv_head, row); masked-off slots are never read. window =
    (first, query_lo): no key before `first` is read, and query row i sees keys from
    query_lo[i] (i32[M]) on; None without a sliding window.

    The keys go in chunks (`chunking` = keys and page ids per chunk, from `_chunking`). A
    chunk's page ids are loaded once, before its block loop, and each block picks its own
    from them in registers. Inside the loop every K/V address then follows from the loop
    index alone, so Triton's pipeliner issues the next block's copies while this one
    computes. With a page-table load in the loop the copies wait on it, and every block's
    load latency is exposed.
    """
    layer, kv_head, row = where
    kv_ref, scales_ref, quantized = kv_refs
    lo, hi = key_range
    page_size, head_dim = kv_ref.shape[4:]
    max_pages = page_table_ref.shape[1]
    chunk_keys, chunk_pages = chunking
    lanes = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    page_lanes = jnp.arange(chunk_pages, dtype=jnp.int32)

    def chunk(c, state):
        start = lo + c * chunk_keys
        first_page = lax.div(start, page_size)
        table_slots = first_page + page_lanes
        chunk_page_ids = plgpu.load(
            page_table_ref.at[row, table_slots], mask=table_slots < max_pages, other=0
        )

        def block(b, state):
            positions = start + b * block_k + jnp.arange(block_k, dtype=jnp.int32)
            valid = positions < hi
            if window is not None:
                valid &= positions >= window[0]
            local = lax.div(positions, page_size) - first_page
            picked = local[:, None] == page_lanes[None, :]
            pages = jnp.sum(jnp.where(picked, chunk_page_ids[None, :], 0), axis=1)
            # All-array indices (not a trailing slice): the interpreter's gather needs them.
            slot = (pages[:, None], lax.rem(positions, page_size)[:, None], lanes)
            mask = jnp.broadcast_to(valid[:, None], (block_k, head_dim))
            k, v = (
                plgpu.load(kv_ref.at[(layer, kv_index, kv_head, *slot)], mask=mask, other=0.0)
                for kv_index in (0, 1)
            )
            if quantized:  # rows times their scales; masked rows load scale 0
                rows = (pages, lax.rem(positions, page_size))
                k, v = (
                    x.astype(jnp.float32)
                    * plgpu.load(scales_ref.at[(layer, i, kv_head, *rows)], mask=valid, other=0.0)[
                        :, None
                    ]
                    for i, x in ((0, k), (1, v))
                )
            visible = jnp.broadcast_to(valid[None, :], (q.shape[0], block_k))
            if window is not None:
                visible &= positions[None, :] >= window[1][:, None]
            return update(state, q, k, v, visible)

        keys = jnp.clip(hi - start, 0, chunk_keys)
        return lax.fori_loop(0, lax.div(keys + block_k - 1, block_k), block, state)

    num_chunks = lax.div(jnp.maximum(hi - lo, 0) + chunk_keys - 1, chunk_keys)
    return lax.fori_loop(0, num_chunks, chunk, state)


def _chunking(block_k: int, page_size: int, page_ids: int) -> tuple[int, int]:
    """Keys per chunk of phase 1 (whole blocks) and the page ids it loads (a power of two,
    <= page_ids unless one block alone needs more).

    Chunks start at multiples of block_k: when page_size divides block_k that is a page
    boundary and a chunk touches chunk_keys / page_size pages; otherwise up to one more.
    """
    extra = 0 if block_k % page_size == 0 else 1
    blocks = max(1, ((page_ids - extra) * page_size) // block_k)
    chunk_keys = blocks * block_k
    return chunk_keys, next_pow2(-(-chunk_keys // page_size) + extra)


def _attend_new_keys(
    state, q, k_new_ref, v_new_ref, kv_head, key_range, q_tokens, update, block_k, sliding_window
):
    """Phase 2: the step's new keys [row_start, end) of the row (row_start: the first the
    tile's window reaches), causal against the query token of each row of q (q_tokens
    i32[M]) and within its `sliding_window` (None: no window)."""
    row_start, end = key_range

    def block(b, state):
        keys = row_start + b * block_k + jnp.arange(block_k, dtype=jnp.int32)
        valid = keys < end
        window = pl.ds(row_start + b * block_k, block_k)
        k = plgpu.load(k_new_ref.at[window, kv_head], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_new_ref.at[window, kv_head], mask=valid[:, None], other=0.0)
        visible = valid[None, :] & (keys[None, :] <= q_tokens[:, None])
        if sliding_window is not None:
            visible &= keys[None, :] > q_tokens[:, None] - sliding_window
        return update(state, q, k, v, visible)

    num_blocks = lax.div(jnp.maximum(end - row_start, 0) + block_k - 1, block_k)
    return lax.fori_loop(0, num_blocks, block, state)


def _attention_kernel(
    # inputs (whole arrays in global memory)
    layer_ref,  # i32[1]
    page_table_ref,  # i32[S, P]
    seq_lens_ref,  # i32[S]
    query_starts_ref,  # i32[S + 1]
    tile_rows_ref,  # i32[num_tiles]  row of each query tile, -1 past the list
    tile_starts_ref,  # i32[num_tiles]  first token of each query tile
    q_ref,  # [T, K, G_pad, H]
    k_new_ref,  # [T, K, H]
    v_new_ref,  # [T, K, H]
    kv_ref,  # [L, 2, K, num_pages, page_size, H]
    scales_ref,  # f32[L, 2, K, num_pages, page_size] (quantized), else a placeholder
    # outputs
    acc_ref,  # f32[splits, T, K, G_pad, H]
    m_ref,  # f32[splits, T, K, G_pad]
    l_ref,  # f32[splits, T, K, G_pad]
    *,
    spec: AttentionSpec,
    block_q: int,
    block_k: int,
    keys_per_split: int,
    page_ids_per_chunk: int,
    dot_dtype,
    precision,
    quantized: bool,
):
    tile, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, _, group_pad, head_dim = q_ref.shape
    rows_m = block_q * group_pad
    row = tile_rows_ref[tile]
    update = functools.partial(
        _online_softmax_update, spec=spec, dot_dtype=dot_dtype, precision=precision
    )
    window = spec.sliding_window

    @pl.when(row >= 0)
    def _():
        # ---- phase 0: this tile's queries, the token of each query row, empty state.
        row_start, row_end = query_starts_ref[row], query_starts_ref[row + 1]
        num_cached = seq_lens_ref[row] - (row_end - row_start)
        tile_start = tile_starts_ref[tile]
        tokens = tile_start + jnp.arange(block_q, dtype=jnp.int32)
        token_ok = tokens < row_end
        tile_q = q_ref.at[pl.ds(tile_start, block_q), kv_head]
        q = plgpu.load(tile_q, mask=token_ok[:, None, None], other=0.0).reshape(rows_m, head_dim)
        q_tokens = jnp.broadcast_to(tokens[:, None], (block_q, group_pad)).reshape(rows_m)
        state = (
            jnp.zeros((rows_m, head_dim), jnp.float32),
            jnp.full((rows_m,), -jnp.inf, jnp.float32),
            jnp.zeros((rows_m,), jnp.float32),
        )
        # ---- phase 1: this split's slice of the cached context: of [0, cached), or with a
        # window of [first, cached), first = the window start of the tile's first query
        # (rounded down to a key block, so chunks start on blocks; keys before it are masked).
        q_pos = num_cached + q_tokens - row_start  # [M]
        first = base = 0
        cached_window = None
        if window is not None:
            first = jnp.maximum(0, num_cached + tile_start - row_start - window + 1)
            base = first - lax.rem(first, block_k)
            cached_window = (first, q_pos - window + 1)
        lo = base + split * keys_per_split
        hi = jnp.minimum(num_cached, lo + keys_per_split)
        where = (layer_ref[0], kv_head, row)
        chunking = _chunking(block_k, kv_ref.shape[4], page_ids_per_chunk)
        state = _attend_cached_keys(
            state,
            q,
            (kv_ref, scales_ref, quantized),
            page_table_ref,
            where,
            (lo, hi),
            cached_window,
            update,
            block_k,
            chunking,
        )
        # ---- phase 2 (last split only): new keys up to the tile's last token, from the
        # first one the tile's window reaches.
        is_last_split = split == pl.num_programs(2) - 1
        end = jnp.where(is_last_split, jnp.minimum(row_end, tile_start + block_q), row_start)
        first_new = row_start
        if window is not None:
            first_new = jnp.maximum(row_start, tile_start - window + 1)
        acc, m, denom = _attend_new_keys(
            state,
            q,
            k_new_ref,
            v_new_ref,
            kv_head,
            (first_new, end),
            q_tokens,
            update,
            block_k,
            window,
        )
        # ---- phase 3: store this split's partial state for the tile's real tokens.
        out = (split, pl.ds(tile_start, block_q), kv_head)
        token_mask = token_ok[:, None]
        plgpu.store(
            acc_ref.at[out], acc.reshape(block_q, group_pad, head_dim), mask=token_mask[..., None]
        )
        plgpu.store(m_ref.at[out], m.reshape(block_q, group_pad), mask=token_mask)
        plgpu.store(l_ref.at[out], denom.reshape(block_q, group_pad), mask=token_mask)


# ----------------------------------------------------------------------------- wrapper


def _validate(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts):
    validate_attention_args(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts)
    kv = kv.pages
    kv_layout(
        num_layers=kv.shape[0],
        num_kv_heads=kv.shape[2],
        num_pages=kv.shape[3],
        page_size=kv.shape[4],
        head_dim=kv.shape[5],
        dtype=kv.dtype,
    )


def _merge_splits(acc, m, denom):
    """Log-sum-exp merge of per-split states: acc [splits, ..., H], m/denom [splits, ...]."""
    m_max = jnp.max(m, axis=0)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    weight = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_max))
    l_total = jnp.sum(weight * denom, axis=0)
    acc_total = jnp.sum(weight[..., None] * acc, axis=0)
    return jnp.where(
        l_total[..., None] > 0, acc_total / jnp.where(l_total > 0, l_total, 1.0)[..., None], 0.0
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "spec",
        "block_q",
        "block_k",
        "num_kv_splits",
        "num_warps",
        "num_stages",
        "page_ids_per_chunk",
        "interpret",
    ),
)
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
    block_q: int | None = None,
    block_k: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    page_ids_per_chunk: int = CHUNK_PAGE_IDS,
    interpret: bool = False,
) -> jax.Array:
    """Causal GQA of a ragged batch over cached pages and new tokens (Pallas GPU kernel).

    Args: as `reference.ragged_paged_attention` (q [T, N, H], k_new/v_new [T, K, H],
      kv (pages [L, 2, K, num_pages, page_size, H], float or int8 / float8_e4m3fn with
      their scales), layer_index i32[], page_table
      i32[S, P], seq_lens i32[S], query_starts i32[S+1], spec), plus tuning (each one not named
      comes from `plan_launches`):
      block_q: tokens per query tile, a power of two; with two launches, of the long rows'
        tiles (the short rows' are decode_block_q tokens).
      block_k: keys per block, a power of two >= 16.
      num_kv_splits: slices of the cached context run in parallel.
      num_warps, num_stages: Triton launch parameters, of every launch.
      page_ids_per_chunk: page ids the cached-key loop holds in registers at a time.
      interpret: run on CPU with Pallas's interpreter.
    Returns: f32[T, N, H]; zeros for padding tokens.
    """
    layer_index = jnp.asarray(layer_index)
    _validate(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts)
    quantized, scales = kv.quantized, kv.scales
    # Quantized pages: the dots run in the queries' dtype, on the dequantized rows.
    dot_dtype = q.dtype if quantized else kv.pages.dtype
    kv = kv.pages
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv.shape[2], kv.shape[4]
    num_seqs, max_pages = page_table.shape
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    plan = plan_launches(
        q.shape,
        kv.shape,
        dot_dtype,  # the dots' width sets the tiles
        page_table.shape,
        block_q=block_q,
        block_k=block_k,
        num_kv_splits=num_kv_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        sliding_window=spec.sliding_window,
    )
    block_q, block_k, num_kv_splits, _, _ = plan[-1].tuning
    if block_q & (block_q - 1) or block_q * group_pad < MIN_DOT_DIM:
        raise ValueError(
            f"block_q={block_q} must be a power of two with block_q * G_pad >= {MIN_DOT_DIM} "
            f"(G_pad={group_pad})"
        )
    if block_k < MIN_DOT_DIM or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two >= {MIN_DOT_DIM}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
    # The cached keys a tile reads: the whole page table, or with a window W at most W - 1
    # from its first query's window start, rounded down to a key block (< W + block_k).
    span = max_pages * page_size
    if spec.sliding_window is not None:
        span = min(span, spec.sliding_window + block_k)
    keys_per_split = -(-span // num_kv_splits)
    keys_per_split = -(-keys_per_split // block_k) * block_k
    if page_ids_per_chunk < 4 or page_ids_per_chunk & (page_ids_per_chunk - 1):
        raise ValueError(f"page_ids_per_chunk={page_ids_per_chunk} must be a power of two >= 4")

    q_groups = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(dot_dtype)
    q_groups = jnp.pad(q_groups, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    before_tiles = (layer_index.reshape(1), page_table, seq_lens, query_starts)
    inputs = before_tiles, (q_groups, k_new, v_new, kv, scales)  # the kernel's, around tiles
    params = dict(
        spec=spec,
        keys_per_split=keys_per_split,
        page_ids_per_chunk=page_ids_per_chunk,
        dot_dtype=dot_dtype,
        precision=_dot_precision(dot_dtype, interpret),
        quantized=quantized,
    )
    states = None
    for launch in plan:
        tiles = launch.tiles(query_starts, num_tokens)
        states = _launch(inputs, tiles, launch, states, interpret=interpret, **params)
    out = _merge_splits(*states)[:, :, :group]  # [T, K, G, H]
    # Tokens no tile covers (padding) were never written: select zeros for them.
    real = jnp.arange(num_tokens) < query_starts[num_seqs]
    return jnp.where(real[:, None, None], out.reshape(num_tokens, num_heads, head_dim), 0.0)


def _launch(inputs, tiles, launch: Launch, states=None, *, interpret, **params):
    """One pallas_call of the kernel over `tiles` (rows, starts): the partial states
    (acc, m, l) of their tokens, written into `states` in place when given."""
    before_tiles, after_tiles = inputs
    block_q, block_k, num_kv_splits, num_warps, num_stages = launch.tuning
    num_tokens, num_kv_heads, group_pad, head_dim = after_tiles[0].shape  # q_groups
    state_shape = (num_kv_splits, num_tokens, num_kv_heads, group_pad)
    args = (*before_tiles, *tiles, *after_tiles)
    kernel = functools.partial(_attention_kernel, block_q=block_q, block_k=block_k, **params)
    aliases = {}
    if states is not None:
        aliases = {len(args) + i: i for i in range(3)}
        args += tuple(states)
        kernel = _skipping_aliased_inputs(kernel)
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((*state_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(state_shape, jnp.float32),
            jax.ShapeDtypeStruct(state_shape, jnp.float32),
        ),
        grid=(tiles[0].shape[0], num_kv_heads, num_kv_splits),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=launch.name,
    )(*args)


def _skipping_aliased_inputs(kernel):
    """The kernel for a call whose 3 state outputs alias 3 extra inputs: it writes through
    the output refs and never reads the inputs."""

    def with_aliases(*refs):
        return kernel(*refs[:-6], *refs[-3:])

    return with_aliases

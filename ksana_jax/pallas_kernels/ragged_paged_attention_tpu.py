"""Ragged paged attention for TPU in Pallas (Mosaic): decode and prefill-chunk rows in one call.

Same semantics as `reference.ragged_paged_attention` (read its docstring): T flattened new
tokens of S rows attend, with grouped-query heads, to their row's cached keys (read from the
paged KV array of layer `layer_index` through the page table) and causally to the step's new
keys of the same row (`k_new`/`v_new`, not yet in the pages). Padding tokens give zeros.

Layout the kernel sees (the wrapper rearranges the small per-token arrays, never the KV):
  q        [K, T_pad * G, H]       row t * G + g = query head k * G + g of token t
  k_new    [K, T_pad, H]           v_new likewise; both stay in HBM (memory_space ANY)
  kv       [L, 2, K, num_pages, page_size, H]  untouched, in HBM (see `kv_layout`)
  out      [K, T_pad * G, H] f32   reshaped back to [T, N, H] by the wrapper
with T_pad = T rounded up to `block_q` and G = N // K query heads per KV head.

Grid: (K KV heads, T_pad / block_q query blocks), both "parallel" (no state crosses grid
steps, so megacore chips may split either axis). A query block is `block_q` consecutive
tokens; it may span several rows (a row of a decode token, the end of a prefill chunk, the
start of the next). Its first and last row are computed by the wrapper and scalar-prefetched
with the page table, context lengths, query offsets and the layer index (all in SMEM).
Page blocks are not a grid axis: the rows of one query block have different context
lengths, so their page blocks are a loop of data-dependent length inside the step (a grid
axis would run max-context steps for every block and could not prefetch across rows).

Copied in at each grid step:
  - the query block [block_q * G, H] by the BlockSpec pipeline (prefetched one step ahead);
  - cached keys/values, phase 1: for each row r of the block and each page block b of r's
    cached context (`pages_per_block` pages), one async DMA per page and per K/V from
    kv[layer, 0|1, k, page_table[r, page]] into a double-buffered VMEM scratch
    [2, pages_per_block, page_size, H]; the copy of the next (row, page block) is started
    before the current one is waited on, across row boundaries, so DMA overlaps compute.
    Only pages holding cached tokens are copied; the rest of the buffer is stale and masked.
    Quantized pages (int8, float8_e4m3fn) come with their rows' float32 scales: one more DMA
    per page and per K/V, kv.scales[layer, 0|1, k, page] -> a VMEM [2, pages_per_block,
    page_size] buffer; the block is dequantized in VMEM (page * scale, f32) after the wait.
  - new keys/values, phase 2: for each row r, the `block_q`-token blocks of k_new/v_new
    from r's first new token up to the query block's end, double-buffered the same way.
With a sliding window W (spec.sliding_window) both phases start at the window start of the
row's first query in the block (its position - W + 1): phase 1 at the page holding it, so
pages wholly before the window are never copied, phase 2 at the k_new block holding it.
Decode over a long context then copies about W positions a row, not the whole context.

Online-softmax state, per query row of the block (f32 VMEM scratch, lane-replicated to 128
like jax's flash attention): running max m [block_q * G, 128], running denominator
l [block_q * G, 128], unnormalised output acc [block_q * G, H]. Every key block updates the
state of all rows with a selected (never multiplied) mask: query token in row r, key
position visible to it (causal, within the window); scores are soft-capped first
(c * tanh(s / c)) when the spec asks. A row that sees nothing in a block keeps its state exactly
(alpha = 1, p = 0). The output is acc / l, and 0 where l == 0 (padding tokens).

Costs of this shape: each key block updates all block_q * G query rows of the block, so
a block of b decode rows does b times the minimal MXU work (decode is memory-bound, and
block_q is one sublane tile for decode buckets); and every query block re-reads its rows'
cached pages, so a prefill chunk's context is read chunk / block_q times.
`default_block_q` picks block_q from the bucket's mean row length to balance the two.

Dots run in the KV dtype with f32 accumulation: for 16-bit KV the queries, new keys and
probabilities are rounded to it (one MXU pass); for f32 KV they run at full f32 precision.
For quantized KV they run in the queries' dtype (f32 at full precision, else bfloat16) on
the dequantized keys and values.

Tiling (Mosaic's rule: the last two dims of a block or VMEM buffer are multiples of the
(8 * packing, 128) tile, or the whole array dims): query/output blocks are
[block_q * G, H] with block_q a multiple of 8 (16 for 16-bit) and H whole; page buffers are
[page_size, H] tiles with page_size a multiple of 8 (16 for bf16, 32 for int8 / fp8) so
pages stack into a [pages_per_block * page_size, H] key block without relayout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ksana_jax.kv_cache import KVCache
from ksana_jax.pallas_kernels.attention_args import validate_attention_args
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
from ksana_jax.pallas_kernels.dma_pipeline_tpu import cdiv, double_buffered_rows_loop

LANES = 128  # the m/l scratch is replicated across one lane tile
DEFAULT_TOKENS_PER_PAGE_BLOCK = 256


def _sublane_tile(dtype) -> int:
    """Rows per Mosaic (sublane x lane) tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * (4 // np.dtype(dtype).itemsize)


def kv_layout(
    *, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype
) -> jax.ShapeDtypeStruct:
    """The KV array this kernel reads: [L, 2, K, num_pages, page_size, H] (kv_cache.py's).

    Each (layer, K/V, KV head, page) is one contiguous [page_size, H] tile, copied by one
    DMA. Raises ValueError for a float16 KV array (Mosaic compiles no float16 vector load:
    "Invalid vector type for load" on v4, v5e, v5p and v6e alike, found by
    benchmarks/tpu_kernel_compile.py) and if page_size breaks Mosaic's sublane tiling for
    `dtype`.
    """
    if np.dtype(dtype) == np.float16:
        raise ValueError(
            "kv_cache_dtype float16 cannot be read on TPU (Mosaic has no float16 vector "
            "loads); use bfloat16 or float32"
        )
    tile = _sublane_tile(dtype)
    if page_size % tile:
        raise ValueError(
            f"page_size={page_size} must be a multiple of {tile} for a {np.dtype(dtype).name} "
            "KV array on TPU (Mosaic sublane tiling)"
        )
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return jax.ShapeDtypeStruct(
        (num_layers, 2, num_kv_heads, num_pages, page_size, head_dim), dtype
    )


# ----------------------------------------------------------------------------- kernel phases


def _dot(a, b, contract_b: int):
    """a [M, c] x b, contracting b's dim `contract_b`, f32 accumulation; full f32 precision
    when the operands are f32 (Mosaic's default would round them to bf16 passes)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def _online_softmax_update(q, k, v, visible, key_valid, spec, m_ref, l_ref, acc_ref):
    """Folds one key block into the running (m, l, acc) of every query row.

    q [M, H] in the dot dtype; k, v [n, H]; visible bool[M, n] (query row sees key);
    key_valid bool[n, H] (the key slot holds real data: values outside it may be NaN and
    are selected away); spec: the scale and soft-cap.
    """
    k = k.astype(q.dtype)
    v = jnp.where(key_valid, v, jnp.zeros_like(v)).astype(q.dtype)
    scores = _dot(q, k, 1) * spec.sm_scale
    if spec.logit_softcap is not None:
        scores = spec.logit_softcap * jnp.tanh(scores / spec.logit_softcap)
    scores = jnp.where(visible, scores, -jnp.inf)  # [M, n]
    m_prev = m_ref[...]  # [M, LANES]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    # A row that has seen nothing yet keeps m = -inf; shift it by 0 so exp gives 0, not NaN.
    m_shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp(scores - m_shift[:, :1])  # masked entries: exp(-inf) = 0
    alpha = jnp.exp(m_prev - m_shift)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[...] = alpha[:, :1] * acc_ref[...] + _dot(p.astype(q.dtype), v, 0)
    m_ref[...] = m_next


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every phase of one grid step (KV head, query block) reads."""

    kv_head: jax.Array
    layer: jax.Array
    block_start: jax.Array  # first token of the query block
    block_q: int
    group: int
    first_row: jax.Array
    last_row: jax.Array  # -1: an all-padding block
    page_table_ref: jax.Array  # i32[S, P] (SMEM)
    seq_lens_ref: jax.Array  # i32[S]
    query_starts_ref: jax.Array  # i32[S + 1]
    q: jax.Array  # [M, H], M = block_q * G
    state: tuple  # (m_ref f32[M, LANES], l_ref f32[M, LANES], acc_ref f32[M, H])
    spec: AttentionSpec

    def row_bounds(self, row):
        return self.query_starts_ref[row], self.query_starts_ref[row + 1]

    def num_cached(self, row):
        row_start, row_end = self.row_bounds(row)
        return self.seq_lens_ref[row] - (row_end - row_start)

    def first_token(self, row):
        """The row's first new token in this query block."""
        return jnp.maximum(self.row_bounds(row)[0], self.block_start)

    def window_start(self, row):
        """The earliest position the row's queries in this block see: the window start of
        its first one (0 without a window)."""
        if self.spec.sliding_window is None:
            return jnp.int32(0)
        row_start = self.row_bounds(row)[0]
        first_pos = self.num_cached(row) + self.first_token(row) - row_start
        return jnp.maximum(0, first_pos - self.spec.sliding_window + 1)

    def in_window(self, tokens, keys, row):
        """bool[M, n]: key positions `keys` within the window of query tokens `tokens`
        (both as token offsets of the row, or both as positions)."""
        if self.spec.sliding_window is None:
            return jnp.ones(tokens.shape, jnp.bool_)
        return keys > tokens - self.spec.sliding_window

    def query_tokens(self, num_keys: int):
        """i32[M, num_keys]: the token of each query row, broadcast along the keys."""
        rows = lax.broadcasted_iota(jnp.int32, (self.q.shape[0], num_keys), 0)
        return self.block_start + lax.div(rows, self.group)

    def update(self, k, v, visible, key_valid):
        _online_softmax_update(self.q, k, v, visible, key_valid, self.spec, *self.state)


def _attend_cached_pages(step: _Step, kv_hbm, scales_hbm, bufs, sems, quantized: bool):
    """Phase 1: every row's cached context, page block by page block, pages DMA'd from the
    page table into k_buf/v_buf [2, pages_per_block, page_size, H] (double-buffered), and for
    `quantized` pages their scales into k_scale_buf/v_scale_buf [2, pages_per_block,
    page_size]. With a sliding window a row's blocks start at the page holding its window
    start: pages wholly before it are never copied."""
    k_buf, v_buf, k_scale_buf, v_scale_buf = bufs
    pages_per_block, page_size, head_dim = k_buf.shape[1:]
    keys_per_block = pages_per_block * page_size
    max_pages = step.page_table_ref.shape[1]

    def first_page(row):
        return lax.div(step.window_start(row), page_size)

    def num_blocks(row):
        keys = jnp.maximum(0, step.num_cached(row) - first_page(row) * page_size)
        return jnp.maximum(1, cdiv(keys, keys_per_block))

    def copies(row, block, slot):
        num_pages = cdiv(step.num_cached(row), page_size)
        out = []
        for i in range(pages_per_block):
            index = first_page(row) + block * pages_per_block + i
            page = step.page_table_ref[row, jnp.minimum(index, max_pages - 1)]
            for buf, scale_buf, kv_index in ((k_buf, k_scale_buf, 0), (v_buf, v_scale_buf, 1)):
                srcs = [(kv_hbm, buf)] + ([(scales_hbm, scale_buf)] if quantized else [])
                for src, dst in srcs:
                    src = src.at[step.layer, kv_index, step.kv_head, page]
                    copy = pltpu.make_async_copy(src, dst.at[slot, i], sems.at[kv_index, slot])
                    out.append((copy, index < num_pages))  # only pages holding cached tokens
        return out

    def load(buf, scale_buf, slot):
        """A block's keys or values [keys_per_block, H], dequantized (f32) if quantized."""
        x = buf[slot]
        if quantized:  # rows times their scales, in VMEM; NaN scales of unowned rows stay masked
            x = x.astype(jnp.float32) * scale_buf[slot][:, :, None]
        return x.reshape(keys_per_block, head_dim)

    def attend(row, block, slot):
        cached = step.num_cached(row)
        first_key = (first_page(row) + block * pages_per_block) * page_size

        @pl.when(first_key < cached)
        def _():
            k = load(k_buf, k_scale_buf, slot)
            v = load(v_buf, v_scale_buf, slot)
            tokens = step.query_tokens(keys_per_block)
            keys = first_key + lax.broadcasted_iota(jnp.int32, tokens.shape, 1)
            row_start, row_end = step.row_bounds(row)
            visible = (tokens >= row_start) & (tokens < row_end) & (keys < cached)
            visible &= step.in_window(cached + tokens - row_start, keys, row)
            key_ids = first_key + lax.broadcasted_iota(jnp.int32, k.shape, 0)
            key_valid = (key_ids < cached) & (key_ids >= step.window_start(row))
            step.update(k, v, visible, key_valid)

    double_buffered_rows_loop(step.first_row, step.last_row, num_blocks, copies, attend)


def _attend_new_tokens(step: _Step, k_new_hbm, v_new_hbm, k_buf, v_buf, sems):
    """Phase 2: every row's new keys up to the block's last token, causal, in block_q-token
    blocks DMA'd from k_new/v_new [K, T_pad, H] into k_buf/v_buf [2, block_q, H], from the
    block holding the window start of the row's first query here (the row's start without
    a window)."""
    block_q, head_dim = k_buf.shape[1:]
    block_end = step.block_start + block_q

    def first_block_and_count(row):
        row_start, row_end = step.row_bounds(row)
        first_key = row_start
        if step.spec.sliding_window is not None:
            first_key = jnp.maximum(row_start, step.first_token(row) - step.spec.sliding_window + 1)
        lo = lax.div(first_key, block_q)
        hi = lax.div(jnp.maximum(jnp.minimum(row_end, block_end) - 1, 0), block_q)
        return lo, jnp.maximum(1, hi - lo + 1)

    def first_key(row, block):
        return (first_block_and_count(row)[0] + block) * block_q

    def copies(row, block, slot):
        window = pl.ds(pl.multiple_of(first_key(row, block), block_q), block_q)
        return [
            (
                pltpu.make_async_copy(src.at[step.kv_head, window], buf.at[slot], sems.at[i, slot]),
                True,
            )
            for i, src, buf in ((2, k_new_hbm, k_buf), (3, v_new_hbm, v_buf))
        ]

    def attend(row, block, slot):
        start = first_key(row, block)
        row_start, row_end = step.row_bounds(row)
        tokens = step.query_tokens(block_q)
        keys = start + lax.broadcasted_iota(jnp.int32, tokens.shape, 1)
        in_row = (tokens >= row_start) & (tokens < row_end)
        visible = in_row & (keys >= row_start) & (keys <= tokens)
        visible &= step.in_window(tokens, keys, row)
        key_ids = start + lax.broadcasted_iota(jnp.int32, (block_q, head_dim), 0)
        key_valid = (key_ids >= row_start) & (key_ids < row_end)
        step.update(k_buf[slot], v_buf[slot], visible, key_valid)

    def num_blocks(row):
        return first_block_and_count(row)[1]

    double_buffered_rows_loop(step.first_row, step.last_row, num_blocks, copies, attend)


def _attention_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # i32[1]
    page_table_ref,  # i32[S, P]
    seq_lens_ref,  # i32[S]
    query_starts_ref,  # i32[S + 1]
    first_row_ref,  # i32[num_q_blocks]
    last_row_ref,  # i32[num_q_blocks]  (-1 for an all-padding block)
    # inputs
    q_ref,  # [M, H]   M = block_q * G, in the dot dtype
    k_new_hbm,  # [K, T_pad, H]
    v_new_hbm,  # [K, T_pad, H]
    kv_hbm,  # [L, 2, K, num_pages, page_size, H]
    scales_hbm,  # f32[L, 2, K, num_pages, page_size] (quantized), else a placeholder
    # output
    o_ref,  # f32[M, H]
    # scratch
    k_pages_buf,  # [2, pages_per_block, page_size, H]
    v_pages_buf,  # [2, pages_per_block, page_size, H]
    k_scales_buf,  # f32[2, pages_per_block, page_size] (unused for float pages)
    v_scales_buf,  # f32[2, pages_per_block, page_size]
    k_new_buf,  # [2, block_q, H]
    v_new_buf,  # [2, block_q, H]
    sems,  # DMA[4, 2]: (K pages, V pages, K new, V new) x slot
    m_ref,  # f32[M, LANES]
    l_ref,  # f32[M, LANES]
    acc_ref,  # f32[M, H]
    *,
    spec: AttentionSpec,
    group: int,
    quantized: bool,
):
    kv_head, q_block = pl.program_id(0), pl.program_id(1)
    block_q = q_ref.shape[0] // group
    # ---- phase 0: empty online-softmax state.
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    step = _Step(
        kv_head=kv_head,
        layer=layer_ref[0],
        block_start=q_block * block_q,
        block_q=block_q,
        group=group,
        first_row=first_row_ref[q_block],
        last_row=last_row_ref[q_block],
        page_table_ref=page_table_ref,
        seq_lens_ref=seq_lens_ref,
        query_starts_ref=query_starts_ref,
        q=q_ref[...],
        state=(m_ref, l_ref, acc_ref),
        spec=spec,
    )
    page_bufs = (k_pages_buf, v_pages_buf, k_scales_buf, v_scales_buf)
    _attend_cached_pages(step, kv_hbm, scales_hbm, page_bufs, sems, quantized)  # phase 1
    _attend_new_tokens(step, k_new_hbm, v_new_hbm, k_new_buf, v_new_buf, sems)  # phase 2
    # ---- phase 3: normalise and store; rows that saw no key (padding tokens) give 0.
    denom = l_ref[...][:, :1]
    seen = denom > 0.0
    o_ref[...] = jnp.where(seen, acc_ref[...] / jnp.where(seen, denom, 1.0), 0.0)


# ----------------------------------------------------------------------------- wrapper


def _dot_dtype(q_dtype, kv: KVCache):
    """Float KV: its own dtype; quantized KV: float32 for float32 queries, else bfloat16."""
    if kv.quantized:
        return jnp.float32 if q_dtype == jnp.float32 else jnp.bfloat16
    return kv.pages.dtype


def _block_q_tile(q_dtype, k_new_dtype, kv: KVCache) -> int:
    """The sublane tile block_q must be a multiple of: the queries' (in the dot dtype) and
    the new keys' blocks are [block_q (* G), H]."""
    return max(_sublane_tile(k_new_dtype), _sublane_tile(_dot_dtype(q_dtype, kv)))


def _validate(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts, block_q):
    validate_attention_args(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts)
    tile = _block_q_tile(q.dtype, k_new.dtype, kv)
    kv = kv.pages
    kv_layout(
        num_layers=kv.shape[0],
        num_kv_heads=kv.shape[2],
        num_pages=kv.shape[3],
        page_size=kv.shape[4],
        head_dim=kv.shape[5],
        dtype=kv.dtype,
    )
    if block_q <= 0 or block_q % tile:
        raise ValueError(
            f"block_q={block_q} must be a positive multiple of {tile} for {kv.dtype} KV and "
            f"{k_new.dtype} new K/V (Mosaic sublane tiling)"
        )


def default_block_q(num_tokens: int, num_seqs: int, tile: int) -> int:
    """Tokens per query block: about the mean row length (decode buckets: one sublane tile,
    so little MXU work is spent on other rows' queries; prefill buckets: up to 128, so a
    row's cached pages are re-read by fewer blocks). A power of two >= `tile`."""
    mean_row = max(1, num_tokens // max(1, num_seqs))
    return int(min(128, max(tile, 1 << (mean_row - 1).bit_length())))


def _rows_of_query_blocks(query_starts, num_blocks: int, block_q: int):
    """First and last row of every query block (last = -1 when the block is all padding)."""
    num_seqs = query_starts.shape[0] - 1
    total = query_starts[num_seqs]
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    last_tokens = jnp.minimum(starts + block_q, total) - 1

    def row_of(tokens):
        # compare_all: one fused op, where the default binary search is a while loop.
        rows = jnp.searchsorted(query_starts, tokens, side="right", method="compare_all")
        rows = rows.astype(jnp.int32) - 1
        return jnp.clip(rows, 0, num_seqs - 1)

    last = jnp.where(starts < total, row_of(last_tokens), -1)
    return row_of(starts), last


@functools.partial(
    jax.jit,
    static_argnames=("spec", "block_q", "pages_per_block", "vmem_limit_bytes", "interpret"),
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
    pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Causal GQA of a ragged batch over cached pages and new tokens (Pallas TPU kernel).

    Args: as `reference.ragged_paged_attention` (q [T, N, H], k_new/v_new [T, K, H],
      kv (pages [L, 2, K, num_pages, page_size, H], float or int8 / float8_e4m3fn with
      their scales), layer_index i32[], page_table i32[S, P],
      seq_lens i32[S], query_starts i32[S+1], spec), plus tuning:
      block_q: tokens per query block, a multiple of the sublane tile (8; 16 for 16-bit
        K/V). Default: `default_block_q`.
      pages_per_block: pages per cached key block (default: 256 tokens' worth, <= P).
      vmem_limit_bytes: Mosaic's scoped VMEM limit (None: the compiler's default).
      interpret: True (or pltpu.InterpretParams) runs the kernel on CPU.
    Returns: f32[T, N, H]; zeros for padding tokens.
    """
    layer_index = jnp.asarray(layer_index)
    if block_q is None:
        tile = _block_q_tile(q.dtype, k_new.dtype, kv)
        block_q = default_block_q(q.shape[0], page_table.shape[0], tile)
    _validate(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts, block_q)
    quantized, dot_dtype, scales = kv.quantized, _dot_dtype(q.dtype, kv), kv.scales
    kv = kv.pages
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv.shape[2], kv.shape[4]
    group = num_heads // num_kv_heads
    max_pages = page_table.shape[1]
    if pages_per_block is None:
        pages_per_block = max(1, min(max_pages, DEFAULT_TOKENS_PER_PAGE_BLOCK // page_size))
    if not 0 < pages_per_block <= max_pages:
        raise ValueError(f"pages_per_block={pages_per_block} must be in [1, P={max_pages}]")

    num_blocks = pl.cdiv(num_tokens, block_q)
    padded = num_blocks * block_q
    pad = ((0, padded - num_tokens), (0, 0), (0, 0))
    # [T, N, H] -> [K, T_pad * G, H]: a KV head's query heads of consecutive tokens are rows.
    q_rows = jnp.pad(q.astype(dot_dtype), pad).reshape(padded, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded * group, head_dim)
    k_new_t = jnp.pad(k_new, pad).transpose(1, 0, 2)  # [K, T_pad, H]
    v_new_t = jnp.pad(v_new, pad).transpose(1, 0, 2)
    first_rows, last_rows = _rows_of_query_blocks(query_starts, num_blocks, block_q)

    rows_m = block_q * group
    row_block = pl.BlockSpec((None, rows_m, head_dim), lambda k, i, *_: (k, i, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    page_buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), kv.dtype)
    scale_buf = pltpu.VMEM((2, pages_per_block if quantized else 1, page_size), jnp.float32)
    new_buf = pltpu.VMEM((2, block_q, head_dim), k_new.dtype)
    out = pl.pallas_call(
        functools.partial(_attention_kernel, spec=spec, group=group, quantized=quantized),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, padded * group, head_dim), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_kv_heads, num_blocks),
            in_specs=[row_block, any_spec, any_spec, any_spec, any_spec],
            out_specs=row_block,
            scratch_shapes=[
                page_buf,
                page_buf,
                scale_buf,
                scale_buf,
                new_buf,
                new_buf,
                pltpu.SemaphoreType.DMA((4, 2)),
                pltpu.VMEM((rows_m, LANES), jnp.float32),
                pltpu.VMEM((rows_m, LANES), jnp.float32),
                pltpu.VMEM((rows_m, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        layer_index.reshape(1),
        page_table,
        seq_lens,
        query_starts,
        first_rows,
        last_rows,
        q_rows,
        k_new_t,
        v_new_t,
        kv,
        scales,
    )
    out = out.reshape(num_kv_heads, padded, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded, num_heads, head_dim)[:num_tokens]

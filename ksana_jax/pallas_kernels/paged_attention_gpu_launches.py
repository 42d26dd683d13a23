"""How the Pallas GPU attention kernel (paged_attention_gpu.py) is launched for a bucket of
given shapes: its tuning (`resolve_tuning`) and its launches (`plan_launches`), with each
launch's list of query tiles. Plain shape arithmetic, apart from the tile lists, which are
computed in the step from query_starts."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

MIN_DOT_DIM = 16  # Triton's tl.dot needs M, N, K >= 16


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _query_tiles(query_starts, num_tiles: int, block_q: int, rows_taken=None):
    """Row and first token of every query tile (rows cut into block_q-token tiles, in order);
    row -1 for the entries past the last tile. `rows_taken` (bool[S]): only those rows."""
    counts = query_starts[1:] - query_starts[:-1]
    if rows_taken is not None:
        counts = jnp.where(rows_taken, counts, 0)
    tiles_per_row = lax.div(counts + block_q - 1, block_q)
    tile_ends = jnp.cumsum(tiles_per_row)  # [S]
    ids = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fused op. The default binary search is an XLA while loop, and on a GPU
    # every trip of one waits for the host: several launches around a ~0.1 ms kernel.
    rows = jnp.searchsorted(tile_ends, ids, side="right", method="compare_all").astype(jnp.int32)
    safe_rows = jnp.minimum(rows, counts.shape[0] - 1)
    first_tile = tile_ends[safe_rows] - tiles_per_row[safe_rows]
    starts = query_starts[safe_rows] + (ids - first_tile) * block_q
    return jnp.where(ids < tile_ends[-1], safe_rows, -1), starts


class Tuning(NamedTuple):
    """A launch of the kernel: query tile, key block, key splits, Triton's parameters."""

    block_q: int
    block_k: int
    num_kv_splits: int
    num_warps: int
    num_stages: int


def decode_block_q(group: int) -> int:
    """Tokens per query tile for decode rows: the fewest whose queries make the 16 rows a
    dot needs (G_pad query rows a token)."""
    return max(1, MIN_DOT_DIM // next_pow2(group))


def default_block_q(num_tokens: int, num_seqs: int, group: int, max_rows: int = 128) -> int:
    """Tokens per query tile: about the mean row length, with block_q * G_pad in
    [16, max_rows]."""
    group_pad = next_pow2(group)
    lo = max(1, MIN_DOT_DIM // group_pad)
    hi = max(lo, max_rows // group_pad)
    return int(np.clip(next_pow2(max(1, num_tokens // max(1, num_seqs))), lo, hi))


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """About how many query tiles a bucket's rows cut into: every row at least one."""
    return max(num_seqs, -(-num_tokens // block_q))


TARGET_PROGRAMS = 1024  # ~8 resident programs per SM on a 132-SM H200: enough loads in flight
MIN_KEYS_PER_SPLIT = 256


def default_num_kv_splits(
    num_query_tiles: int, num_kv_heads: int, max_context: int, block_k: int
) -> int:
    """Key splits so that a decode batch keeps every SM streaming: about TARGET_PROGRAMS
    programs, each still at least MIN_KEYS_PER_SPLIT keys (whole blocks), at most 64.

    Programs are query tiles x KV heads x splits, so a long prefill, whose tiles already
    fill the GPU, gets few splits or none: each split writes a float32 partial output for
    every query, which the merge then reads back.
    """
    programs = num_query_tiles * num_kv_heads
    splits = min(64, -(-TARGET_PROGRAMS // programs))
    longest = max(1, max_context // max(MIN_KEYS_PER_SPLIT, block_k))
    return max(1, min(splits, longest))


def resolve_tuning(
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    kv_dtype,
    page_table_shape: tuple[int, ...],
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
) -> Tuning:
    """The launch for a batch of these shapes: what the caller names, defaults for the rest.

    The defaults were read off the kernel compiled without a GPU for an H200 (sm_90a), an
    A100 (sm_80) and an L4 (sm_89) by XLA:GPU with jaxlib's own Triton, then `ptxas -v`
    (`benchmarks/gpu_aot_compile.py`), at Llama-3-8B and SmolLM2 shapes: register spills of
    48 bytes at most, shared memory under the 99 KB a program may use on sm_86/89, and copies
    kept in flight where that fits;
    `benchmarks/attention_sweep.py` times the alternatives on a GPU.
      - 16-bit KV: 64-key blocks, tiles of up to 128 query rows (tokens x G_pad), at head
        dims up to 128. Tiles of
        <= 32 rows (decode) run 4 warps, 3 stages: only from 3 stages does the cached-key
        loop keep the next block's K/V copies in flight while it computes
        (`cp.async.wait_group 2`; with 2 it waits for every copy at each block). Larger
        tiles run 8 warps (at 4, a 128-row tile at head dim 128 spills up to 828 bytes of
        registers) and 3 stages too. An 8-warp tile takes 128-236 registers a thread, so
        registers or shared memory hold an SM to one or two such programs, and on the H200,
        A100 and L4 as many fit at 3 stages as at 2: the third stage costs no occupancy,
        keeps copies in flight, and fits each GPU's shared memory (L4: 96.5 of 99 KB). Past
        head dim 128 they run 2 stages: 3 would need 100 KB.
      - float32 KV (3xTF32 dots; twice the bytes of 16-bit KV in registers and shared
        memory): 32-key blocks and tiles of up to 4096 / head_dim rows (64-key blocks or
        128-row tiles spill, or pass even an H100's 227 KB). Decode tiles run 4 warps, 3
        stages (84 KB at head dim 128); from 32 rows on 8 warps, 2 stages (72 KB; 3 stages
        would take 104). Past head dim 128 (tiles of 16 rows) 8 warps, 3 stages: at 4 warps
        they spilled 64-164 bytes; 8 take the same 98 KB and spill none.
      - past head dim 128 the key block and the tile rows shrink in proportion (head dim
        256: 32-key blocks and 64-row tiles for 16-bit KV, 16 and 16 for float32); at the
        128-wide sizes a 256-wide head took 138-192 KB of shared memory.
    With a `sliding_window` W the key splits divide the window's span (W + block_k keys)
    instead of the page table's.
    """
    num_tokens, num_heads, head_dim = q_shape
    num_kv_heads, page_size = kv_shape[2], kv_shape[4]
    num_seqs, max_pages = page_table_shape
    group = num_heads // num_kv_heads
    wide = jnp.dtype(kv_dtype) == jnp.float32
    if block_q is None:
        max_rows = int(np.clip((4096 if wide else 16384) // head_dim, MIN_DOT_DIM, 128))
        block_q = default_block_q(num_tokens, num_seqs, group, max_rows)
    if block_k is None:
        base = 32 if wide else 64
        block_k = max(MIN_DOT_DIM, min(base, base * 128 // head_dim))
    if num_kv_splits is None:
        max_context = max_pages * page_size
        if sliding_window is not None:
            max_context = min(max_context, sliding_window + block_k)
        num_kv_splits = default_num_kv_splits(
            num_query_tiles(num_tokens, num_seqs, block_q), num_kv_heads, max_context, block_k
        )
    rows = block_q * next_pow2(group)
    if wide:
        warps, stages = (8, 2) if rows >= 32 else (8 if head_dim > 128 else 4, 3)
    else:
        warps, stages = (4, 3) if rows <= 32 else (8, 3 if head_dim <= 128 else 2)
    return Tuning(
        block_q,
        block_k,
        num_kv_splits,
        warps if num_warps is None else num_warps,
        stages if num_stages is None else num_stages,
    )


KERNEL_NAME = "ragged_paged_attention_gpu"
SHORT_ROWS_KERNEL_NAME = "ragged_paged_attention_short_rows_gpu"


class Launch(NamedTuple):
    """One pallas_call of the kernel: its name, its tuning, and the rows it takes, those of
    lo < new tokens <= hi for new_tokens = (lo, hi)."""

    name: str
    tuning: Tuning
    new_tokens: tuple[int, int]

    def tiles(self, query_starts, num_tokens: int):
        """Row and first token of each of this launch's query tiles (`_query_tiles`), with
        room for any batch of the bucket: at most T // (lo + 1) rows have more than lo
        tokens, a row of at most block_q tokens is one tile, and every tile holds a token."""
        lo, hi = self.new_tokens
        block_q = self.tuning.block_q
        num_seqs = query_starts.shape[0] - 1
        rows = min(num_seqs, num_tokens // (lo + 1)) if lo >= 0 else num_seqs
        most = rows if hi <= block_q else pl.cdiv(num_tokens, block_q) + rows
        num_tiles = min(most, num_tokens)
        counts = query_starts[1:] - query_starts[:-1]
        taken = (counts > lo) & (counts <= hi)
        return _query_tiles(query_starts, num_tiles, block_q, taken)


def plan_launches(
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    kv_dtype,
    page_table_shape: tuple[int, ...],
    **named,
) -> list[Launch]:
    """The kernel's launches for a bucket of these shapes (`named`: as `resolve_tuning`).

    One launch when its tiles are decode-sized already, or the bucket has one token a row,
    or one row. Otherwise two, writing one set of partial states: the short rows (up to
    decode_block_q new tokens: decode, speculative tokens) in decode-sized tiles, then the
    long rows (prefill chunks) in block_q tiles. A single block_q would give each decode
    token of a mixed batch a whole prefill tile of query rows to compute: 32x the products
    a decode row needs at Llama-3-8B shapes (128 rows for 4). The plan follows the shapes
    alone, so a bucket of prefill chunks only also pays the short launch, whose programs
    find no rows and exit at once.
    """
    tuning = resolve_tuning(q_shape, kv_shape, kv_dtype, page_table_shape, **named)
    num_tokens, num_heads, _ = q_shape
    num_seqs = page_table_shape[0]
    short_q = decode_block_q(num_heads // kv_shape[2])
    if tuning.block_q <= short_q or num_tokens <= num_seqs or num_seqs == 1:
        return [Launch(KERNEL_NAME, tuning, (-1, num_tokens))]
    shared = dict(block_k=tuning.block_k, num_kv_splits=tuning.num_kv_splits)
    short = resolve_tuning(
        q_shape, kv_shape, kv_dtype, page_table_shape, **{**named, **shared, "block_q": short_q}
    )
    return [
        Launch(SHORT_ROWS_KERNEL_NAME, short, (-1, short_q)),
        Launch(KERNEL_NAME, tuning, (short_q, num_tokens)),
    ]

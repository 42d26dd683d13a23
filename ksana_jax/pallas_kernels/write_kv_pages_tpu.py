"""Writes the step's new K/V into the paged KV array, in place, in Pallas for TPU (Mosaic).

Same semantics as `reference.write_kv_pages` (every layer at once) and
`reference.write_layer_kv` (one layer, as the model writes before each layer's attention):
token t's keys/values go to slot `slot_ids[t]` (page slot // page_size, row
slot % page_size) of each layer written; nothing else changes.
The KV array is aliased to the output (`input_output_aliases`), so under a donating jit
the write is in place and only the touched pages move.

Why whole pages: in the KV layout [L, 2, K, num_pages, page_size, H] a token's slot is a
row of a [page_size, H] tile, and Mosaic copies and slices tiled dims only at tile
boundaries. So the kernel reads each touched page, replaces the written rows with a
select (row index == slot), and writes the page back: never a sub-tile DMA, never a
dynamic sublane index.

The wrapper sorts the tokens by slot and groups them by page (scalar-prefetched: each
group's page, its range in the sorted order, the sorted token ids and in-page rows).

Grid: (layers written, T page groups), "parallel" x "arbitrary". At step (l, g):
  - copied in: page group_pages[g] of layer first_layer + l (both scalar-prefetched, read
    by the BlockSpec index map), all K/V heads, [2, K, page_size, H]; the layer's new rows
    [T, 2, K, H] (fetched once per layer);
  - computed: for each token of the group in slot order, rows of the page tile replaced
    by select (a later duplicate slot wins, as in a sequential scatter);
  - copied out: the page block, back to the same page (aliased).
Steps past the last group keep the last group's block index, so Pallas neither fetches
nor writes anything for them.

Quantized pages (int8, float8_e4m3fn): the wrapper quantizes the new rows
(`reference.quantize_new_rows`), the kernel writes the quantized rows as above, and their
float32 scales are scattered into kv.scales by XLA (`reference.write_scales`; a scales
row is one sublane of a tile, which Mosaic would have to copy tile by tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ksana_jax.kv_cache import KVCache
from ksana_jax.pallas_kernels import reference
from ksana_jax.pallas_kernels.attention_args import layer_as_array, validate_write_args
from ksana_jax.pallas_kernels.ragged_paged_attention_tpu import kv_layout

__all__ = ["kv_layout", "write_kv_pages", "write_layer_kv"]


def _write_kernel(
    # scalar prefetch (SMEM)
    first_layer_ref,  # i32[1]  layer of kv that grid layer 0 writes
    group_pages_ref,  # i32[T]  page of each group (clamped past the last group)
    group_starts_ref,  # i32[T + 1]  group g is sorted tokens [starts[g], starts[g + 1])
    sorted_tokens_ref,  # i32[T]
    sorted_rows_ref,  # i32[T]  row in its page of each sorted token
    num_groups_ref,  # i32[1]
    # inputs
    new_ref,  # [T, 2, K, H]  this layer's new rows
    kv_in_ref,  # [2, K, page_size, H]  the group's page (aliased with the output)
    # output
    kv_out_ref,  # [2, K, page_size, H]
):
    del first_layer_ref  # used by the index maps only
    group = pl.program_id(1)
    _, num_kv_heads, page_size, head_dim = kv_out_ref.shape

    @pl.when(group < num_groups_ref[0])
    def _():
        # ---- copy the page, then overwrite its written rows token by token.
        kv_out_ref[...] = kv_in_ref[...]
        rows = lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0)

        def write_token(j, carry):
            token, row = sorted_tokens_ref[j], sorted_rows_ref[j]
            new_rows = new_ref[token].astype(kv_out_ref.dtype)  # [2, K, H]
            for kv_index in range(2):
                for head in range(num_kv_heads):
                    new_row = new_rows[kv_index, head : head + 1, :]  # [1, H]
                    tile = kv_out_ref[kv_index, head]
                    kv_out_ref[kv_index, head] = jnp.where(rows == row, new_row, tile)
            return carry

        lax.fori_loop(group_starts_ref[group], group_starts_ref[group + 1], write_token, 0)


def _page_groups(slot_ids, page_size: int):
    """Tokens sorted by slot, grouped by page: (group_pages, group_starts, sorted tokens,
    their rows in the page, number of groups)."""
    num_tokens = slot_ids.shape[0]
    order = jnp.argsort(slot_ids, stable=True).astype(jnp.int32)
    sorted_slots = slot_ids[order]
    pages = lax.div(sorted_slots, page_size)
    is_first = jnp.concatenate([jnp.ones(1, bool), pages[1:] != pages[:-1]])
    group_ids = jnp.cumsum(is_first.astype(jnp.int32)) - 1
    num_groups = group_ids[-1] + 1
    group_pages = jnp.zeros(num_tokens, jnp.int32).at[group_ids].set(pages)
    # Past the last group, repeat its page: the pipeline then skips those steps' copies.
    last_page = group_pages[num_groups - 1]
    group_pages = jnp.where(jnp.arange(num_tokens) < num_groups, group_pages, last_page)
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    group_starts = jnp.full(num_tokens + 1, num_tokens, jnp.int32).at[group_ids].min(positions)
    return group_pages, group_starts, order, lax.rem(sorted_slots, page_size), num_groups[None]


def _write_pages(kv, new_rows, slot_ids, first_layer, vmem_limit_bytes, interpret):
    """new_rows [L', T, 2, K, H] into layers first_layer .. first_layer + L' - 1 of kv."""
    num_new_layers, num_tokens, _, num_kv_heads, head_dim = new_rows.shape
    page_size = kv.shape[4]
    kv_layout(
        num_layers=kv.shape[0],
        num_kv_heads=num_kv_heads,
        num_pages=kv.shape[3],
        page_size=page_size,
        head_dim=head_dim,
        dtype=kv.dtype,
    )
    prefetch = (first_layer, *_page_groups(slot_ids, page_size))
    page_block = pl.BlockSpec(
        (None, 2, num_kv_heads, None, page_size, head_dim),
        lambda layer, group, first_layer, group_pages, *_: (
            first_layer[0] + layer,
            0,
            0,
            group_pages[group],
            0,
            0,
        ),
    )
    return pl.pallas_call(
        _write_kernel,
        out_shape=jax.ShapeDtypeStruct(kv.shape, kv.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_new_layers, num_tokens),
            in_specs=[
                pl.BlockSpec(
                    (None, num_tokens, 2, num_kv_heads, head_dim),
                    lambda layer, group, *_: (layer, 0, 0, 0, 0),
                ),
                page_block,
            ],
            out_specs=page_block,
        ),
        # Operands: the prefetched scalars, new_rows, then kv (aliased to output 0).
        input_output_aliases={len(prefetch) + 1: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="write_kv_pages_tpu",
    )(*prefetch, new_rows, kv)


@functools.partial(jax.jit, static_argnames=("vmem_limit_bytes", "interpret"))
def write_kv_pages(
    kv: KVCache,
    new_kv: jax.Array,
    slot_ids: jax.Array,
    *,
    vmem_limit_bytes: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> KVCache:
    """Scatters every layer's new K/V rows into their slots of the KV array, in place.

    Args:
      kv: pages [L, 2, K, num_pages, page_size, H] (aliased to the result; donate it to the
        enclosing jit so no copy is made) and, for int8 / fp8 pages, their row scales.
      new_kv: [L, 2, T, K, H] each layer's new keys (index 0) and values (index 1);
        quantized here for quantized pages.
      slot_ids: i32[T] flat slot (page * page_size + offset) of each token.
      vmem_limit_bytes: Mosaic's scoped VMEM limit (a layer's new rows, T * 2 * K * H,
        sit in VMEM double-buffered).
      interpret: True (or pltpu.InterpretParams) runs the kernel on CPU.
    Returns: kv with exactly those T slots of every layer overwritten.
    """
    validate_write_args(kv, new_kv, slot_ids)
    if new_kv.shape[0] != kv.pages.shape[0]:
        raise ValueError(f"new_kv must have all {kv.pages.shape[0]} layers, got {new_kv.shape[0]}")
    values, new_scales = reference.quantize_new_rows(kv, new_kv)
    new_rows = values.transpose(0, 2, 1, 3, 4)  # [L, T, 2, K, H]: a token's rows lead
    first_layer = jnp.zeros(1, jnp.int32)
    pages = _write_pages(kv.pages, new_rows, slot_ids, first_layer, vmem_limit_bytes, interpret)
    if new_scales is None:
        return KVCache(pages, kv.scales)
    return KVCache(pages, reference.write_scales(kv.scales, None, new_scales, slot_ids))


def write_layer_kv(
    kv: KVCache,
    layer_index: int | jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_ids: jax.Array,
    *,
    vmem_limit_bytes: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> KVCache:
    """`write_kv_pages` for one layer (`reference.write_layer_kv`), in place.

    Args:
      kv: pages [L, 2, K, num_pages, page_size, H] (aliased to the result), with scales
        for int8 / fp8 pages (the new rows are quantized here).
      layer_index: the layer to write (a Python int is range-checked; a traced i32 scalar
        cannot be). Either way it is data, so all layers share one compiled kernel.
      k_new, v_new: [T, K, H] the layer's new keys and values.
      slot_ids: i32[T] flat slot of each token.
    Returns: kv with those T slots of layer `layer_index` overwritten.
    """
    first_layer = layer_as_array(layer_index, kv.pages.shape[0])
    return _write_layer_kv(
        kv,
        first_layer,
        k_new,
        v_new,
        slot_ids,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("vmem_limit_bytes", "interpret"))
def _write_layer_kv(kv, first_layer, k_new, v_new, slot_ids, *, vmem_limit_bytes, interpret):
    new_kv = jnp.stack([k_new, v_new])[None]  # [1, 2, T, K, H]
    validate_write_args(kv, new_kv, slot_ids)
    values, new_scales = reference.quantize_new_rows(kv, new_kv)
    new_rows = values.transpose(0, 2, 1, 3, 4)
    pages = _write_pages(kv.pages, new_rows, slot_ids, first_layer, vmem_limit_bytes, interpret)
    if new_scales is None:
        return KVCache(pages, kv.scales)
    scales = reference.write_scales(kv.scales, first_layer[0], new_scales[0], slot_ids)
    return KVCache(pages, scales)

"""Writes the step's new K/V into the paged KV array, in place, in Pallas for GPU (Triton).

Same semantics as `reference.write_kv_pages` (every layer at once) and
`reference.write_layer_kv` (one layer, as the model writes before each layer's attention):
token t's keys/values go to slot `slot_ids[t]` (page slot // page_size, row
slot % page_size) of each layer written; nothing else changes.
The KV array is aliased to the output (`input_output_aliases`), so under a donating jit
the write is in place and only the written rows move. Lowering: Triton, for the reasons
given in paged_attention_gpu.py (a scatter is a pointer store).

Grid: (T / block_t token blocks, layers written). Each program loads its tokens' slots,
and for each of K and V and each KV head loads the [block_t, H] new rows and scatters
them to kv[first_layer + l, 0|1, head, page, row, :]. T is padded to whole blocks by
repeating the last token (an identical write), so no lane is masked.
If two tokens name the same slot (padding tokens all write the sink page) either may win,
as with XLA's scatter.
Quantized pages (int8, float8_e4m3fn): the wrapper quantizes the new rows
(`reference.quantize_new_rows`), the kernel stores the quantized rows as above, and XLA
scatters their float32 scales into kv.scales (`reference.write_scales`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ksana_jax.kv_cache import KVCache
from ksana_jax.pallas_kernels import reference
from ksana_jax.pallas_kernels.attention_args import layer_as_array, validate_write_args
from ksana_jax.pallas_kernels.paged_attention_gpu import kv_layout

__all__ = ["kv_layout", "write_kv_pages", "write_layer_kv"]


def _write_kernel(first_layer_ref, slot_ids_ref, new_ref, kv_in_ref, kv_ref, *, block_t: int):
    """first_layer i32[1]; slot_ids i32[T_pad]; new [L', 2, T_pad, K, H]; kv_in/kv
    [L, 2, K, num_pages, page_size, H] (the same buffer: kv_in is never read)."""
    del kv_in_ref
    token_block, new_layer = pl.program_id(0), pl.program_id(1)
    layer = first_layer_ref[0] + new_layer
    num_kv_heads, head_dim = new_ref.shape[3:]
    page_size = kv_ref.shape[4]
    tokens = pl.ds(token_block * block_t, block_t)
    slots = slot_ids_ref[tokens]
    pages = lax.div(slots, page_size)[:, None]
    rows = lax.rem(slots, page_size)[:, None]
    lanes = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    # Static indices as jnp scalars: the interpreter's load discharge needs `.shape` on them.
    for kv_index in map(jnp.int32, range(2)):
        for head in map(jnp.int32, range(num_kv_heads)):
            new_rows = new_ref[new_layer, kv_index, tokens, head]  # [block_t, H]
            kv_ref[layer, kv_index, head, pages, rows, lanes] = new_rows.astype(kv_ref.dtype)


def _write(kv, new_kv, slot_ids, first_layer, block_t, num_warps, num_stages, interpret):
    """new_kv [L', 2, T, K, H] into layers first_layer .. first_layer + L' - 1 of kv."""
    validate_write_args(kv, new_kv, slot_ids)
    new_kv, new_scales = reference.quantize_new_rows(kv, new_kv)
    scales, kv = kv.scales, kv.pages
    if new_scales is not None:
        layer = None if new_kv.shape[0] == kv.shape[0] else first_layer[0]
        scales = reference.write_scales(
            scales, layer, new_scales if layer is None else new_scales[0], slot_ids
        )
    if block_t <= 0 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two")
    num_layers, _, num_kv_heads, num_pages, page_size, head_dim = kv.shape
    kv_layout(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        num_pages=num_pages,
        page_size=page_size,
        head_dim=head_dim,
        dtype=kv.dtype,
    )
    # Pad T to whole blocks by repeating the last token (same slot, same rows): no masked
    # lanes, whose scatter in interpret mode could clobber a real write to the same slot.
    num_tokens = new_kv.shape[2]
    padded = pl.cdiv(num_tokens, block_t) * block_t
    if padded != num_tokens:
        repeat = jnp.full(padded - num_tokens, num_tokens - 1)
        slot_ids = jnp.concatenate([slot_ids, slot_ids[repeat]])
        new_kv = jnp.concatenate([new_kv, new_kv[:, :, repeat]], axis=2)
    pages = pl.pallas_call(
        functools.partial(_write_kernel, block_t=block_t),
        out_shape=jax.ShapeDtypeStruct(kv.shape, kv.dtype),
        grid=(padded // block_t, new_kv.shape[0]),
        input_output_aliases={3: 0},  # operands: first_layer, slot_ids, new_kv, kv
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="write_kv_pages_gpu",
    )(first_layer, slot_ids, new_kv, kv)
    return KVCache(pages, scales)


_TUNING = ("block_t", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_TUNING)
def write_kv_pages(
    kv: KVCache,
    new_kv: jax.Array,
    slot_ids: jax.Array,
    *,
    block_t: int = 16,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
) -> KVCache:
    """Scatters every layer's new K/V rows into their slots of the KV array, in place.

    Args:
      kv: pages [L, 2, K, num_pages, page_size, H] (aliased to the result; donate it to the
        enclosing jit so no copy is made) and, for int8 / fp8 pages, their row scales.
      new_kv: [L, 2, T, K, H] each layer's new keys (index 0) and values (index 1);
        quantized here for quantized pages.
      slot_ids: i32[T] flat slot (page * page_size + offset) of each token.
      block_t: tokens per program, a power of two.
      num_warps, num_stages: Triton launch parameters.
      interpret: run on CPU with Pallas's interpreter.
    Returns: kv with exactly those T slots of every layer overwritten.
    """
    validate_write_args(kv, new_kv, slot_ids)
    if new_kv.shape[0] != kv.pages.shape[0]:
        raise ValueError(f"new_kv must have all {kv.pages.shape[0]} layers, got {new_kv.shape[0]}")
    first_layer = jnp.zeros(1, jnp.int32)
    return _write(kv, new_kv, slot_ids, first_layer, block_t, num_warps, num_stages, interpret)


def write_layer_kv(
    kv: KVCache,
    layer_index: int | jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_ids: jax.Array,
    *,
    block_t: int = 16,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
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
    tuning = dict(block_t=block_t, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return _write_layer_kv(kv, first_layer, k_new, v_new, slot_ids, **tuning)


@functools.partial(jax.jit, static_argnames=_TUNING)
def _write_layer_kv(
    kv, first_layer, k_new, v_new, slot_ids, *, block_t, num_warps, num_stages, interpret
):
    new_kv = jnp.stack([k_new, v_new])[None]  # [1, 2, T, K, H]
    return _write(kv, new_kv, slot_ids, first_layer, block_t, num_warps, num_stages, interpret)

"""Checks of the arguments every backend's attention and KV write take (signatures: __init__.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax.kv_cache import KVCache


def validate_attention_args(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    kv: KVCache,
    layer_index: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_starts: jax.Array,
) -> None:
    """Raises ValueError naming the first argument whose shape or dtype breaks the signature."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
    num_tokens, num_heads, head_dim = q.shape
    _validate_kv(kv)
    kv = kv.pages
    num_kv_heads = kv.shape[2]
    if k_new.shape != (num_tokens, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(
            f"k_new {k_new.shape} and v_new {v_new.shape} must both be "
            f"[T, K, H] = {(num_tokens, num_kv_heads, head_dim)}"
        )
    if kv.shape[5] != head_dim:
        raise ValueError(f"kv head dim {kv.shape[5]} != q head dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num query heads {num_heads} not a multiple of KV heads {num_kv_heads}")
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [S, P], got shape {page_table.shape}")
    num_seqs = page_table.shape[0]
    if seq_lens.shape != (num_seqs,) or query_starts.shape != (num_seqs + 1,):
        raise ValueError(
            f"seq_lens {seq_lens.shape} must be (S,) and query_starts {query_starts.shape} "
            f"(S+1,) with S={num_seqs} from page_table"
        )
    for name, x in (
        ("layer_index", layer_index),
        ("page_table", page_table),
        ("seq_lens", seq_lens),
        ("query_starts", query_starts),
    ):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if layer_index.size != 1:
        raise ValueError(f"layer_index must be a scalar, got shape {layer_index.shape}")


def _validate_kv(kv: KVCache) -> None:
    """Pages [L, 2, K, num_pages, page_size, H]; scales f32 [L, 2, K, num_pages, page_size]
    when quantized, else [L, 2, K, 1, 1]."""
    if not isinstance(kv, KVCache):
        raise ValueError(f"kv must be a kv_cache.KVCache, got {type(kv).__name__}")
    pages, scales = kv.pages, kv.scales
    if pages.ndim != 6 or pages.shape[1] != 2:
        raise ValueError(
            f"kv.pages must be [L, 2, K, num_pages, page_size, H], got shape {pages.shape}"
        )
    rows = pages.shape[3:5] if kv.quantized else (1, 1)
    if scales.shape != (*pages.shape[:3], *rows) or scales.dtype != jnp.float32:
        raise ValueError(
            f"kv.scales must be f32{[*pages.shape[:3], *rows]} for {pages.dtype} pages, "
            f"got {scales.dtype}{list(scales.shape)}"
        )


def validate_write_args(kv: KVCache, new_kv: jax.Array, slot_ids: jax.Array) -> None:
    """Checks `write_kv_pages(kv (pages [L, 2, K, num_pages, page_size, H]), new_kv [L', 2,
    T, K, H], slot_ids i32[T])`; L' is L (every layer) or 1 (one layer's write)."""
    _validate_kv(kv)
    kv = kv.pages
    num_layers, _, num_kv_heads, _, _, head_dim = kv.shape
    if (
        new_kv.ndim != 5
        or new_kv.shape[0] not in (1, num_layers)
        or new_kv.shape[1] != 2
        or new_kv.shape[3:] != (num_kv_heads, head_dim)
    ):
        raise ValueError(
            f"new_kv must be [L, 2, T, K, H] = [{num_layers}, 2, T, {num_kv_heads}, "
            f"{head_dim}] (k_new/v_new [T, {num_kv_heads}, {head_dim}] for one layer), "
            f"got shape {new_kv.shape}"
        )
    num_tokens = new_kv.shape[2]
    if slot_ids.shape != (num_tokens,) or slot_ids.dtype != jnp.int32:
        raise ValueError(
            f"slot_ids must be i32[{num_tokens}], got {slot_ids.dtype}{list(slot_ids.shape)}"
        )


def layer_as_array(layer_index, num_layers: int) -> jax.Array:
    """i32[1] of a layer index; a Python int is range-checked (a traced one cannot be)."""
    if isinstance(layer_index, int | np.integer) and not 0 <= layer_index < num_layers:
        raise ValueError(f"layer_index={layer_index} out of range for {num_layers} layers")
    return jnp.asarray(layer_index, jnp.int32).reshape(1)

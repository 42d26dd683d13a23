"""Ragged paged attention for CPUs (the "cpu" backend): reference.py's semantics as a C++
XLA FFI custom call, ragged_paged_attention_cpu.cc.

XLA:CPU runs the jnp formulations of paged attention far below memory bandwidth (the
"xla" backend: ~12 ms a layer for SmolLM2 decode at 64 x 600 tokens, ~2.5 GB/s): a paged
gather is an element loop, float16 converts element by element, and each (sequence, KV
head) is its own small library product. The kernel streams each row's keys and values once
per KV head, in tiles converted to float32, with an online softmax in float32, on XLA's
intra-op threads. Quantized pages (int8, float8_e4m3fn) are dequantized with their row
scales as each tile is converted; the step's own k_new / v_new then come as float32.

With float pages, a layer's rotary, KV write and attention are one call (`attend_layer`):
at batch 1 a decode layer's attention was five XLA:CPU thunks (rotary, two converts to the
KV dtype, the write, attention), each a microsecond or two beside the products.

It is compiled at first use (cpu_build.py: the system C++ compiler, once per machine).
`available()` says whether that worked; "auto" on CPU picks this backend when it does and
the xla backend otherwise.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax.kv_cache import KVCache
from ksana_jax.pallas_kernels import cpu_build, reference
from ksana_jax.pallas_kernels.attention_args import layer_as_array, validate_attention_args
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec

SOURCE = Path(__file__).with_suffix(".cc")
TARGET = "ksana_ragged_paged_attention_cpu"
_SYMBOL = "KsanaRaggedPagedAttentionCpu"
WRITE_TARGET = "ksana_write_layer_kv_cpu"
_WRITE_SYMBOL = "KsanaWriteLayerKvCpu"
ATTEND_TARGET = "ksana_write_attend_cpu"
_ATTEND_SYMBOL = "KsanaWriteAttendCpu"
MAX_HEAD_DIM, MAX_GROUP = 256, 16  # kMaxHeadDim, kMaxGroup in the .cc
KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")  # Kind in the .cc


def _register() -> None:
    cpu_build.register(SOURCE, _SYMBOL, TARGET)


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads on this machine."""
    return cpu_build.available(SOURCE, _SYMBOL, TARGET)


def check_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Raises ValueError unless head_dim <= MAX_HEAD_DIM and the query heads per KV head are
    <= MAX_GROUP (the kernel's fixed-size scratch)."""
    if head_dim > MAX_HEAD_DIM or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(
            f"the cpu kernel takes head_dim <= {MAX_HEAD_DIM} and <= {MAX_GROUP} query heads "
            f"per KV head, got head_dim {head_dim}, {num_heads} query and {num_kv_heads} KV heads"
        )


# The calls' page_rows operand where each sequence's pages are its own row of the table.
_NO_ROWS = np.zeros((0,), np.int32)


def _spec_attributes(spec: AttentionSpec) -> dict[str, np.generic]:
    """The attention calls' attributes: scale, window (0: none), soft-cap (0: none)."""
    return dict(
        sm_scale=np.float32(spec.sm_scale),
        sliding_window=np.int32(spec.sliding_window or 0),
        logit_softcap=np.float32(spec.logit_softcap or 0.0),
    )


@functools.partial(jax.jit, static_argnames=("spec",))
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
) -> jax.Array:
    """reference.ragged_paged_attention (same arguments and result) as one custom call;
    with a sliding window each row streams only the positions its queries' windows cover.
    Returns: f32[T, N, H]; zeros for padding tokens."""
    layer_index = jnp.asarray(layer_index, jnp.int32)
    validate_attention_args(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts)
    if kv.pages.dtype.name not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {kv.pages.dtype}")
    check_heads(q.shape[1], kv.pages.shape[2], q.shape[2])
    _register()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    new_dtype = jnp.float32 if kv.quantized else kv.pages.dtype
    return call(
        q.astype(jnp.float32),
        k_new.astype(new_dtype),
        v_new.astype(new_dtype),
        kv.pages,
        kv.scales,
        layer_index.reshape(()),
        page_table,
        _NO_ROWS,
        seq_lens,
        query_starts,
        **_spec_attributes(spec),
    )


def write_layer_kv(
    kv: KVCache,
    layer_index: int | jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_ids: jax.Array,
    *,
    interpret: bool = False,
) -> KVCache:
    """reference.write_layer_kv (same arguments and result): float pages get the rows copied
    in place by one custom call (the pages aliased to its result; a scatter and the padding a
    one-row scatter needs are four XLA:CPU thunks a layer). Quantized pages take the
    reference's write (its quantization is the one every backend matches). `interpret` is
    the Pallas writers' argument, unused."""
    del interpret
    if kv.quantized:
        return reference.write_layer_kv(kv, layer_index, k_new, v_new, slot_ids)
    cpu_build.register(SOURCE, _WRITE_SYMBOL, WRITE_TARGET)
    call = jax.ffi.ffi_call(
        WRITE_TARGET,
        jax.ShapeDtypeStruct(kv.pages.shape, kv.pages.dtype),
        input_output_aliases={0: 0},
    )
    dtype = kv.pages.dtype
    layer = layer_as_array(layer_index, kv.pages.shape[0]).reshape(())
    pages = call(
        kv.pages, k_new.astype(dtype), v_new.astype(dtype), layer, slot_ids.astype(jnp.int32)
    )
    return KVCache(pages, kv.scales)


def attend_layer(
    qkv: jax.Array,
    kv: KVCache,
    layer_index: int | jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slot_ids: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_starts: jax.Array,
    *,
    spec: AttentionSpec,
    page_rows: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """reference.attend_layer (same arguments and result): for float pages one custom call
    splits qkv, rotates q and k, rounds k and v to the pages' dtype, writes them in place
    (the pages aliased to its second result) and attends; quantized pages take the
    reference's composition with this kernel's attention. With `page_rows` i32[S]
    (StepInputs.page_rows), page_table is [R, P] and sequence s's pages are its row
    page_rows[s]: the call reads them there (quantized pages: gathered first)."""
    if page_rows is not None and (page_rows.shape != seq_lens.shape or page_table.ndim != 2):
        raise ValueError(f"page_rows must be [S] = {seq_lens.shape}, got {page_rows.shape}")
    if kv.quantized:
        if page_rows is not None:
            page_table = page_table[page_rows]
        return reference.attend_layer(
            qkv,
            kv,
            layer_index,
            cos,
            sin,
            slot_ids,
            page_table,
            seq_lens,
            query_starts,
            spec=spec,
            write=write_layer_kv,
            attention=ragged_paged_attention,
        )
    if qkv.ndim != 4 or qkv.shape[2] < 3 or qkv.shape[1] != kv.pages.shape[2]:
        raise ValueError(
            f"qkv must be [T, K, G + 2, H] with the KV's K = {kv.pages.shape[2]}, got {qkv.shape}"
        )
    num_tokens, num_kv_heads, group_and_kv, head_dim = qkv.shape
    out_shape = (num_tokens, num_kv_heads * (group_and_kv - 2), head_dim)
    layer = layer_as_array(layer_index, kv.pages.shape[0]).reshape(())
    # the shapes of the q, k_new and v_new that qkv holds, checked as attention's arguments
    q = jax.ShapeDtypeStruct(out_shape, jnp.float32)
    k_new = jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_dim), jnp.float32)
    # the [S, P] table the rows make, checked as attention's argument
    step_table = jax.ShapeDtypeStruct((seq_lens.shape[0], page_table.shape[-1]), jnp.int32)
    validate_attention_args(
        q, k_new, k_new, kv, layer, page_table if page_rows is None else step_table, seq_lens,
        query_starts,
    )  # fmt: skip
    check_heads(out_shape[1], num_kv_heads, head_dim)
    rope_shape = (num_tokens, head_dim // 2)
    if cos.shape != rope_shape or sin.shape != rope_shape or head_dim % 2:
        raise ValueError(f"cos {cos.shape} and sin {sin.shape} must be [T, H/2] = {rope_shape}")
    if slot_ids.shape != (num_tokens,):
        raise ValueError(f"slot_ids must be [T] = ({num_tokens},), got {slot_ids.shape}")
    cpu_build.register(SOURCE, _ATTEND_SYMBOL, ATTEND_TARGET)
    call = jax.ffi.ffi_call(
        ATTEND_TARGET,
        (
            jax.ShapeDtypeStruct(out_shape, jnp.float32),
            jax.ShapeDtypeStruct(kv.pages.shape, kv.pages.dtype),
        ),
        input_output_aliases={1: 1},
    )
    out, pages = call(
        qkv.astype(jnp.float32),
        kv.pages,
        layer,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        slot_ids.astype(jnp.int32),
        page_table,
        _NO_ROWS if page_rows is None else page_rows.astype(jnp.int32),
        seq_lens,
        query_starts,
        **_spec_attributes(spec),
    )
    return out, KVCache(pages, kv.scales)


def write_kv_pages(
    kv: KVCache, new_kv: jax.Array, slot_ids: jax.Array, *, interpret: bool = False
) -> KVCache:
    """Every layer's write: the reference's (the engine writes layer by layer, in the model)."""
    del interpret
    return reference.write_kv_pages(kv, new_kv, slot_ids)

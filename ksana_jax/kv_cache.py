"""The paged KV cache: its layout, its size, its quantization and its allocation.

One pytree, `KVCache`, holds every layer's keys and values and their scales:

    kv.pages:  [L, 2, K, num_pages, page_size, H]   (axis 1: 0 = keys, 1 = values)
    kv.scales: f32[L, 2, K, num_pages, page_size]    quantized pages: one scale per row
               f32[L, 2, K, 1, 1]                    float pages: a placeholder, never read

Float pages (float32, bfloat16, float16) hold K/V as they are. Quantized pages
(kv_cache_dtype int8, or fp8 = float8_e4m3fn) hold each row -- one token's H values of one
KV head -- as x / scale with scale = max|x| / 127 (int8, rounded) or max|x| / 448 (fp8, the
largest e4m3 value); a reader dequantizes q * scale after loading a page. Every KV writer
quantizes on write (`quantize_rows`) and every attention backend dequantizes on read
(`dequantize_rows`); the pytree's structure is the same for every dtype, so the step's
signature is too. Bytes per token and layer: 2 * K * H * itemsize, plus 2 * K * 4 of scales
when quantized.

It is allocated once and then donated to every jitted step, which writes the step's new
K/V into it in place and returns it. Per (layer, k/v, KV head) the pages are contiguous
[num_pages, page_size, H] tiles -- the layout jax's Pallas paged-attention kernels read, with
(page_size, H) as the last two block dims. Page 0 (`SINK_PAGE`) is never handed to a
request: padding tokens write their K/V there and padding rows point their page tables at it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from ksana_jax.config import KV_CACHE_DTYPES, KV_CACHE_QUANTIZED, ModelConfig

if TYPE_CHECKING:
    from ksana_jax.pallas_kernels import AttentionBackend

SINK_PAGE = 0
FLOAT16_MAX = 65504.0


def resolve_kv_dtype(
    kv_cache_dtype: str, param_dtype: str, platform: str, backend: AttentionBackend | None = None
) -> str:
    """The KV array's dtype: explicit, or "auto" = the parameters' dtype, except float16 for
    bfloat16 models on CPU: XLA:CPU lowers a bfloat16 scatter by converting the whole
    operand to float32 and back (measured: seconds per step and two KV-sized temporaries),
    while a float16 (or float32) scatter updates the donated array in place. float16 has
    more mantissa bits than bfloat16 (10 vs 7) and half float32's bytes, which decode
    attention reads every step; K/V beyond its range (65504) are clipped (`to_kv_dtype`).
    Not for a `backend` that cannot read float16 (pallas_tpu, interpreted on CPU: Mosaic
    loads no float16 vectors).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype in KV_CACHE_QUANTIZED:
        return KV_CACHE_QUANTIZED[kv_cache_dtype]
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    reads_float16 = backend is None or "float16" in backend.kv_dtypes
    cpu_kv = platform == "cpu" and reads_float16
    return "float16" if cpu_kv and param_dtype == "bfloat16" else param_dtype


# Largest magnitude of each quantized KV dtype (scale = max|row| / this).
QUANT_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def is_quantized(dtype) -> bool:
    """Whether KV pages of `dtype` are quantized (int8, float8_e4m3fn) and carry scales."""
    return jnp.dtype(dtype).name in QUANT_MAX


def quantize_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Rows x [..., H] -> (values [..., H] of `dtype`, scales f32[...]) with x ~ values *
    scale: scale = max|row| / QUANT_MAX (0 for an all-zero row, whose values are 0)."""
    x = x.astype(jnp.float32)
    qmax = QUANT_MAX[jnp.dtype(dtype).name]
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    y = jnp.clip(x * inv[..., None], -qmax, qmax)
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize_rows(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values [..., H] (int8 / float8) times scales f32[...] -> f32[..., H]."""
    return values.astype(jnp.float32) * scales[..., None]


def to_kv_dtype(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x as a reader of a `dtype` KV will see it: cast to a float dtype (float16 clipped to
    its range first, never inf); for a quantized dtype, quantized and dequantized (f32)."""
    if is_quantized(dtype):
        return dequantize_rows(*quantize_rows(x, dtype))
    if jnp.dtype(dtype) == jnp.float16:
        x = jnp.clip(x, -FLOAT16_MAX, FLOAT16_MAX)
    return x.astype(dtype)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["pages", "scales"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The paged KV state every step takes (donated) and returns (layout: module docstring)."""

    pages: jax.Array  # [L, 2, K, num_pages, page_size, H] float or int8 / float8_e4m3fn
    scales: jax.Array  # f32[L, 2, K, num_pages, page_size] (quantized) or f32[L, 2, K, 1, 1]

    @property
    def quantized(self) -> bool:
        return is_quantized(self.pages.dtype)

    def layer_scales(self, layer_index, kind: int) -> jax.Array:
        """f32[K, num_pages, page_size] scales of keys (kind 0) or values (1) of a layer."""
        return self.scales[layer_index, kind]


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of the paged KV array."""

    num_layers: int
    num_kv_heads: int
    num_pages: int
    page_size: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the sink), got {self.num_pages}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype: str) -> KVCacheSpec:
        return cls(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            num_pages,
            page_size,
            cfg.head_dim,
            dtype,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_layers,
            2,
            self.num_kv_heads,
            self.num_pages,
            self.page_size,
            self.head_dim,
        )

    @property
    def scales_shape(self) -> tuple[int, ...]:
        """Per-row scales of quantized pages; a [L, 2, K, 1, 1] placeholder for float ones."""
        rows = (self.num_pages, self.page_size) if is_quantized(self.dtype) else (1, 1)
        return (self.num_layers, 2, self.num_kv_heads, *rows)

    @property
    def values_bytes_per_page(self) -> int:
        """Bytes of one page's K/V values over every layer."""
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * self.head_dim * itemsize

    @property
    def scales_bytes_per_page(self) -> int:
        """Bytes of one page's float32 row scales over every layer (0 for float pages)."""
        quantized = is_quantized(self.dtype)
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * 4 if quantized else 0

    @property
    def bytes_per_page(self) -> int:
        return self.values_bytes_per_page + self.scales_bytes_per_page

    @property
    def nbytes(self) -> int:
        return self.bytes_per_page * self.num_pages


def device_bytes_per_page(
    cfg: ModelConfig, page_size: int, dtype: str, lane_multiple: int = 1
) -> int:
    """Device memory one page takes when each head_dim row is padded to a multiple of
    `lane_multiple` (128 for the row-major KV on a TPU: a 64-wide row fills 128 lanes)."""
    spec = KVCacheSpec.for_model(cfg, 2, page_size, dtype)
    padded = -(-spec.head_dim // lane_multiple) * lane_multiple
    return spec.values_bytes_per_page * padded // spec.head_dim + spec.scales_bytes_per_page


def num_pages_for_budget(
    cfg: ModelConfig, page_size: int, dtype: str, budget_bytes: int, lane_multiple: int = 1
) -> int:
    """How many pages fit in `budget_bytes` (including the sink page)."""
    return int(budget_bytes // device_bytes_per_page(cfg, page_size, dtype, lane_multiple))


def float_kv(pages: jax.Array) -> KVCache:
    """A KVCache of float `pages` [L, 2, K, num_pages, page_size, H] (placeholder scales)."""
    pages = jnp.asarray(pages)
    if is_quantized(pages.dtype):
        raise ValueError(f"float_kv takes float pages, got {pages.dtype}: give their scales too")
    return KVCache(pages, jnp.zeros((*pages.shape[:3], 1, 1), jnp.float32))


def float_kv_shapes(pages: jax.ShapeDtypeStruct) -> KVCache:
    """`float_kv` of abstract pages (ShapeDtypeStructs, for ahead-of-time compiles)."""
    return KVCache(pages, jax.ShapeDtypeStruct((*pages.shape[:3], 1, 1), jnp.float32))


def kv_shardings(pages_sharding) -> KVCache | None:
    """A KVCache of shardings from the pages' (a NamedSharding, or a Format: sharding and a
    row-major layout): the scales split like the pages over their first five dims."""
    if pages_sharding is None:
        return None
    if isinstance(pages_sharding, Format):
        scales = kv_shardings(pages_sharding.sharding).scales
        return KVCache(pages_sharding, Format(Layout(major_to_minor=tuple(range(5))), scales))
    spec = list(pages_sharding.spec)[:5]
    while spec and spec[-1] is None:  # P() as jit writes it, or equal shardings recompile
        spec.pop()
    scales = jax.sharding.NamedSharding(pages_sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return KVCache(pages_sharding, scales)


def abstract_kv(spec: KVCacheSpec) -> KVCache:
    """The KVCache of `spec` as ShapeDtypeStructs (for ahead-of-time compiles)."""
    return KVCache(
        jax.ShapeDtypeStruct(spec.shape, jnp.dtype(spec.dtype)),
        jax.ShapeDtypeStruct(spec.scales_shape, jnp.float32),
    )


def allocate_kv(spec: KVCacheSpec, sharding=None) -> KVCache:
    """Zero-filled KVCache of `spec`, created directly on device; `sharding` is the pages'
    (a Sharding, or a Format: sharding and layout), the scales split alike (kv_shardings)."""

    def zeros() -> KVCache:
        return KVCache(jnp.zeros(spec.shape, spec.dtype), jnp.zeros(spec.scales_shape, jnp.float32))

    return jax.jit(zeros, out_shardings=kv_shardings(sharding))()

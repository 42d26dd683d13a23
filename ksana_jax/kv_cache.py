"""The paged KV array: its layout, its size, and its allocation.

One array holds every layer's keys and values:

    kv: [L, 2, K, num_pages, page_size, H]     (axis 1: 0 = keys, 1 = values)

It is allocated once and then donated to every jitted step, which writes the step's new
K/V into it in place and returns it. Per (layer, k/v, KV head) the pages are contiguous
[num_pages, page_size, H] tiles -- the layout jax's Pallas paged-attention kernels read, with
(page_size, H) as the last two block dims. Page 0 (`SINK_PAGE`) is never handed to a
request: padding tokens write their K/V there and padding rows point their page tables at it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax.config import KV_CACHE_DTYPES, ModelConfig

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
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    reads_float16 = backend is None or "float16" in backend.kv_dtypes
    cpu_kv = platform == "cpu" and reads_float16
    return "float16" if cpu_kv and param_dtype == "bfloat16" else param_dtype


def to_kv_dtype(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x cast to the KV dtype; for float16, clipped to its range first (never inf)."""
    if jnp.dtype(dtype) == jnp.float16:
        x = jnp.clip(x, -FLOAT16_MAX, FLOAT16_MAX)
    return x.astype(dtype)


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
    def bytes_per_page(self) -> int:
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.page_size * self.head_dim * itemsize

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
    return spec.bytes_per_page * padded // spec.head_dim


def num_pages_for_budget(
    cfg: ModelConfig, page_size: int, dtype: str, budget_bytes: int, lane_multiple: int = 1
) -> int:
    """How many pages fit in `budget_bytes` (including the sink page)."""
    return int(budget_bytes // device_bytes_per_page(cfg, page_size, dtype, lane_multiple))


def allocate_kv(spec: KVCacheSpec, sharding=None) -> jax.Array:
    """Zero-filled KV array of `spec.shape`, created directly on device, in `sharding` (a
    Sharding, or a Format: sharding and layout)."""
    return jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=sharding)()

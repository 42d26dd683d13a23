"""Weight-only quantized matrices: small pytrees that `models.layers.linear` (and the
embedding lookup) dispatch on.

A quantized matrix stands for a float matrix w [..., O, I] (torch's [out, in] layout, with
any leading axes such as the checkpoint's stacked layers L). Two formats:

    int8   values  i8[..., O, I]     w = values * scales, symmetric
           scales  f[..., O, G]      G = 1: one scale per output channel (what `quantize`
                                     makes: SmolLM2 perplexity 1.002x float, FACTS.md), or
                                     G = I / 32: GGUF Q8_0's blocks, kept as they are
    int4   packed  u8[..., O, I/2]   two 4-bit values q in [0, 15] per byte
           scales  f16[..., O, I/32] w = q * scale + min per group of 32 along I
           mins    f16[..., O, I/32] (asymmetric: GGUF's Q4_1 exactly; Q4_0 is min = -8 scale)

Inside each group of 32, byte j holds element j (low nibble) and element j + 16 (high
nibble): GGUF's own order for Q4_0 / Q4_1, so their blocks are copied byte for byte.

Why one int8 format with two group sizes: Q8_0 is symmetric int8 in groups of 32 with a
float16 scale each; a per-channel-only format could hold it only by requantizing (a second
rounding), a per-group-only one would spend 2 bytes per 32 weights where one scale per row
measured as good. The group size is read off the shapes (I / G), so it costs nothing static.

`dtype` (static) is the matmul's dtype, the model's parameter dtype: `dequantize` computes
q * scale (+ min) in float32 and rounds once to it. Scales keep their stored dtype (float16
for GGUF blocks and int4, float32 for per-channel int8), so kept blocks are exact.

Layer views: a matrix's arrays may hold every layer's matrix stacked on a leading axis L
(registry.stack_layers, where the CPU kernel multiplies them). Inside a step each layer then
sees a view, the same arrays with static `layer` = its index on L: its `shape` is one
layer's, the kernel reads that layer's bytes in place, and every other consumer takes
`unstacked(m)` (the layer's slice of each array).

Products: on CPU at decode's few rows `models.layers.linear` runs the C++ kernel
pallas_kernels/linear_cpu.cc, which reads the packed bytes and dequantizes in registers.
Elsewhere (and as the reference) XLA dequantizes inside the jitted step, then runs the same
dot as for a float weight (on CPU it materialises the dequantized matrix per product).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax.config import MOE_MLP, QUANTIZATIONS

GROUP_SIZE = 32  # int4 groups, Q8_0 / Q4_0 / Q4_1 blocks


def _xp(a: Any) -> Any:
    return np if isinstance(a, np.ndarray) else jnp


@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """Symmetric int8: w = values * scales, scales per output channel or per group of 32."""

    values: Any  # i8[..., O, I]
    scales: Any  # f32[..., O, 1] or f16[..., O, I/32]
    dtype: str = "float32"  # static: the matmul dtype
    layer: int | None = None  # static: a layer view's index (module docstring)

    format: ClassVar[str] = "int8"
    data_fields: ClassVar[tuple[str, ...]] = ("values", "scales")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)[self.layer is not None :]

    @property
    def group_size(self) -> int:
        return self.values.shape[-1] // self.scales.shape[-1]


@dataclasses.dataclass(frozen=True)
class Int4Matrix:
    """Asymmetric int4 in groups of 32 along the input dim: w = q * scale + min (Q4_1)."""

    packed: Any  # u8[..., O, I/2]
    scales: Any  # f16[..., O, I/32]
    mins: Any  # f16[..., O, I/32]
    dtype: str = "float32"
    # Static: the mesh axes packed, scales and mins [O, *] are split over, (out axes, in
    # axes), set by sharding.ShardingPlan when it places the matrix; None when no plan did
    # or when the packed bytes and the scales split differently. The Pallas kernels run on
    # each device's shard with it (pallas_kernels/quant_matmul.py).
    split: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    layer: int | None = None  # static: a layer view's index (module docstring)

    format: ClassVar[str] = "int4"
    data_fields: ClassVar[tuple[str, ...]] = ("packed", "scales", "mins")

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[self.layer is not None : -1], 2 * self.packed.shape[-1])

    group_size: ClassVar[int] = GROUP_SIZE


QuantizedMatrix: TypeAlias = Int8Matrix | Int4Matrix
_CLASSES: dict[str, type] = {"int8": Int8Matrix, "int4": Int4Matrix}
for _cls in _CLASSES.values():
    jax.tree_util.register_dataclass(
        _cls,
        data_fields=list(_cls.data_fields),
        meta_fields=[f.name for f in dataclasses.fields(_cls) if f.name not in _cls.data_fields],
    )


def is_quantized(x: Any) -> bool:
    return isinstance(x, Int8Matrix | Int4Matrix)


def unstacked(m: QuantizedMatrix) -> QuantizedMatrix:
    """A layer view's own matrix (its layer of each array: a slice inside a step), else m."""
    if m.layer is None:
        return m
    return dataclasses.replace(jax.tree.map(lambda a: a[m.layer], m), layer=None)


def check_format(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; supported: {QUANTIZATIONS}")


# --------------------------------------------------------------------------- quantize (numpy)


def quantize(w: np.ndarray, quantization: str, dtype: str = "float32") -> QuantizedMatrix:
    """Round-to-nearest quantization of a float matrix w [..., O, I] (numpy, at convert or
    load time). int4 needs I divisible by 32 (ValueError otherwise)."""
    check_format(quantization)
    w = np.asarray(w, np.float32)
    if w.ndim < 2:
        raise ValueError(f"only matrices are quantized, got shape {w.shape}")
    if quantization == "int8":
        scales = np.max(np.abs(w), axis=-1, keepdims=True) / np.float32(127)
        values = np.rint(w / np.where(scales == 0, 1, scales))
        return Int8Matrix(np.clip(values, -127, 127).astype(np.int8), scales, dtype)
    if w.shape[-1] % GROUP_SIZE:
        raise ValueError(
            f"int4 quantization needs the input dim divisible by {GROUP_SIZE}, got shape "
            f"{w.shape}; use quantization='int8'"
        )
    groups = w.reshape(*w.shape[:-1], -1, GROUP_SIZE)  # [..., O, G, 32]
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    scales = ((hi - lo) / np.float32(15)).astype(np.float16)
    mins = lo.astype(np.float16)
    # Quantize against the stored (float16) scale and min, so dequantize sees what was meant.
    s32, m32 = scales.astype(np.float32)[..., None], mins.astype(np.float32)[..., None]
    q = np.rint((groups - m32) / np.where(s32 == 0, 1, s32))
    return Int4Matrix(pack_int4(np.clip(q, 0, 15).astype(np.uint8)), scales, mins, dtype)


def abstract(quantization: str, shape: tuple[int, ...], dtype: str) -> QuantizedMatrix:
    """The quantized form of a float matrix of `shape` [..., O, I] as ShapeDtypeStructs, for
    ahead-of-time compiles of a model that is only described (no values)."""
    check_format(quantization)
    *lead, out, inp = shape
    sds = jax.ShapeDtypeStruct
    if quantization == "int8":
        return Int8Matrix(sds(shape, jnp.int8), sds((*lead, out, 1), jnp.float32), dtype)
    groups = sds((*lead, out, inp // GROUP_SIZE), jnp.float16)
    return Int4Matrix(sds((*lead, out, inp // 2), jnp.uint8), groups, groups, dtype)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """q u8[..., O, G, 32] in [0, 15] -> packed u8[..., O, G * 16] (GGUF's nibble order)."""
    half = GROUP_SIZE // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(*q.shape[:-2], -1)


def unpack_int4(packed: Any) -> Any:
    """packed u8[..., O, I/2] -> q u8[..., O, I/32, 32] (numpy or jnp)."""
    xp = _xp(packed)
    groups = packed.reshape(*packed.shape[:-1], -1, GROUP_SIZE // 2)
    return xp.concatenate([groups & 0xF, groups >> 4], axis=-1)


# --------------------------------------------------------------------------- dequantize


def dequantize(m: QuantizedMatrix, dtype: str | None = None) -> Any:
    """The float matrix [..., O, I] that `m` stands for, in `dtype` (default m.dtype);
    numpy in, numpy out; jax in, jax out (fused by XLA into what consumes it)."""
    xp = _xp(m.scales)
    dtype = dtype or m.dtype
    if isinstance(m, Int8Matrix):
        groups = m.values.reshape(*m.values.shape[:-1], m.scales.shape[-1], -1)
        w = groups.astype(xp.float32) * m.scales.astype(xp.float32)[..., None]
    else:
        q = unpack_int4(m.packed).astype(xp.float32)
        w = q * m.scales.astype(xp.float32)[..., None] + m.mins.astype(xp.float32)[..., None]
    return w.reshape(m.shape).astype(jnp.dtype(dtype))


def scaled_product(x: jax.Array, m: Int8Matrix) -> jax.Array:
    """x [..., I] . dequantize(m)^T -> f32[..., O] for int8 with one scale per output channel,
    as (x . values^T) * scales: the scale applies to the product, not the weight, so the
    int8 -> float convert is the dot's only operand op and XLA:GPU / XLA:TPU fuse it into
    one GEMM (dequantize-then-dot materialises the scaled matrix first). Rounding differs
    from dequantize-then-dot: the values are exact in any float dtype, the scale is applied
    in float32 after the accumulation."""
    assert m.scales.shape[-1] == 1, m.scales.shape
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    y = jax.lax.dot_general(
        x.astype(m.dtype), m.values.astype(m.dtype), contract, preferred_element_type=jnp.float32
    )
    return y * m.scales[:, 0].astype(jnp.float32)


def after(m: QuantizedMatrix, x: jax.Array) -> QuantizedMatrix:
    """`m` made to depend on x's first element (its scales + 0 * x): XLA then dequantizes
    each matrix just before the matmul that consumes it. Left free, XLA:CPU schedules every
    dequantization at the start of the step and holds a whole dequantized copy of the model
    (SmolLM2 in bfloat16: 269 MB of temporaries); `optimization_barrier` does not survive
    its pipeline. A non-finite x[0] makes the scales NaN, where the product is not finite
    anyway."""
    tie = (x.reshape(-1)[0] * 0).astype(m.scales.dtype)
    return dataclasses.replace(m, scales=m.scales + tie)


def take_rows(m: QuantizedMatrix, ids: Any) -> Any:
    """Rows `ids` i32[T] of a quantized table [V, D], dequantized -> [T, D] in m.dtype
    (the embedding lookup: gathers the packed rows, then dequantizes only those)."""
    return dequantize(jax.tree.map(lambda a: a[ids], m))


# --------------------------------------------------------------------------- params


def check_model(cfg: Any) -> None:
    """Raises ValueError for a model whose weights cannot be quantized: an MoE model (its
    expert weights, most of its bytes, are float only for now)."""
    if MOE_MLP in cfg.mlp_types:
        raise ValueError(
            f"quantization is not supported for mixture-of-experts models ({cfg.model_type}: "
            "expert weights are float only); load it without quantization"
        )


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether parameter `name` (flat, "layers.wq"; shape stacked on L for layers) is a
    matrix that quantization applies to: every linear weight and the embedding / LM head.
    Norms, biases and other vectors stay float."""
    per_layer = shape[1:] if name.startswith("layers.") else shape
    return len(per_layer) == 2


def quantize_params(params: Any, quantization: str) -> Any:
    """A params tree (registry.Params, per-layer, numpy or device arrays) with every matrix
    (2-D leaf: linear weights, embedding, LM head) quantized on the host, computing in its
    float dtype; norms and biases unchanged. Already quantized matrices are kept."""
    check_format(quantization)

    def one(path: Any, x: Any) -> Any:
        if is_quantized(x) or x.ndim != 2:
            return x
        try:
            return quantize(np.asarray(x.astype(jnp.float32)), quantization, str(x.dtype))
        except ValueError as e:
            name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            raise ValueError(f"parameter {name}: {e}") from None

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def cast(params: Any, dtype: str) -> Any:
    """params with float leaves cast to `dtype` and quantized matrices set to compute in it."""

    def one(x: Any) -> Any:
        if is_quantized(x):
            return dataclasses.replace(x, dtype=dtype)
        return x.astype(dtype)

    return jax.tree.map(one, params, is_leaf=is_quantized)


def formats(params: Any) -> dict[str, str]:
    """Flat name -> format of each quantized matrix of a flat params dict."""
    return {name: v.format for name, v in params.items() if is_quantized(v)}


def to_arrays(m: QuantizedMatrix) -> dict[str, Any]:
    """The matrix's arrays by field name (what the checkpoint stores)."""
    return {f: getattr(m, f) for f in m.data_fields}


def from_arrays(quantization: str, arrays: Mapping[str, Any], dtype: str) -> QuantizedMatrix:
    """Inverse of to_arrays, given the format the checkpoint names."""
    check_format(quantization)
    cls = _CLASSES[quantization]
    return cls(**{f: arrays[f] for f in cls.data_fields}, dtype=dtype)


def logical_shape(quantization: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The float matrix's shape from its stored arrays' shapes."""
    if quantization == "int8":
        return tuple(shapes["values"])
    *lead, half = shapes["packed"]
    return (*lead, 2 * half)


def nbytes(tree: Any) -> int:
    """Total bytes of the arrays in a params tree (packed bytes for quantized matrices)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

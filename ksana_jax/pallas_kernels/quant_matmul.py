"""int4 matmul that reads the packed bytes: y f32[M, O] = x[M, I] . dequantize(w)^T, in Pallas
for TPU (Mosaic) and GPU (Triton).

Why a kernel: XLA does not fuse int4's dequantize into the dot on GPU or TPU (checked on the
compiled HLO: each matrix is dequantized into a bfloat16 buffer, then multiplied), so every
step writes and reads the whole model in bfloat16. These kernels load a tile of packed bytes
and its float16 scales and mins, dequantize it in VMEM / registers and feed it to the
MXU / tensor cores; no dequantized weight exists outside the kernel.

w is a `quant.Int4Matrix` [O, I]: packed u8[O, I/2], scales and mins f16[O, I/32],
w = q * scale + min per group of 32 along I. Inside a group byte j holds element j (low
nibble) and element j + 16 (high nibble). So x is split outside the kernel (`split_x`,
x is small) into x_lo (each group's first 16 columns) and x_hi (its last 16): column c of
x_lo pairs with the low nibble of packed column c, x_hi with the high nibble, and the
kernel computes x_lo . lo^T + x_hi . hi^T with no interleaving. The group of packed column
c is c // 16.

TPU (`matmul_tpu`): grid (row tiles, output tiles); a program holds the whole input dim of
its `block_n` output rows (packed u8[block_n, I/2]: 512 KB at I = 4096) and walks it in
chunks of `CHUNK_TPU` packed columns. Mosaic lays out the last dim along 128 lanes, where
repeating each group's scale 16 times would be a lane shuffle; so each chunk is transposed
to [chunk, block_n] (the XLU), and the scales, transposed once to [groups, block_n],
broadcast along sublanes (a free reshape). Mosaic cannot load float16, so scales and mins
come in as their int16 bits (a free bitcast) and are widened in the kernel.

GPU (`matmul_gpu`): Triton tiles [block_m, block_n] of y; each program loops over the input
dim `block_k` packed columns at a time (masked loads: any M, O, and I a multiple of 32),
loading each byte's scale and min with a gather of column // 16 (16 lanes share an
address), and accumulates in float32. With few output tiles (decode's one row tile)
`splits` programs share a tile, each over a slice of the input dim, and their partial
products are summed after the kernel, so every SM streams weights. Float32 x multiplies
with 3xTF32 (float32 accuracy).

Under tensor parallelism (`matmul` in a mesh of several devices) each device runs the
kernel on its own shard of w under shard_map, as the sharding plan placed it
(`Int4Matrix.split`, see `sharded`): column-parallel matrices give each device its output
columns, row-parallel ones (input dim split along whole groups) sum the devices' partial
products with one all-reduce.

Both are checked against `quant.dequantize` then a dot in tests/test_quant_matmul.py (in
Pallas's interpreter on CPU) and compiled for an L4 / H200 and a v5e without the hardware by
benchmarks/quant_matmul_compile.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from ksana_jax.quant import GROUP_SIZE, Int4Matrix

HALF = GROUP_SIZE // 2  # packed bytes per group
MIN_PROGRAMS = 512  # GPU programs to aim for (an H200 has 132 SMs, each holds 3-4)
CHUNK_TPU = 512  # packed columns a TPU program dequantizes at once (1,024 inputs)


def split_x(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, I] -> (x_lo, x_hi) [M, I/2]: each group's first and last 16 columns, in the
    order of the packed bytes' low and high nibbles."""
    m, i = x.shape
    groups = x.reshape(m, i // GROUP_SIZE, 2, HALF)
    return groups[:, :, 0].reshape(m, i // 2), groups[:, :, 1].reshape(m, i // 2)


def supports(platform: str, x: jax.Array, w: object) -> bool:
    """Whether `linear` takes this product to a kernel: an int4 matrix [O, I] on TPU (each
    device's input dim a multiple of 256: whole lane tiles of packed bytes) or GPU. Under a
    mesh of several devices the matrix must carry its split (quant.Int4Matrix.split, set
    when a ShardingPlan placed it): XLA cannot partition a Pallas call, so the kernel runs
    on each device's shard under shard_map; a matrix without one keeps XLA's path (its
    shards would be gathered whole for the kernel)."""
    if not isinstance(w, Int4Matrix) or w.packed.ndim != 2 or x.shape[-1] != w.shape[1]:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    inputs = w.shape[1]
    if not (mesh.empty or mesh.size == 1):
        if w.split is None or not set(sum(w.split, ())) <= set(mesh.axis_names):
            return False
        inputs //= _devices(mesh, w.split[1])
    if platform == "tpu":
        return inputs % (2 * 128) == 0
    return platform == "gpu"


def matmul(x: jax.Array, w: Int4Matrix, platform: str, *, interpret: bool = False) -> jax.Array:
    """x [..., I] . dequantize(w)^T -> f32[..., O] with the kernel for `platform`; under a
    mesh of several devices, per device on w's shards (`sharded`)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(w.dtype)
    fn = functools.partial(matmul_tpu if platform == "tpu" else matmul_gpu, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not (mesh.empty or mesh.size == 1) and w.split is not None:
        fn = sharded(fn, mesh, w)
    return fn(x2, w).reshape(*lead, w.shape[0])


def _devices(mesh: jax.sharding.AbstractMesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def sharded(fn, mesh: jax.sharding.AbstractMesh, w: Int4Matrix):
    """`fn` (x [M, I], w) -> f32[M, O] run on each device's shard of w, as the plan placed it
    (w.split): a column-parallel matrix (O split) gives each device its slice of y's
    columns from the whole x; a row-parallel one (I split along whole groups of 32) takes
    the matching slice of x's columns, and the devices' partial products are summed (one
    all-reduce of f32[M, O], what XLA adds after the same float matmul); a replicated one
    (a dim its devices do not divide) runs whole on every device."""
    out_axes, in_axes = (axes or None for axes in w.split)
    spec = P(out_axes, in_axes)  # packed [O, I/2], scales and mins [O, I/32] alike

    def local(x, w):
        y = fn(x, w)
        return y if in_axes is None else lax.psum(y, in_axes)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(None, in_axes), dataclasses.replace(w, packed=spec, scales=spec, mins=spec)),
        out_specs=P(None, out_axes),
        check_vma=False,
    )


# --------------------------------------------------------------------------- TPU (Mosaic)


def _f16_bits_to_f32(h: jax.Array) -> jax.Array:
    """int16 bits of float16 values -> float32 values (normals and zero exact; subnormals
    flush to zero on the TPU, as its float32 does). The f16 exponent and mantissa shifted
    into float32's place read as 2^-112 times the value."""
    h = h.astype(jnp.int32)
    bits = ((h & 0x7FFF) << 13) | ((h & 0x8000) << 16)
    return lax.bitcast_convert_type(bits, jnp.float32) * jnp.float32(2.0**112)


def _tpu_kernel(x_lo_ref, x_hi_ref, packed_ref, scales_ref, mins_ref, out_ref):
    block_n, half = packed_ref.shape
    scales = _f16_bits_to_f32(scales_ref[...]).T  # [groups, block_n]
    mins = _f16_bits_to_f32(mins_ref[...]).T
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for start in range(0, half, CHUNK_TPU):  # static: every slice is whole lane tiles
        size = min(CHUNK_TPU, half - start)
        g0, groups = start // HALF, size // HALF
        q = packed_ref[:, start : start + size].astype(jnp.int32).T  # [size, block_n]
        scale, low = (
            jnp.broadcast_to(a[g0 : g0 + groups, None, :], (groups, HALF, block_n)).reshape(
                size, block_n
            )
            for a in (scales, mins)
        )
        for x_ref, nibble in ((x_lo_ref, q & 0xF), (x_hi_ref, q >> 4)):
            w = (nibble.astype(jnp.float32) * scale + low).astype(x_ref.dtype)
            acc += jnp.dot(x_ref[:, start : start + size], w, preferred_element_type=jnp.float32)
    out_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "vmem_limit_bytes", "interpret"))
def matmul_tpu(
    x: jax.Array,
    w: Int4Matrix,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, I] (float32 or bfloat16) . dequantize(w)^T -> f32[M, O] on a TPU.

    block_m: rows of x a program multiplies (M is padded to a multiple of 16, then of
    min(block_m, that)); block_n: output columns (weight rows) a program reads. By default
    each of x's two halves takes at most 1 MiB a buffer and the packed block at most 2 MiB
    (whole input dims in every block): double-buffered, far inside v5e's 16 MiB of scoped
    VMEM at any input dim (Llama-3-8B's down projection: x blocks 64 x 7,168 of bfloat16,
    packed 256 x 7,168)."""
    m, i = x.shape
    o = w.shape[0]
    if w.shape[1] != i or i % (2 * 128):
        raise ValueError(
            f"matmul_tpu needs x [M, I] and w [O, I] with I % 256 == 0: {x.shape}, {w.shape}"
        )
    if block_m is None:
        block_m = min(256, max(16, (2**20 // i) // 16 * 16))
    if block_n is None:
        block_n = min(256, max(128, (2**22 // i) // 128 * 128))
    rows = -(-m // 16) * 16
    block_m = min(block_m, rows)
    rows = -(-rows // block_m) * block_m
    x_lo, x_hi = split_x(jnp.pad(x, ((0, rows - m), (0, 0))))
    block_n = min(block_n, o)
    half, groups = i // 2, i // GROUP_SIZE
    bits = [lax.bitcast_convert_type(a, jnp.int16) for a in (w.scales, w.mins)]
    x_spec = pl.BlockSpec((block_m, half), lambda r, n: (r, 0))
    group_spec = pl.BlockSpec((block_n, groups), lambda r, n: (n, 0))
    out = pl.pallas_call(
        _tpu_kernel,
        grid=(rows // block_m, pl.cdiv(o, block_n)),
        in_specs=[
            x_spec,
            x_spec,
            pl.BlockSpec((block_n, half), lambda r, n: (n, 0)),
            group_spec,
            group_spec,
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda r, n: (r, n)),
        out_shape=jax.ShapeDtypeStruct((rows, o), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="int4_matmul_tpu",
    )(x_lo, x_hi, w.packed, *bits)
    return out[:m]


# --------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(
    x_lo_ref,
    x_hi_ref,
    packed_ref,
    scales_ref,
    mins_ref,
    out_ref,
    *,
    block_m,
    block_n,
    block_k,
    precision,
):
    m, half = x_lo_ref.shape
    o = packed_ref.shape[0]
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    outs = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, out_ok = rows < m, outs < o

    def step(k, acc):
        cols = k * block_k + jnp.arange(block_k, dtype=jnp.int32)
        col_ok = cols < half
        x_mask = row_ok[:, None] & col_ok[None, :]
        w_mask = out_ok[:, None] & col_ok[None, :]
        w_at = (outs[:, None], cols[None, :])
        group_at = (outs[:, None], lax.div(cols, HALF)[None, :])
        q = plgpu.load(packed_ref.at[w_at], mask=w_mask, other=0).astype(jnp.int32)
        scale, low = (
            plgpu.load(ref.at[group_at], mask=w_mask, other=0.0).astype(jnp.float32)
            for ref in (scales_ref, mins_ref)
        )
        for x_ref, nibble in ((x_lo_ref, q & 0xF), (x_hi_ref, q >> 4)):
            x = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=x_mask, other=0.0)
            w = (nibble.astype(jnp.float32) * scale + low).astype(x.dtype)
            acc += lax.dot_general(
                x,
                w,
                (((1,), (1,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
        return acc

    steps = pl.cdiv(half, block_k)
    per_split = pl.cdiv(steps, pl.num_programs(2))
    first = pl.program_id(2) * per_split
    last = jnp.minimum(first + per_split, steps)
    acc = lax.fori_loop(first, last, step, jnp.zeros((block_m, block_n), jnp.float32))
    split = jnp.full((block_m, block_n), pl.program_id(2), jnp.int32)
    plgpu.store(
        out_ref.at[split, rows[:, None], outs[None, :]],
        acc,
        mask=row_ok[:, None] & out_ok[None, :],
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_m",
        "block_n",
        "block_k",
        "splits",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def matmul_gpu(
    x: jax.Array,
    w: Int4Matrix,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """x [M, I] (float32 or bfloat16) . dequantize(w)^T -> f32[M, O] on a GPU.

    block_m: rows of x a program multiplies (default: M rounded up to a power of two, 16
    to 64); block_n: output columns; block_k: packed columns per loop step (2 * block_k
    inputs). All powers of two (Triton's blocks). splits: programs sharing each output tile,
    each over a slice of the input dim, their float32 partial products summed after the
    kernel (default: enough for MIN_PROGRAMS programs, so decode's one row tile still
    reads the weights on every SM)."""
    m, i = x.shape
    o = w.shape[0]
    if w.shape[1] != i:
        raise ValueError(f"matmul_gpu needs x [M, I] and w [O, I]: {x.shape}, {w.shape}")
    if block_m is None:
        block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    x_lo, x_hi = split_x(x)
    if x.dtype == jnp.float32:
        precision = lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        precision = None
    kernel = functools.partial(
        _gpu_kernel, block_m=block_m, block_n=block_n, block_k=block_k, precision=precision
    )
    tiles = (pl.cdiv(m, block_m), pl.cdiv(o, block_n))
    if splits is None:
        # Enough programs to fill a large GPU, each at least 8 steps long, and the partial
        # products' float32 bytes (splits * M * O * 4) at most the packed weight's (O * I / 2).
        steps = pl.cdiv(i // 2, block_k)
        splits = min(MIN_PROGRAMS // (tiles[0] * tiles[1]), steps // 8, i // (8 * m))
        splits = max(1, splits)
    out = pl.pallas_call(
        kernel,
        grid=(*tiles, splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, o), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="int4_matmul_gpu",
    )(x_lo, x_hi, w.packed, w.scales, w.mins)
    return out[0] if splits == 1 else jnp.sum(out, axis=0)

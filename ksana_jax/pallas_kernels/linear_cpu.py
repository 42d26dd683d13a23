"""Small-batch linear layers for CPUs: y f32[R, O] = x f32[R, I] . w[O, I]^T as a C++ XLA
FFI custom call, linear_cpu.cc, for float32, bfloat16, int8 and int4 weights (quant.py's
Int8Matrix / Int4Matrix, read as their packed bytes: no dequantized copy), one weight a
call (q/k/v and gate/up are fused into one matrix each at load, models/fusion.py).

At decode's few rows a product is bound by the weight bytes, and XLA:CPU streams them far
below the machine's bandwidth; the kernel has every core stream its own weight rows once,
dequantized in registers, with all R rows of x in a register tile (benchmarks/linear_cpu.py
measures it against XLA's dot). `models.layers.linear` takes this path on CPU for
MIN_ROWS <= R <= MAX_ROWS; the jnp product (dequantize, then dot) stays the reference and the path
everywhere else.

Compiled at first use (cpu_build.py: the system C++ compiler, once per machine);
`available()` says whether that worked.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import quant
from ksana_jax.pallas_kernels import cpu_build

SOURCE = Path(__file__).with_suffix(".cc")
TARGET = "ksana_linear_cpu"
_SYMBOL = "KsanaLinearCpu"
ARGMAX_TARGET = "ksana_linear_argmax_cpu"
_ARGMAX_SYMBOL = "KsanaLinearArgmaxCpu"


def direct_isa() -> str | None:
    """Which of the kernel's direct paths this CPU builds (linear_cpu_common.h decides the same
    from the compiler's -march=native): "avx512" (AVX512-BF16: vdpbf16ps, and VNNI's vpdpbusd
    for integer dots), "avx2" (AVX2, FMA and F16C without AVX512-BF16: linear_cpu_avx2.h), or
    None (the chunked path alone)."""
    flags = cpu_build.cpu_flags()
    if "avx512_bf16" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else None


def integer_dots(w: jax.Array | quant.QuantizedMatrix) -> bool:
    """Whether the kernel multiplies quantized matrix `w` by integer dots (a bfloat16 product on
    a CPU with AVX512-VNNI and AVX512-BF16, vpdpbusd, or with AVX2, vpmaddubsw). Its weights are
    then exact (q * scale, or q * scale + min for int4, not rounded to bfloat16) and x, rounded
    to bfloat16, is rounded further to 8-bit integers times a step per 32 columns (`x_step`):
    int8 (linear_cpu_quant.h's tile_dot_int8_vnni, linear_cpu_avx2.h's tile_dot_int8) with I
    a multiple of 32 and one scale a row or groups of a multiple of 32 columns; int4
    (tile_dot_int4_vnni, tile_dot_int4) always."""
    if not isinstance(w, quant.Int8Matrix | quant.Int4Matrix):
        return False
    if jnp.dtype(w.dtype) != jnp.bfloat16:
        return False
    if isinstance(w, quant.Int8Matrix):
        inp, groups = w.shape[-1], w.scales.shape[-1]
        if not (inp % 32 == 0 and (groups == 1 or (inp // groups) % 32 == 0)):
            return False
    isa = direct_isa()
    return isa == "avx2" or (isa == "avx512" and "avx512_vnni" in cpu_build.cpu_flags())


def x_step(w: quant.QuantizedMatrix) -> tuple[int, int]:
    """How the kernel rounds x (in bfloat16) for integer-dot matrix `w` (`integer_dots`):
    (columns, bits): each run of `columns` columns becomes integers q times a step, the run's
    largest magnitude / (2^(bits - 1) - 1), q = x * ((2^(bits - 1) - 1) / largest) to nearest
    even in float32: at most half a step off. llama.cpp quantizes x so (8 bits per 32 columns,
    its Q8_0) for its 4- and 8-bit weights: one product of bytes per 4 weights, which bounds
    these paths' speed."""
    return (32, 8)


# Rows up to which `layers.linear` takes the kernel, by weight format: beyond them XLA's
# dot was as fast or faster (benchmarks/linear_cpu.py for single products; the engine's
# tokens/s at each row count, SmolLM2 decode, for bfloat16). bfloat16 where the CPU has AMX:
# past 8 rows the kernel runs on AMX tiles too (linear_cpu.cc, run_rows_amx), reading the
# weight as it lies, where XLA's dot repacked every weight on every call (2-core Xeon with
# AMX, 2026-12-06, a program of 30 products [1536, 576]: 1.7-4.4 ms against XLA's 10.8-20.7
# at 9-64 rows; host_overhead.py, SmolLM2 bfloat16: 1,115 tok/s at 32 rows against 735,
# 1,348 at 64 against 1,122); with vdpbf16ps alone it could not match XLA's AMX past a few rows
# (2026-12-02: 1.10x XLA's tokens/s at 8 rows, 0.84x at 16, 0.67x at 32, 0.49-0.52x at 64),
# so it stopped at 8 then. Without AMX (Zen 5,
# AVX-512 BF16) the kernel was ahead up to 64 rows (1.12-1.28x at 32, 1.02-1.11x at 64); with
# AVX2 alone (Zen 3, 2026-12-03, benchmarks/quant.py): 1.42x at 16 rows, 0.87-1.07x at 32,
# 0.82x at 64 (there int4 by integer dots was 1.04x XLA's, and at 16 rows int8 1.9x, int4 3.3x).
# int8 by integer dots (`integer_dots`; SmolLM2 int8 decode, the engine, one process per
# setting, alternating): the kernel 394-410 tok/s against XLA's 213-220 at 16 rows, 435-458
# against 371-427 at 32, 449-489 against 642-670 at 64. int8 otherwise 0.23x at 1, 0.53x at
# 8; int4 in a bfloat16 product (then by Q4_1's algebra in bfloat16 dots; integer dots are
# 1.1-1.8x faster) 0.01-0.2x at 1-16 rows per product at load 9-11. int4 by integer dots
# (x as bytes, SmolLM2 int4 decode, the engine, 64 tokens a request, one process per setting,
# 2026-12-03, median of 4 / two rounds): the kernel 384 / 368 tok/s against XLA's 212 / 206
# at 32 rows, 404 / 387 against 287 / 310 at 64, 441 against 472 at 128 (one round); int4
# without them (a float32 product, or no VNNI) keeps 16. float32 takes the kernel at 2-64
# rows where the CPU has AVX-512F (run_rows_f32: the same sums in the same order at every row
# count, so within those rows a position's products do not depend on its step). A 2-core Xeon
# with AMX (2026-12-06, one process, the kernel's and XLA's programs alternating, median ms a
# step): SmolLM2 float32 decode 42.3 against 54.3 at 8 rows (1.28x), 74.5 against 87.0 at 32
# (1.17x); the tiny float32 model (its LM head [49152, 128] most of a step) 1.87 against 2.40
# at 8 rows, 6.78 against 7.57 at 64 with async scheduling off, 7.36 against 7.27 with it on.
# Past 64 rows the kernel was slower, even with its columns in blocks of 128 and its rows in
# blocks of 256 (tried): one core, XLA's time over the kernel's, [1536, 576] 0.93 at 1,024
# rows, LM heads [49152, 128] / [49152, 576] 0.61 / 0.75 at 256; with every float32 product
# of 2+ rows in the kernel, SmolLM2 float32 prefill (8 prompts of 256 tokens) took 1,237-1,270
# ms against 1,037-1,041 and the tiny model decoded 7,444 tok/s at 256 rows against ~11,000.
# So float32 steps of more than 64 tokens depend on their step as bfloat16's past their
# MAX_ROWS do (no test compares such samples exactly). An earlier try with the kernel up to 8
# rows failed tests/test_server_echo.py: chunked prefill put its tiny-model prompts into steps
# on both sides of 8 tokens, and two greedy samples of one prompt (n=2) got different logprobs.
MAX_ROWS = {
    "float32": 64 if "avx512f" in cpu_build.cpu_flags() else 0,  # run_rows_f32: AVX-512F
    "bfloat16": 64 if direct_isa() == "avx512" else 16,  # CPUs with AMX have AVX512-BF16
    "int8": 8,
    "int8_integer_dots": 32,
    "int4": 16,
    "int4_integer_dots": 64,
}
# Rows from which `layers.linear` takes the kernel, where not 1. float32 at 1 row stays on
# XLA's dot (a matrix-vector product, faster there: [1536, 576] 130 against 190 us): its
# sums' order differs from its product of 2+ rows anyway, which the kernel's equals at I 128.
MIN_ROWS = {"float32": 2}
_WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)
# Calls of fewer weight bytes (with their scales) run on the caller's thread alone. XLA's
# pool threads started 0.1-10 ms late on this repo's loaded 2-core machine, after a decode
# layer's products (10-100 us) had finished, so the threshold was once 1 MiB;
# the kernels' own spinning pool (cpu_pool.h) joins within microseconds, and a quantized
# product is bound by its unpacking more than by its bytes (int4: four times the multiplies
# of bfloat16 a byte). SmolLM2 batch-1 (2026-12-02, one process per setting, 2-3 alternating
# rounds, the jitted step alone): int4 10.4-11.9 ms a step at 256 KiB and 10.6-10.9 at 128 KiB
# against 11.9-13.0 at 1 MiB (which left q/k/v, o and down on one core); int8 14.2-14.7
# against 18.0-18.3; bfloat16 15.7-16.8 against 16.3-16.8 (the output projection, 0.66 MB,
# on both cores). benchmarks/linear_cpu.py --layers re-measures it.
PARALLEL_BYTES = 1 << 17
# KSANA_JAX_CPU_LINEAR=0 keeps XLA's dot everywhere (a before/after comparison in one run).
ENABLED = os.environ.get("KSANA_JAX_CPU_LINEAR", "1") != "0"


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads on this machine."""
    return cpu_build.available(SOURCE, _SYMBOL, TARGET)


def supports(w: jax.Array | quant.QuantizedMatrix) -> bool:
    """Whether the kernel takes weight `w` (a matrix [O, I] in float32 / bfloat16, or an int8
    / int4 quantized one, a layer view of stacked arrays included: the call reads its layer in
    place; int8 groups must be whole vectors of 16)."""
    if len(w.shape) != 2:
        return False
    if jnp.dtype(w.dtype) not in _WEIGHT_DTYPES:  # a quantized matrix's: its product's dtype
        return False
    if isinstance(w, quant.Int8Matrix):
        return w.scales.shape[-1] == 1 or w.group_size % 16 == 0
    return True


def takes(x: jax.Array, w: jax.Array | quant.QuantizedMatrix) -> bool:
    """Whether `layers.linear` runs x [R, I] . w^T through the kernel, decided at trace time:
    on CPU, outside a mesh of several devices (XLA cannot partition a custom call; the
    tensor-parallel split keeps the jnp product), for a weight it takes and R within its
    format's MIN_ROWS and MAX_ROWS, when the kernel builds here."""
    if not ENABLED or x.ndim != 2 or jax.default_backend() != "cpu" or not supports(w):
        return False
    if not MIN_ROWS.get(kind(w)[0], 1) <= x.shape[0] <= max_rows(w):
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return (mesh.empty or mesh.size == 1) and available()


def indexes_layers() -> bool:
    """Whether a one-device model here keeps its quantized layer matrices stacked
    (registry.stack_layers): the kernel reads each layer's matrix from them in place."""
    return ENABLED and jax.default_backend() == "cpu" and available()


def rows_taken(params) -> int:
    """The most rows at which `layers.linear` runs some matrix of `params` (a params pytree,
    layers possibly stacked) through the kernel on this machine, 0 for none: token buckets
    up to it are worth compiling for decode (runner.py). 0 on a mesh of several devices."""
    if not ENABLED or jax.default_backend() != "cpu" or jax.device_count() > 1:
        return 0
    most = 0
    for w in jax.tree.leaves(params, is_leaf=quant.is_quantized):
        # a format that starts past one row (MIN_ROWS) gains nothing from 1-token steps
        if len(w.shape) >= 2 and kind(w)[0] in MAX_ROWS and kind(w)[0] not in MIN_ROWS:
            most = max(most, max_rows(w))
    return most if most and available() else 0


def max_rows(w: jax.Array | quant.QuantizedMatrix) -> int:
    """The most rows of x at which `layers.linear` runs weight `w` through the kernel."""
    name = kind(w)[0]
    return MAX_ROWS[f"{name}_integer_dots" if integer_dots(w) else name]


def _operands(w: jax.Array | quant.QuantizedMatrix) -> tuple[jax.Array, jax.Array, jax.Array]:
    none = jnp.zeros((0, 0), jnp.float32)
    if isinstance(w, quant.Int8Matrix):
        return w.values, w.scales, none
    if isinstance(w, quant.Int4Matrix):
        return w.packed, w.scales, w.mins
    return w, none, none


def _scale_dtype(a: jax.Array) -> jax.Array:
    return a if a.dtype in (jnp.float32, jnp.float16) else a.astype(jnp.float32)


def kind(w: jax.Array | quant.QuantizedMatrix) -> tuple[str, str]:
    """The weight's storage format and product dtype."""
    fmt = w.format if quant.is_quantized(w) else jnp.dtype(w.dtype).name
    return fmt, jnp.dtype(w.dtype).name


# The gated MLP's activations the kernel applies to x's (gate, up) pairs (config.HIDDEN_ACTS),
# as its `gate` attribute.
GATES = {"silu": 1, "gelu_pytorch_tanh": 2}


def linear(
    x: jax.Array,
    w: jax.Array | quant.QuantizedMatrix,
    norm: tuple[jax.Array, float, float] | None = None,
    residual: jax.Array | None = None,
    gate: str | None = None,
) -> jax.Array:
    """x [R, I] times w [O, I] transposed -> f32[R, O]: `models.layers.linear` without a bias,
    with its `norm` (weight [I], eps, offset: x is RMS-normed first, as layers.rms_norm),
    `residual` f32[R, O] (added to the product) and `gate` (x [R, 2I] holds (gate, up) pairs
    and the product's input is act(gate) * up, as layers.gate_up_activation), within float32
    rounding: as there, the
    product is in w's dtype (a quantized matrix's
    `dtype`): for bfloat16, x and the dequantized weights are rounded to bfloat16 and their
    products summed in float32 -- but a matrix the kernel multiplies by integer dots
    (`integer_dots`) is not rounded: x is multiplied by the exact q * scale (+ min) (closer to
    the float32 product than the jnp path's bfloat16 weights, by up to their rounding, 2^-9 of
    each weight), while x's bfloat16 values are rounded further (`x_step`).
    Raises ValueError for a weight the kernel does not take (`supports`) or an x that does
    not fit it."""
    out = _check(x, w, gate)
    if residual is not None and residual.shape != out:
        raise ValueError(f"residual must be {list(out)}, got {residual.shape}")
    cpu_build.register(SOURCE, _SYMBOL, TARGET)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(out, jnp.float32))
    operands, attributes = _call_operands(x, w, norm)
    residual = jnp.zeros((0, 0)) if residual is None else residual.astype(jnp.float32)
    return call(*operands, residual, **attributes, gate=np.int32(GATES.get(gate, 0)))


def linear_argmax(
    x: jax.Array,
    w: jax.Array | quant.QuantizedMatrix,
    argmax_if: jax.Array,
    norm: tuple[jax.Array, float, float] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """An LM head and greedy decoding's argmax in one call: where `argmax_if` (bool[], read
    when the call runs) holds, (y, ids) with ids i32[R] each row's first largest element of
    `linear(x, w, norm)` and y f32[R, O] never written (undefined); otherwise (that product,
    zeros). The kernel folds its sums into each row's running maximum as it makes them, so
    the logits are neither stored nor read again: for the tiny float32 model's LM head
    [49152, 128] at 64 rows they were 12.6 MB a step. The sums are `linear`'s, so ids equal
    the first maxima of its y (a row of NaN gives 0). Raises ValueError as `linear` does."""
    out = _check(x, w, None)
    if argmax_if.shape != () or argmax_if.dtype != jnp.bool_:
        raise ValueError(f"argmax_if must be a bool scalar, got {argmax_if.dtype}{argmax_if.shape}")
    cpu_build.register(SOURCE, _ARGMAX_SYMBOL, ARGMAX_TARGET)
    shapes = (jax.ShapeDtypeStruct(out, jnp.float32), jax.ShapeDtypeStruct(out[:1], jnp.int32))
    operands, attributes = _call_operands(x, w, norm)
    return jax.ffi.ffi_call(ARGMAX_TARGET, shapes)(*operands, argmax_if, **attributes)


def _check(x: jax.Array, w: jax.Array | quant.QuantizedMatrix, gate: str | None) -> tuple:
    """The shape (R, O) of x . w^T, once `linear`'s arguments are checked."""
    if not supports(w):
        raise ValueError(f"the cpu linear kernel does not take a weight {w!r:.200}")
    if gate is not None and gate not in GATES:
        raise ValueError(f"gate must be one of {tuple(GATES)} or None, got {gate!r}")
    width = w.shape[1] * (1 if gate is None else 2)
    if x.ndim != 2 or x.shape[1] != width:
        raise ValueError(f"x must be [R, {width}], got {x.shape}")
    return (x.shape[0], w.shape[0])


def _call_operands(
    x: jax.Array, w: jax.Array | quant.QuantizedMatrix, norm: tuple | None
) -> tuple[list[jax.Array], dict]:
    """The operands (x, w's arrays, the norm's weight) and attributes both kernels take."""
    values, scales, mins = _operands(w)
    weight, eps, offset = (jnp.zeros((0,)), 0.0, 0.0) if norm is None else norm
    operands = [
        x.astype(jnp.float32),
        values,
        _scale_dtype(scales),
        _scale_dtype(mins),
        weight if weight.dtype in (jnp.float32, jnp.bfloat16) else weight.astype(jnp.float32),
    ]
    attributes = dict(
        bf16=jnp.dtype(w.dtype) == jnp.bfloat16,
        parallel_bytes=np.int64(PARALLEL_BYTES),
        norm_eps=np.float32(eps),
        norm_offset=np.float32(offset),
        layer=np.int64(getattr(w, "layer", None) or 0),
    )
    return operands, attributes

"""The CPU linear kernel (pallas_kernels/linear_cpu.cc) against its jnp reference
(dequantize, then a float32 dot) for every weight format and product dtype, on random shapes
whose O and I are not multiples of the kernel's vector width, register tile or column chunk,
rows 1-33."""

from __future__ import annotations

import dataclasses
import functools
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import integer_x, run_on_cpu_devices

from ksana_jax import quant
from ksana_jax.models import layers
from ksana_jax.pallas_kernels import cpu_build, linear_cpu

pytestmark = pytest.mark.skipif(not linear_cpu.available(), reason="no C++ compiler")

# (O, I): tails of the 16-lane vector (I), the 4-row weight block (O), the 512-column chunk.
FLOAT_SHAPES = [(1, 1), (7, 13), (5, 100), (33, 576), (130, 1100), (64, 1536)]
GROUPED_SHAPES = [(1, 32), (7, 96), (33, 576), (130, 1056), (13, 1536)]  # I % 32 == 0
G64_SHAPES = [(1, 64), (7, 128), (33, 576), (130, 1088)]  # I % 64 == 0
ROWS = [1, 2, 3, 5, 8, 16, 33, 64]  # register tiles of 4 rows (AMX: 16): with tails


def weight(rng: np.random.Generator, fmt: str, out: int, inp: int):
    """A random weight of format `fmt`; a "_bf16" suffix makes a quantized matrix's product
    bfloat16's (a bfloat16 model quantized), "int8_g16" / "int8_g64" have a float32 scale per
    16 / 64 columns, "int4_f32" float32 scales and mins (int4's are float16)."""
    w = rng.standard_normal((out, inp)).astype(np.float32)
    fmt, bf16 = fmt.removesuffix("_bf16"), fmt.endswith("_bf16")
    if fmt in ("float32", "bfloat16"):
        return jnp.asarray(w, fmt)
    if fmt in ("int8_q8_0", "int8_g16", "int8_g64"):  # Q8_0: GGUF's, a float16 scale per 32
        m = quant.quantize(w, "int8")
        group = {"int8_q8_0": 32, "int8_g16": 16, "int8_g64": 64}[fmt]
        scale_dtype = np.float16 if fmt == "int8_q8_0" else np.float32
        scales = rng.random((out, inp // group)).astype(scale_dtype) / 100
        m = quant.Int8Matrix(m.values, scales)
    elif fmt == "int4_f32":
        m = quant.quantize(w, "int4")
        m = quant.Int4Matrix(m.packed, m.scales.astype(np.float32), m.mins.astype(np.float32))
    else:
        m = quant.quantize(w, fmt)
    if bf16:
        m = dataclasses.replace(m, dtype="bfloat16")
    return jax.tree.map(jnp.asarray, m)


def reference(x: jax.Array, w, kernel: bool = True) -> jax.Array:
    """Dequantize, then a float32 dot; bfloat16 weights multiply x rounded to bfloat16. An
    int4 matrix in a bfloat16 product is dequantized to float32, not bfloat16, and so is an
    int8 one the kernel multiplies by integer dots (linear_cpu.integer_dots): the kernel
    multiplies the exact q * scale (+ min), by x rounded further as it does (`integer_x`) --
    but for int4's minimums, which multiply x's exact sums per group; with `kernel` False,
    XLA's product, int8 and int4 weights rounded to bfloat16."""
    dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
    if jnp.dtype(w.dtype) == jnp.bfloat16:  # a quantized matrix's dtype is a name
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    if kernel and linear_cpu.integer_dots(w):
        x_int = jnp.asarray(integer_x(x, w))
        y = dot(x_int, quant.dequantize(w, "float32").T)
        if isinstance(w, quant.Int4Matrix):  # the minimums' term: x's own sums, not x_int's
            mins = jnp.repeat(w.mins.astype(jnp.float32), 32, axis=1)
            y = y + dot(x - x_int, mins.T)
        return y
    if isinstance(w, quant.Int4Matrix) and kernel:
        w = quant.dequantize(w, "float32")
    elif quant.is_quantized(w):
        w = quant.dequantize(w)
    return dot(x, w.astype(jnp.float32).T)


@pytest.mark.parametrize(
    "fmt",
    [
        "float32",
        "bfloat16",
        "int8",
        "int8_bf16",
        "int8_q8_0",
        "int8_q8_0_bf16",
        "int8_g16_bf16",
        "int8_g64_bf16",
        "int4",
        "int4_bf16",
        "int4_f32",
        "int4_f32_bf16",
    ],
)
def test_kernel_equals_the_jnp_reference(fmt):
    rng = np.random.default_rng(0)
    shapes = FLOAT_SHAPES if fmt in ("float32", "bfloat16", "int8", "int8_bf16") else GROUPED_SHAPES
    shapes = G64_SHAPES if fmt == "int8_g64_bf16" else shapes
    kernel = jax.jit(linear_cpu.linear)
    for out, inp in shapes:
        w = weight(rng, fmt, out, inp)
        assert linear_cpu.supports(w)
        for rows in ROWS:
            x = jnp.asarray(rng.standard_normal((rows, inp)), jnp.float32)
            got, want = kernel(x, w), reference(x, w)
            assert got.shape == (rows, out) and got.dtype == jnp.float32
            scale = float(jnp.max(jnp.abs(want))) + 1
            np.testing.assert_allclose(got, want, atol=2e-6 * scale * np.sqrt(inp), rtol=0)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8_q8_0_bf16", "int4_bf16"])
def test_norm_and_residual_in_the_call_equal_them_around_it(fmt):
    """`norm` (an RMS norm of x before the product, weight float32 or bfloat16, Gemma's
    offset 1 too) and `residual` (added after) in the kernel's call equal layers.rms_norm
    before the reference product and the residual added after it."""
    rng = np.random.default_rng(7)
    kernel = linear_cpu.linear  # eager: the norm's eps and offset are static
    for (out, inp), rows in [((33, 576), 1), ((130, 1056), 5), ((7, 96), 33)]:
        w = weight(rng, fmt, out, inp)
        x = jnp.asarray(3 * rng.standard_normal((rows, inp)), jnp.float32)
        residual = jnp.asarray(rng.standard_normal((rows, out)), jnp.float32)
        for dtype, offset in [(jnp.float32, 0.0), (jnp.bfloat16, 1.0)]:
            norm = layers.RMSNorm(jnp.asarray(rng.standard_normal(inp), dtype), 1e-5, offset)
            want = residual + reference(layers.rms_norm(x, *norm), w)
            scale = float(jnp.max(jnp.abs(want))) + 1
            tol = 2e-6 * scale * np.sqrt(inp)
            got = kernel(x, w, norm, residual)
            np.testing.assert_allclose(got, want, atol=tol, rtol=0)
            got = kernel(x, w, norm)  # the norm alone
            np.testing.assert_allclose(got, want - residual, atol=tol, rtol=0)
        np.testing.assert_allclose(  # the residual alone
            kernel(x, w, None, residual), residual + reference(x, w), atol=tol, rtol=0
        )
    with pytest.raises(ValueError, match="residual must be"):
        linear_cpu.linear(x, w, residual=jnp.zeros((rows, out + 1)))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8_q8_0_bf16", "int4_bf16"])
def test_gate_in_the_call_equals_the_activation_before_it(fmt):
    """`gate` (x's (gate, up) pairs to act(gate) * up, SwiGLU's silu and GeGLU's tanh GELU)
    in the kernel's call equals layers.gate_up_activation before the reference product, with
    the residual; gate values reach both tails of the activations (|g| up to ~20). So does
    layers.linear with a gate, through the kernel or, past its rows, XLA's product."""
    rng = np.random.default_rng(8)
    for (out, inp), rows in [((33, 576), 1), ((130, 1056), 5), ((7, 96), 33)]:
        w = weight(rng, fmt, out, inp)
        x = jnp.asarray(6 * rng.standard_normal((rows, 2 * inp)), jnp.float32)
        residual = jnp.asarray(rng.standard_normal((rows, out)), jnp.float32)
        for act in ("silu", "gelu_pytorch_tanh"):
            want = residual + reference(layers.gate_up_activation(x, act), w)
            tol = 2e-6 * (float(jnp.max(jnp.abs(want))) + 1) * np.sqrt(inp)
            got = linear_cpu.linear(x, w, residual=residual, gate=act)
            np.testing.assert_allclose(got, want, atol=tol, rtol=0)
            via_layers = jax.jit(functools.partial(layers.linear, gate=act))(
                x, w, residual=residual
            )
            if not linear_cpu.takes(x[:, :inp], w):  # XLA's product: its own rounding
                hidden = layers.gate_up_activation(x, act)
                want = residual + reference(hidden, w, kernel=False)
            np.testing.assert_allclose(via_layers, want, atol=tol, rtol=0)
    with pytest.raises(ValueError, match="gate must be one of"):
        linear_cpu.linear(x, w, gate="relu")
    with pytest.raises(ValueError, match=r"x must be \[R, 192\]"):
        linear_cpu.linear(x[:, :96], w, gate="silu")


def test_int8_weights_of_every_byte_value_equal_the_reference():
    """int8 values over the whole byte range, -128 included (a GGUF Q8_0 block may hold it;
    quant.quantize stops at -127), against x whose groups reach +-127 steps: the integer dots'
    byte products (AVX2: |w| as unsigned bytes, -128 read as 128, times x with w's sign;
    AVX-512: w + 128) must stay exact, not saturate or wrap."""
    rng = np.random.default_rng(5)
    kernel = jax.jit(linear_cpu.linear)
    for out, inp, groups, scale_dtype in [(33, 576, 18, np.float16), (7, 96, 1, np.float32)]:
        values = rng.integers(-128, 128, (out, inp), dtype=np.int8)
        values[:, :32] = -128  # a whole group of the extreme, and pairs of it everywhere
        values[:, 32:64] = 127
        scales = (rng.random((out, groups)) / 100).astype(scale_dtype)
        w = jax.tree.map(jnp.asarray, quant.Int8Matrix(values, scales, "bfloat16"))
        for rows in (1, 2, 3):
            x = rng.standard_normal((rows, inp)).astype(np.float32)
            x[0, :64] = -4.0  # every column its group's largest magnitude: q = -127
            got, want = kernel(jnp.asarray(x), w), reference(jnp.asarray(x), w)
            scale = float(jnp.max(jnp.abs(want))) + 1
            np.testing.assert_allclose(got, want, atol=2e-6 * scale * np.sqrt(inp), rtol=0)


def test_refuses_what_it_does_not_take():
    rng = np.random.default_rng(1)
    odd_groups = quant.Int8Matrix(jnp.zeros((4, 24), jnp.int8), jnp.ones((4, 3), jnp.float32))
    assert not linear_cpu.supports(odd_groups)  # groups of 8 columns
    assert not linear_cpu.supports(jnp.zeros((4, 8), jnp.float16))
    with pytest.raises(ValueError, match="does not take"):
        linear_cpu.linear(jnp.zeros((1, 8)), jnp.zeros((4, 8), jnp.float16))
    with pytest.raises(ValueError, match="x must be"):
        linear_cpu.linear(jnp.zeros((1, 9)), weight(rng, "bfloat16", 4, 8))


def test_layers_linear_takes_the_kernel_at_few_rows_only():
    """`layers.linear` lowers to the custom call for bfloat16 / quantized weights at decode's
    few rows (with the bias added after) and keeps XLA's dot beyond each format's MAX_ROWS;
    both give the reference's values."""
    rng = np.random.default_rng(2)
    bias = jnp.asarray(rng.standard_normal(33), jnp.float32)
    flags = cpu_build.cpu_flags()
    dot_isa = linear_cpu.direct_isa() == "avx2" or {"avx512_vnni", "avx512_bf16"} <= flags
    for fmt in ("bfloat16", "int8", "int8_bf16", "int4", "int4_bf16"):
        w = weight(rng, fmt, 33, 96)
        most = linear_cpu.max_rows(w)
        dots = linear_cpu.integer_dots(w)  # a quantized bfloat16 product, VNNI or AVX2
        assert dots == (fmt.endswith("_bf16") and dot_isa)
        name = fmt.removesuffix("_bf16")
        assert most == linear_cpu.MAX_ROWS[f"{name}_integer_dots" if dots else name]
        for rows in (1, most, most + 1):
            x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
            hlo = jax.jit(layers.linear).lower(x, w, bias).as_text()
            assert (linear_cpu.TARGET in hlo) == (rows <= most), (fmt, rows)
            got = jax.jit(layers.linear)(x, w, bias)
            want = reference(x, w, kernel=rows <= most) + bias
            scale = float(jnp.max(jnp.abs(want))) + 1  # as test_kernel_equals_the_jnp_reference
            tolerance = 2e-6 * scale * np.sqrt(96)
            np.testing.assert_allclose(got, want, atol=tolerance)


@pytest.mark.parametrize(
    "fmt", ["float32", "bfloat16", "int8", "int8_bf16", "int8_q8_0", "int4", "int4_bf16"]
)
def test_work_shared_over_the_pool_equals_the_reference(fmt):
    """With every call's rows shared over the pool's threads (PARALLEL_BYTES 0) and on the
    caller's alone (the default for these small weights), output sizes with tails of the
    4-row block give the reference product."""
    rng = np.random.default_rng(3)
    inp = 96 if fmt in ("int8_q8_0", "int4", "int4_bf16") else 100
    weights = [weight(rng, fmt, out, inp) for out in (33, 7, 130)]
    for parallel_bytes in (linear_cpu.PARALLEL_BYTES, 0):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(linear_cpu, "PARALLEL_BYTES", parallel_bytes)
            kernel = jax.jit(lambda x, w: linear_cpu.linear(x, w))  # traced anew
            for rows in (1, 2, 3, 5, 8):
                x = jnp.asarray(rng.standard_normal((rows, inp)), jnp.float32)
                for w in weights:
                    want = reference(x, w)
                    got = kernel(x, w)
                    assert got.shape == (rows, w.shape[0])
                    scale = float(jnp.max(jnp.abs(want))) + 1
                    np.testing.assert_allclose(got, want, atol=2e-6 * scale * np.sqrt(inp), rtol=0)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8_bf16", "int8_q8_0_bf16", "int4_bf16"])
def test_a_rows_sums_do_not_depend_on_the_calls_rows(fmt):
    """Each row of a call of 2-8 rows is the same numbers as that row alone (register tiles
    of 1, 2 and 4 rows, with tails), on the caller and shared over the pool: within the
    kernel's rows a request's tokens do not depend on its batch."""
    rng = np.random.default_rng(5)
    for out, inp in [(130, 576), (37, 1536), (3, 96)]:
        w = weight(rng, fmt, out, inp)
        x = jnp.asarray(rng.standard_normal((8, inp)), jnp.float32)
        for parallel_bytes in (1 << 40, 0):  # the caller alone; shared over the pool
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(linear_cpu, "PARALLEL_BYTES", parallel_bytes)
                kernel = jax.jit(lambda x, w: linear_cpu.linear(x, w))  # traced anew
                alone = np.concatenate([kernel(x[r : r + 1], w) for r in range(8)])
                for rows in (2, 3, 5, 8):
                    np.testing.assert_array_equal(kernel(x[:rows], w), alone[:rows])


def test_bfloat16_rows_past_eight_do_not_depend_on_the_calls_rows():
    """bfloat16 at 9-64 rows (AMX tiles of 16 rows where the CPU has them, 16 weight rows a
    tile, the other paths for the rest): each row of a call is the same numbers whatever
    rows the call has beside it, on the caller and shared over the pool."""
    rng = np.random.default_rng(6)
    for out, inp in [(130, 576), (64, 1536), (40, 96)]:
        w = weight(rng, "bfloat16", out, inp)
        x = jnp.asarray(rng.standard_normal((64, inp)), jnp.float32)
        for parallel_bytes in (1 << 40, 0):  # the caller alone; shared over the pool
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(linear_cpu, "PARALLEL_BYTES", parallel_bytes)
                kernel = jax.jit(lambda x, w: linear_cpu.linear(x, w))  # traced anew
                full = np.asarray(kernel(x, w))
                for rows in (9, 16, 17, 33, 48):
                    np.testing.assert_array_equal(kernel(x[:rows], w), full[:rows])
                np.testing.assert_array_equal(kernel(x[40:49], w), full[40:49])


def test_float32_rows_sums_do_not_depend_on_the_calls_rows():
    """float32 (run_rows_f32: one multiply-add a column, in order, at any rows a call has):
    each row of a call is the same numbers whatever rows the call has beside it, on the
    caller and shared over the pool, and the product is the float64 one's within float32
    rounding. [330, 576] goes by in two stretches of the weight (kF32StretchBytes), the second
    ending inside a panel."""
    rng = np.random.default_rng(7)
    for out, inp in [(330, 576), (37, 100), (64, 128)]:
        w = weight(rng, "float32", out, inp)
        x = jnp.asarray(rng.standard_normal((300, inp)), jnp.float32)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        # a sum of I float32 products in any order is within I * 2^-24 * sum|x w| of the exact
        bound = inp * 2.0**-24 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w)).T)
        for parallel_bytes in (1 << 40, 0):  # the caller alone; shared over the pool
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(linear_cpu, "PARALLEL_BYTES", parallel_bytes)
                kernel = jax.jit(lambda x, w: linear_cpu.linear(x, w))  # traced anew
                full = np.asarray(kernel(x, w))
                assert np.all(np.abs(full - want) <= bound)
                for rows in (1, 2, 17, 64, 65, 257):
                    np.testing.assert_array_equal(kernel(x[:rows], w), full[:rows])
                np.testing.assert_array_equal(kernel(x[250:270], w), full[250:270])


def test_layers_linear_takes_float32_from_two_rows():
    """float32 products go to the kernel at MIN_ROWS (2) to MAX_ROWS (64 where the CPU has
    AVX-512F) rows, and stay on XLA's dot at one row and past them; `rows_taken` leaves them
    out (no 1-token step is compiled for them)."""
    rng = np.random.default_rng(8)
    w = weight(rng, "float32", 33, 96)
    most = linear_cpu.max_rows(w)
    assert linear_cpu.rows_taken({"w": w}) == 0
    for rows in (1, 2, max(most, 2), most + 1):
        x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
        hlo = jax.jit(layers.linear).lower(x, w).as_text()
        assert (linear_cpu.TARGET in hlo) == (2 <= rows <= most), rows
        np.testing.assert_allclose(jax.jit(layers.linear)(x, w), reference(x, w), atol=1e-4)


def test_layers_linear_is_one_call_at_few_rows_only():
    """`layers.linear` lowers to ONE custom call for a fused q/k/v weight at few rows, to none
    past MAX_ROWS or with KSANA_JAX_CPU_LINEAR=0 (`ENABLED`), and its result is the same each
    way."""
    rng = np.random.default_rng(4)
    w = weight(rng, "bfloat16", 96, 64)
    past = linear_cpu.MAX_ROWS["bfloat16"] + 1
    for rows, calls in ((1, 1), (past, 0)):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        hlo = jax.jit(layers.linear).lower(x, w).as_text()
        assert hlo.count(f"@{linear_cpu.TARGET}(") == calls, (rows, calls)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(linear_cpu, "ENABLED", False)
            off = jax.jit(lambda x, w: layers.linear(x, w))  # traced anew
            assert f"@{linear_cpu.TARGET}(" not in off.lower(x, w).as_text()
            want = off(x, w)
        np.testing.assert_allclose(jax.jit(layers.linear)(x, w), want, atol=1e-5)


def test_a_header_the_kernel_includes_is_part_of_its_build_key(tmp_path, monkeypatch):
    """cpu_build keys a kernel's library by its source and the headers it includes from its
    folder (followed through headers), so editing cpu_pool.h rebuilds; a system or
    XLA header (not in the folder) is not read."""
    monkeypatch.setenv("KSANA_JAX_KERNEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\n')
    (tmp_path / "b.h").write_text("int b = 1;\n")
    source = tmp_path / "k.cc"
    source.write_text('#include <vector>\n#include "a.h"\n#include "xla/ffi/api/ffi.h"\n')
    assert len(cpu_build._source_bytes(source)) == 3
    key = cpu_build._source_bytes(source)
    (tmp_path / "b.h").write_text("int b = 2;\n")
    assert cpu_build._source_bytes(source) != key
    real = cpu_build._source_bytes(linear_cpu.SOURCE)
    # linear_cpu.cc, cpu_pool.h, linear_cpu_common.h, cpu_simd.h, linear_cpu_quant.h,
    # linear_cpu_avx2.h
    assert len(real) == 6


POOL_SCRIPT = """
import ctypes, json, os, sys
import jax, jax.numpy as jnp, numpy as np
from ksana_jax.pallas_kernels import cpu_build, linear_cpu, ragged_paged_attention_cpu
linear_cpu.PARALLEL_BYTES = 0  # every call shares its work
rng = np.random.default_rng(0)
weights = [jnp.asarray(rng.standard_normal((out, 100)), jnp.bfloat16) for out in (33, 7, 130)]
error = 0.0
for rows in (1, 5, 16):
    x = rng.standard_normal((rows, 100)).astype(np.float32)
    x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    for w in weights:
        y = jax.jit(linear_cpu.linear)(jnp.asarray(x), w)
        want = x_bf16 @ np.asarray(w, np.float64).T
        error = max(error, float(np.max(np.abs(np.asarray(y) - want)) / np.max(np.abs(want))))
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
ragged_paged_attention_cpu.available()  # loads the attention kernel's library too
symbol = "_ZZN14ksana_cpu_pool8SpinPool3getEvE4pool"  # SpinPool::get()'s static
libraries = [ctypes.CDLL(str(cpu_build.library_path(m.SOURCE)))
             for m in (linear_cpu, ragged_paged_attention_cpu)]
addresses = {ctypes.addressof(ctypes.c_void_p.in_dll(lib, symbol)) for lib in libraries}
print(json.dumps({"error": error, "pool_threads": names.count("ksana-cpu-pool"),
                  "cores": len(os.sched_getaffinity(0)), "pools": len(addresses)}))
"""


@pytest.mark.parametrize("spin_us", ["300", "0"])
def test_work_sharing_gives_the_reference_on_either_pool_and_one_pool_serves_both_kernels(
    spin_us, monkeypatch
):
    """cpu_pool.h: with every call parallel, the products equal the float64 reference on the
    kernels' own spinning pool (one thread per core but the caller's) and on XLA's pool
    (KSANA_JAX_CPU_SPIN_US=0, no thread of its own); both kernels' libraries bind one pool."""
    monkeypatch.setenv("KSANA_JAX_CPU_SPIN_US", spin_us)
    result = run_on_cpu_devices(POOL_SCRIPT, devices=1)
    assert result["error"] < 1e-5, result
    assert result["pool_threads"] == (result["cores"] - 1 if spin_us != "0" else 0), result
    assert result["pools"] == 1, result


ATTENTION_SHARING_SCRIPT = """
import ctypes, json, os, time
import jax, jax.numpy as jnp, numpy as np
from ksana_jax.kv_cache import float_kv
from ksana_jax.pallas_kernels import cpu_build, linear_cpu, reference
from ksana_jax.pallas_kernels import ragged_paged_attention_cpu as attention_cpu
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
linear_cpu.PARALLEL_BYTES = 0  # each product shares its work: the pool spins after it
rng = np.random.default_rng(0)
kv_heads, group, head_dim, page_size, pages = 2, 3, 64, 16, 24
rows = [37, 100, 5]  # cached tokens of decode rows, one new token each
page_table = rng.permutation(np.arange(1, pages))[: 3 * 7].reshape(3, 7).astype(np.int32)
args = (
    jnp.asarray(rng.standard_normal((3, kv_heads * group, head_dim)), jnp.float32),
    jnp.asarray(rng.standard_normal((3, kv_heads, head_dim)), jnp.float32),
    jnp.asarray(rng.standard_normal((3, kv_heads, head_dim)), jnp.float32),
    float_kv(jnp.asarray(rng.standard_normal((1, 2, kv_heads, pages, page_size, head_dim)),
                         jnp.float32)),
    jnp.int32(0),
    jnp.asarray(page_table),
    jnp.asarray([c + 1 for c in rows], jnp.int32),
    jnp.asarray([0, 1, 2, 3], jnp.int32),
)
spec = AttentionSpec(head_dim**-0.5)
w = jnp.asarray(rng.standard_normal((512, 64)), jnp.bfloat16)

@jax.jit
def step(x, q, *rest):
    y = linear_cpu.linear(x, w)  # leaves the pool spinning
    return attention_cpu.ragged_paged_attention(q + 0 * y[0, 0], *rest, spec=spec)

want = np.asarray(reference.ragged_paged_attention(*args, spec=spec))
x = jnp.ones((1, 64), jnp.float32)
library = ctypes.CDLL(str(cpu_build.library_path(attention_cpu.SOURCE)))
library.KsanaAttentionItemsShared.restype = ctypes.c_int64
# On a loaded machine the pool's thread may not run during a call at all: calls repeat until
# it has taken an item (or a deadline passes), each checked against the oracle.
error, calls, deadline = 0.0, 0, time.monotonic() + 30
while calls < 50 or (library.KsanaAttentionItemsShared() == 0 and time.monotonic() < deadline):
    error = max(error, float(np.max(np.abs(np.asarray(step(x, *args)) - want))))
    calls += 1
print(json.dumps({"error": error, "shared": library.KsanaAttentionItemsShared(),
                  "calls": calls, "cores": len(os.sched_getaffinity(0))}))
"""


def test_small_attention_steps_share_the_awake_pool():
    """ragged_paged_attention_cpu.cc: a decode step too small for XLA's pool (6 items here)
    hands its items to the kernels' pool when a product before it left the pool spinning;
    the results still equal the oracle's, and the pool's thread ran some of the items. The
    pool spins for a second after each product here, so that a busy machine's scheduler
    cannot put it to sleep between the product and the attention."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KSANA_JAX_CPU_SPIN_US", "1000000")
        result = run_on_cpu_devices(ATTENTION_SHARING_SCRIPT, devices=1)
    assert result["error"] < 1e-5, result
    assert result["shared"] > 0 or result["cores"] == 1, result


POOL_STRESS = r"""
// SpinPool (cpu_pool.h) alone: jobs of 1 and 4 items back to back; each item must run once.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include "cpu_pool.h"
std::atomic<int> runs[4];
int main(int argc, char** argv) {
  auto& pool = ksana_cpu_pool::SpinPool::get();
  if (!pool.enabled()) return 2;
  auto fn = [](void*, int64_t i) { runs[i].fetch_add(1); };
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(atoi(argv[1]));
  long jobs = 0;
  while (std::chrono::steady_clock::now() < end) {
    for (int k = 0; k < 1000; ++k, ++jobs) {
      const int n = (k & 1) ? 1 : 4;
      for (auto& r : runs) r.store(0);
      pool.try_run(n, fn, nullptr, /*spin=*/true);
      for (int i = 0; i < 4; ++i)
        if (runs[i].load() != (i < n ? 1 : 0)) {
          printf("job %ld of %d items: item %d ran %d times\n", jobs, n, i, runs[i].load());
          return 1;
        }
    }
  }
  printf("%ld jobs\n", jobs);
  return 0;
}
"""


@pytest.mark.skipif(not linear_cpu.available(), reason="no C++ compiler for the CPU kernels")
def test_spin_pool_runs_each_item_once(tmp_path):
    """cpu_pool.h under stress: jobs of 1 and 4 items back to back, the pool's thread
    spinning between them. Each item must run exactly once and every call return. Before the
    item count was tagged with its job, a pool thread still in a 1-item job could read the
    next job's count, claim item 1 of the old job's claim word and run the new job's item 1 a
    second time (its caller then waited for ever for one more than all its items): this
    program failed within 2-3 s on the 2-core test machine."""
    source = tmp_path / "pool_stress.cc"
    source.write_text(POOL_STRESS)
    binary = tmp_path / "pool_stress"
    command = cpu_build._compile_command(source, binary)
    command = [c for c in command if c not in ("-shared", "-fPIC")]
    command.insert(-3, f"-I{linear_cpu.SOURCE.parent}")
    subprocess.run([*command, "-pthread"], check=True, capture_output=True)
    try:
        run = subprocess.run([str(binary), "8"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a pool call never returned (an item counted done twice)")
    if run.returncode == 2:
        pytest.skip("one core: the pool has no thread of its own")
    assert run.returncode == 0, run.stdout


@pytest.mark.parametrize("fmt", ["int8_bf16", "int8_q8_0_bf16", "int4", "int4_bf16"])
def test_a_layer_view_of_stacked_matrices_equals_its_own_matrix(fmt):
    """A layer view (quant.py: stacked arrays [L, ...] and a static `layer`) through the kernel
    gives exactly what that layer's own matrix gives (the call reads its bytes in place, with
    the norm and the residual), and the compiled step passes the stacked arrays to the call
    with no slice or copy of them; past the kernel's rows `layers.linear` multiplies the
    layer's slice. A layer past the stack is refused."""
    rng = np.random.default_rng(5)
    own = [weight(rng, fmt, 33, 96) for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *own)
    norm_weight = jnp.asarray(rng.standard_normal(96), jnp.float32)
    call = jax.jit(
        lambda x, w, r: layers.linear(x, w, norm=layers.RMSNorm(norm_weight, 1e-5), residual=r)
    )
    for rows in (1, 3, linear_cpu.max_rows(own[0]) + 1):
        x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
        residual = jnp.asarray(rng.standard_normal((rows, 33)), jnp.float32)
        for i, w in enumerate(own):
            view = dataclasses.replace(stacked, layer=i)
            assert view.shape == w.shape == (33, 96)
            np.testing.assert_array_equal(call(x, view, residual), call(x, w, residual))
    one_row = jnp.zeros((1, 96), jnp.float32)
    hlo = jax.jit(lambda x, w: layers.linear(x, w)).lower(one_row, view).compile().as_text()
    assert linear_cpu.TARGET in hlo and "slice" not in hlo and "copy" not in hlo
    past = dataclasses.replace(stacked, layer=3)
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(jax.jit(linear_cpu.linear)(one_row, past))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int8_q8_0_bf16", "int4_bf16"])
def test_argmax_in_the_call_is_the_first_max_of_its_product(fmt):
    """linear_argmax (greedy decoding's LM head): where argmax_if holds, its ids are the
    first largest element of each row of `linear`'s product (np.argmax), on the caller and
    with the weight's rows in work items over the pool, at 1-64 rows (every path: float32's
    panels and stretches, AMX tiles and their tail rows, the quantized paths). The weight is
    three copies of one, so each row's largest sum comes three times over: the first copy's
    must win. Where argmax_if does not hold, y is `linear`'s product and ids are zero. A row
    of NaN gives 0."""
    rng = np.random.default_rng(11)
    inp = 96 if fmt in ("int8_q8_0_bf16", "int4_bf16") else 576
    for copy in (330, 7):
        w = jax.tree.map(lambda a: jnp.concatenate([a] * 3), weight(rng, fmt, copy, inp))
        for parallel_bytes in (1 << 40, 0):  # the caller alone; shared over the pool
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(linear_cpu, "PARALLEL_BYTES", parallel_bytes)
                product = jax.jit(lambda x, w: linear_cpu.linear(x, w))  # traced anew
                fused = jax.jit(lambda x, w, a: linear_cpu.linear_argmax(x, w, a))
                for rows in (1, 2, 5, 16, 17, 33, 64):
                    x = jnp.asarray(rng.standard_normal((rows, inp)), jnp.float32)
                    y = np.asarray(product(x, w))
                    ids = np.asarray(fused(x, w, jnp.bool_(True))[1])
                    np.testing.assert_array_equal(ids, np.argmax(y, axis=1))
                    exact = y.max(axis=1) == y[np.arange(rows), ids % copy]
                    assert np.all(ids[exact] < copy), (rows, ids)  # ties keep the first
                    y_off, ids_off = fused(x, w, jnp.bool_(False))
                    np.testing.assert_array_equal(y_off, y)
                    np.testing.assert_array_equal(ids_off, np.zeros(rows, np.int32))
    x = jnp.asarray(rng.standard_normal((3, inp)), jnp.float32).at[1].set(jnp.nan)
    ids = np.asarray(jax.jit(linear_cpu.linear_argmax)(x, w, jnp.bool_(True))[1])
    assert ids[1] == 0 and ids[0] == np.argmax(np.asarray(jax.jit(linear_cpu.linear)(x, w))[0])


def test_lm_head_folds_the_argmax_into_the_kernels_call_only():
    """layers.lm_head is one call of the argmax kernel where `linear` takes the kernel (its
    logits then that call's y), and `linear`'s product with no ids past the kernel's rows;
    linear_argmax refuses an argmax_if that is not a bool scalar."""
    rng = np.random.default_rng(12)
    w = weight(rng, "bfloat16", 40, 64)
    flag = jnp.bool_(False)
    for rows, fused in ((3, True), (linear_cpu.MAX_ROWS["bfloat16"] + 1, False)):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        hlo = jax.jit(layers.lm_head).lower(x, w, flag).as_text()
        assert hlo.count(f"@{linear_cpu.ARGMAX_TARGET}(") == fused
        logits, ids = jax.jit(layers.lm_head)(x, w, flag)
        assert (ids is not None) == fused
        np.testing.assert_array_equal(logits, jax.jit(layers.linear)(x, w))
    with pytest.raises(ValueError, match="argmax_if"):
        linear_cpu.linear_argmax(x[:3], w, jnp.zeros(1, bool))

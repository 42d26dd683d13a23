"""Quantized matrices (ksana_jax/quant.py): formats against an element-by-element numpy
oracle, and the model layers' dispatch on them against dequantize-then-matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksana_jax import quant
from ksana_jax.models import layers
from ksana_jax.pallas_kernels import linear_cpu

RNG = np.random.default_rng(19)


def oracle_int4(packed: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Element by element, as GGUF's Q4_1 defines it: element k of group g is byte k % 16 of
    the group, low nibble for k < 16, high for k >= 16; value = q * scale + min."""
    rows, half = packed.shape
    out = np.zeros((rows, 2 * half), np.float32)
    for o in range(rows):
        for i in range(2 * half):
            g, k = divmod(i, 32)
            byte = int(packed[o, g * 16 + k % 16])
            q = byte & 0xF if k < 16 else byte >> 4
            out[o, i] = q * np.float32(scales[o, g]) + np.float32(mins[o, g])
    return out


def oracle_int8(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    group = values.shape[1] // scales.shape[1]
    cols = np.arange(values.shape[1]) // group
    return values.astype(np.float32) * scales[:, cols].astype(np.float32)


@pytest.mark.parametrize("shape", [(5, 32), (7, 96), (1, 64)])
def test_int4_round_trip_matches_the_oracle_within_half_a_step(shape):
    w = RNG.standard_normal(shape).astype(np.float32)
    w[0, :32] = 0.25  # a constant group: scale 0
    m = quant.quantize(w, "int4")
    assert m.packed.dtype == np.uint8 and m.packed.shape == (shape[0], shape[1] // 2)
    assert m.scales.dtype == np.float16 and m.scales.shape == (shape[0], shape[1] // 32)
    got = quant.dequantize(m)
    np.testing.assert_array_equal(got, oracle_int4(m.packed, m.scales, m.mins))
    step = np.repeat(m.scales.astype(np.float32), 32, axis=1)
    # Half a step of rounding, plus float16's rounding of the min (relative 2^-11).
    bound = step / 2 + np.abs(np.repeat(m.mins.astype(np.float32), 32, axis=1)) * 2**-11 + 1e-7
    assert np.all(np.abs(got - w) <= bound)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jax.tree.map(jnp.asarray, m))), got)


def test_int8_round_trip_matches_the_oracle_within_half_a_step():
    w = RNG.standard_normal((6, 40)).astype(np.float32)
    w[2] = 0.0  # a zero row: scale 0, no division by zero
    m = quant.quantize(w, "int8")
    assert m.values.dtype == np.int8 and m.scales.shape == (6, 1) and m.group_size == 40
    got = quant.dequantize(m)
    np.testing.assert_array_equal(got, oracle_int8(m.values, m.scales))
    assert np.all(np.abs(got - w) <= m.scales / 2 + 1e-7)
    assert np.all(got[2] == 0)


def test_int8_in_groups_of_32_dequantizes_per_group():
    values = RNG.integers(-127, 128, (3, 64)).astype(np.int8)
    scales = RNG.random((3, 2)).astype(np.float16)
    m = quant.Int8Matrix(values, scales)
    assert m.group_size == 32
    np.testing.assert_array_equal(quant.dequantize(m), oracle_int8(values, scales))


def test_int4_refuses_an_input_dim_not_divisible_by_32():
    with pytest.raises(ValueError, match="divisible by 32"):
        quant.quantize(np.zeros((4, 48), np.float32), "int4")
    with pytest.raises(ValueError, match="unsupported quantization 'int3'"):
        quant.quantize(np.zeros((4, 32), np.float32), "int3")


def x_error(x: jax.Array, w: jax.Array, m: quant.QuantizedMatrix) -> float:
    """The most x's rounding to integers for the kernel's integer dots with matrix m
    (linear_cpu.x_step: runs of `columns` columns, integers of `bits` bits) can move x . w^T:
    per run of bfloat16 x, half its step (the run's largest magnitude / (2^(bits - 1) - 1))
    times the weights' magnitudes there."""
    columns, bits = linear_cpu.x_step(m)
    x = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    w = np.abs(np.asarray(w, np.float64))
    bound = np.zeros((x.shape[0], w.shape[0]))
    for k in range(0, x.shape[1], columns):
        half_step = np.abs(x[:, k : k + columns]).max(axis=1) / (2 ** (bits - 1) - 1) / 2
        bound += half_step[:, None] * w[:, k : k + columns].sum(axis=1)[None]
    return float(bound.max())


@pytest.mark.parametrize("fmt", quant.QUANTIZATIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_linear_on_quantized_equals_dequantized_matmul(fmt, dtype, rows):
    w = RNG.standard_normal((48, 64)).astype(np.float32)
    m = jax.tree.map(jnp.asarray, quant.quantize(w, fmt, dtype))
    x = jnp.asarray(RNG.standard_normal((rows, 64)), jnp.float32)
    b = jnp.asarray(RNG.standard_normal(48), jnp.float32)
    got = jax.jit(layers.linear)(x, m, b)
    dense = quant.dequantize(m)  # in dtype
    assert dense.dtype == jnp.dtype(dtype)
    want, atol, x_rounding = layers.linear(x, dense, b), 1e-5, 0.0
    if linear_cpu.integer_dots(m) and linear_cpu.takes(x, m):
        # The CPU kernel multiplies x in bfloat16 by the exact int4 / int8 weights (not rounded
        # to bfloat16: a kernel that rounds them is ~1e-2 off here), x's bfloat16 values taken
        # to integers per run of columns (`x_error`).
        dense = quant.dequantize(m, "float32")
        want = layers.linear(x.astype(jnp.bfloat16).astype(jnp.float32), dense, b)
        x_rounding = x_error(x, dense, m)
        atol = 4e-5 + x_rounding
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=atol)
    # And against a float64 numpy product of the dequantized weights (dtype's rounding of x).
    x64 = np.asarray(x.astype(dtype).astype(jnp.float32), np.float64)
    ref = x64 @ np.asarray(dense.astype(jnp.float32), np.float64).T + np.asarray(b)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4 + x_rounding)


@pytest.mark.parametrize("fmt", quant.QUANTIZATIONS)
def test_embedding_rows_of_a_quantized_table_gather_then_dequantize(fmt):
    table = RNG.standard_normal((50, 64)).astype(np.float32)
    m = jax.tree.map(jnp.asarray, quant.quantize(table, fmt))
    ids = jnp.asarray([3, 0, 49, 3], jnp.int32)
    got = jax.jit(layers.embed_rows)(m, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(quant.dequantize(m))[ids])


def test_quantized_matrices_stack_and_split_as_layers():
    from ksana_jax.config import ModelConfig
    from ksana_jax.models import registry

    cfg = ModelConfig("llama", 10, 64, 64, 3, 1, 1, 8)
    w = RNG.standard_normal((3, 8, 64)).astype(np.float32)
    flat = {"embed": np.zeros((10, 64), np.float32), "layers.wq": quant.quantize(w, "int4")}
    params = registry.params_from_flat(flat, cfg)
    assert len(params["layers"]) == 3 and params["layers"][1]["wq"].shape == (8, 64)
    np.testing.assert_array_equal(
        quant.dequantize(params["layers"][1]["wq"]), quant.dequantize(quant.quantize(w[1], "int4"))
    )
    again = registry.params_to_flat(params, cfg)["layers.wq"]
    np.testing.assert_array_equal(again.packed, flat["layers.wq"].packed)

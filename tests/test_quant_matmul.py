"""The int4 Pallas matmuls (pallas_kernels/quant_matmul.py) against the jnp oracle:
quant.dequantize, then a float32 dot. Run in Pallas's interpreter on this CPU; the
compiles for real TPUs and GPUs are benchmarks/quant_matmul_compile.py's (and
tests/test_gpu_aot.py's when the CUDA plugin is there)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksana_jax import quant
from ksana_jax.models import layers
from ksana_jax.pallas_kernels import linear_cpu, quant_matmul

# (M rows, O outputs, I inputs): one row, rows not a multiple of any tile, output tails
# (70, 130 against 64 / 256 blocks), inputs with a tail against the GPU's 128-input steps
# (96, 352) and several TPU chunks (2,560: 1,280 packed columns, 512 a chunk).
GPU_SHAPES = [(1, 70, 96), (5, 130, 352), (33, 64, 256), (17, 200, 2560)]
TPU_SHAPES = [(1, 70, 256), (5, 130, 512), (33, 300, 2560), (260, 64, 256)]
DTYPES = ["float32", "bfloat16"]


def case(m, o, i, dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = quant.quantize(rng.standard_normal((o, i)).astype(np.float32), "int4", dtype)
    w = jax.tree.map(jnp.asarray, w)
    x = jnp.asarray(rng.standard_normal((m, i)), dtype)
    # The oracle: the weight as the model's dtype holds it, x in that dtype, exact products.
    wf = quant.dequantize(w).astype(jnp.float32)
    want = jnp.dot(x.astype(jnp.float32), wf.T, precision="highest")
    return x, w, want


def close(got, want):
    assert got.shape == want.shape and got.dtype == jnp.float32
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5 * scale, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_kernel_equals_dequantize_then_dot(shape, dtype):
    x, w, want = case(*shape, dtype)
    close(quant_matmul.matmul_gpu(x, w, interpret=True), want)


@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_kernel_splits_the_input_dim(splits):
    """Programs sharing an output tile over uneven slices of the input dim (20 steps of 64
    packed columns in 3 splits: 7, 7, 6) sum to the whole product."""
    x, w, want = case(2, 40, 2560, "float32", seed=3)
    close(quant_matmul.matmul_gpu(x, w, splits=splits, interpret=True), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TPU_SHAPES)
def test_tpu_kernel_equals_dequantize_then_dot(shape, dtype):
    x, w, want = case(*shape, dtype)
    close(quant_matmul.matmul_tpu(x, w, interpret=True), want)


def test_kernels_see_every_nibble_scale_and_min():
    """One weight changed at a time (low and high nibble of one byte, a scale, a min)
    changes the product exactly where the oracle says, in both kernels."""
    x, w, _ = case(3, 64, 256, "float32", seed=1)
    changes = [
        dict(packed=w.packed.at[5, 17].set(w.packed[5, 17] ^ 0x0F)),
        dict(packed=w.packed.at[5, 17].set(w.packed[5, 17] ^ 0xF0)),
        dict(scales=w.scales.at[9, 3].multiply(2)),
        dict(mins=w.mins.at[40, 7].add(1)),
    ]
    for change in changes:
        changed = w.__class__(**{**quant.to_arrays(w), **change}, dtype=w.dtype)
        want = jnp.dot(x, quant.dequantize(changed).T, precision="highest")
        close(quant_matmul.matmul_gpu(x, changed, interpret=True), want)
        close(quant_matmul.matmul_tpu(x, changed, interpret=True), want)


def test_split_x_matches_the_nibble_order():
    """x_lo . lo^T + x_hi . hi^T is x . q^T for q unpacked by quant.unpack_int4."""
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (8, 2, 32), dtype=np.uint8)
    packed = quant.pack_int4(q)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x_lo, x_hi = (np.asarray(a) for a in quant_matmul.split_x(jnp.asarray(x)))
    got = x_lo @ (packed & 0xF).T.astype(np.float32) + x_hi @ (packed >> 4).T.astype(np.float32)
    np.testing.assert_allclose(got, x @ q.reshape(8, 64).T.astype(np.float32), rtol=1e-5)


def test_linear_dispatches_int4_to_the_kernel_on_gpu_and_tpu_only():
    x, w, _ = case(4, 64, 256, "bfloat16")
    assert quant_matmul.supports("tpu", x, w) and quant_matmul.supports("gpu", x, w)
    assert not quant_matmul.supports("cpu", x, w)
    assert not quant_matmul.supports("tpu", x[:, :96], quant.quantize(np.ones((8, 96)), "int4"))
    assert not quant_matmul.supports("gpu", x, quant.quantize(np.ones((64, 256)), "int8"))
    # Under tensor parallelism XLA's path (a Pallas call would gather the sharded matrix).
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("model",))):
        assert not quant_matmul.supports("gpu", x, w)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("model",))):
        assert quant_matmul.supports("gpu", x, w)
    # On this CPU, linear keeps its path (the C++ kernel or XLA) and agrees with the kernels;
    # the C++ kernel multiplies the exact int4 weights (the kernels here their bfloat16
    # rounding), so it is held to the oracle of those.
    got = layers.linear(x, w)
    if linear_cpu.takes(x, w):
        exact = quant.dequantize(w, "float32")
        close(got, jnp.dot(x.astype(jnp.float32), exact.T, precision="highest"))
    else:
        close(got, quant_matmul.matmul_gpu(x, w, interpret=True))

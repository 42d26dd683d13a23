"""The int4 Pallas matmuls (pallas_kernels/quant_matmul.py) against the jnp oracle:
quant.dequantize, then a float32 dot. Run in Pallas's interpreter on this CPU; the
compiles for real TPUs and GPUs are benchmarks/quant_matmul_compile.py's (and
tests/test_gpu_aot.py's when the CUDA plugin is there)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import integer_x, run_on_cpu_devices, write_tiny_hf

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
    # Under tensor parallelism only a matrix that knows its split (else XLA's path: a Pallas
    # call would gather the sharded matrix); the TPU kernel wants 256 inputs per device.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("model",))):
        assert not quant_matmul.supports("gpu", x, w)
        splits = ((("model",), ()), ((), ("model",)))
        column, row = (dataclasses.replace(w, split=split) for split in splits)
        assert quant_matmul.supports("gpu", x, column) and quant_matmul.supports("tpu", x, column)
        assert quant_matmul.supports("gpu", x, row) and not quant_matmul.supports("tpu", x, row)
        other_axis = dataclasses.replace(w, split=(("data",), ()))
        assert not quant_matmul.supports("gpu", x, other_axis)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("model",))):
        assert quant_matmul.supports("gpu", x, w)
    # On this CPU, linear keeps its path (the C++ kernel or XLA) and agrees with the kernels;
    # the C++ kernel multiplies the exact int4 weights (the kernels here their bfloat16
    # rounding) by x as its integer dots take it, so it is held to the oracle of those.
    got = layers.linear(x, w)
    if linear_cpu.takes(x, w):
        exact = quant.dequantize(w, "float32")
        x32 = x.astype(jnp.float32)
        x_int = jnp.asarray(integer_x(x32, w)) if linear_cpu.integer_dots(w) else x32
        want = jnp.dot(x_int, exact.T, precision="highest")
        mins = jnp.repeat(w.mins.astype(jnp.float32), 32, axis=1)  # they multiply x's own sums
        close(got, want + jnp.dot(x32 - x_int, mins.T, precision="highest"))
    else:
        close(got, quant_matmul.matmul_gpu(x, w, interpret=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_scaled_product_equals_dequantize_then_dot(dtype):
    """int8 with one scale per output channel as linear multiplies it on GPU and TPU,
    (x . values^T) * scales, against the oracle with the exact (float32) dequantized
    weight: the values are exact in bfloat16 and the scale is applied in float32, so it
    matches at float32 tolerance in both dtypes."""
    rng = np.random.default_rng(4)
    w = quant.quantize(rng.standard_normal((70, 352)).astype(np.float32), "int8", dtype)
    w = jax.tree.map(jnp.asarray, w)
    x = jnp.asarray(rng.standard_normal((5, 352)), jnp.float32)
    want = jnp.dot(
        x.astype(dtype).astype(jnp.float32), quant.dequantize(w, "float32").T, precision="highest"
    )
    close(quant.scaled_product(x, w), want)


TP_SCRIPT = """
import json, sys
import jax, numpy as np
import ksana_jax
from ksana_jax import quant
from ksana_jax.models import registry
from ksana_jax.pallas_kernels import quant_matmul

def matrices(model):  # per layer (one device holds them stacked: registry.stack_layers)
    leaves = jax.tree.leaves(registry.unstack(model.params), is_leaf=quant.is_quantized)
    return [m for m in leaves if isinstance(m, quant.Int4Matrix)]

def product(x, w, platform):
    return jax.jit(lambda x, w: quant_matmul.matmul(x, w, platform, interpret=True))(x, w)

one = matrices(ksana_jax.load(sys.argv[1], quantization="int4"))
rng = np.random.default_rng(0)
result = []
for tp in (2, 4):
    model = ksana_jax.load(sys.argv[1], tensor_parallel_size=tp, quantization="int4")
    for platform in ("gpu", "tpu"):
        seen = set()  # one column-parallel, one row-parallel and one replicated matrix each
        for w1, w in zip(one, matrices(model), strict=True):
            x = rng.standard_normal((5, w.shape[1])).astype(np.float32)
            kind = w.split and tuple(map(bool, w.split))
            with model.plan.activate():
                if kind in seen or not quant_matmul.supports(platform, x, w):
                    continue
                seen.add(kind)
                got = np.asarray(product(x, w, platform))
            want = np.asarray(product(x, w1, platform))
            error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            result.append([tp, platform, [list(a) for a in w.split], error])
print(json.dumps(result))
"""


def test_kernels_under_tensor_parallelism_equal_one_device(tmp_path):
    """tp=2 and 4 on forced CPU devices: every int4 matrix of a model placed by its plan
    runs in both kernels (Pallas's interpreter) on each device's shard under shard_map --
    column-parallel ones per output slice, row-parallel ones on their input slice with the
    partial products summed, replicated ones whole -- and equals the one-device kernel."""
    path = tmp_path / "hf"
    # Every input dim a multiple of 256 per device at tp=2 (and the MLP's at tp=4) so the
    # TPU kernel takes both splits too; heads split at both sizes; a vocabulary of 163
    # divides by neither, so the embedding and LM head are replicated.
    write_tiny_hf(
        path,
        vocab_size=163,
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=1,
    )
    result = run_on_cpu_devices(TP_SCRIPT, str(path))
    for tp, platform, split, error in result:
        assert error < 2e-5, (tp, platform, split, error)
    ran = {(tp, platform, bool(out), bool(inp)) for tp, platform, (out, inp), _ in result}
    kinds = ((True, False), (False, True), (False, False))  # column, row, replicated
    for tp in (2, 4):
        for platform in ("gpu", "tpu"):
            assert {(tp, platform, *kind) for kind in kinds} <= ran, ran

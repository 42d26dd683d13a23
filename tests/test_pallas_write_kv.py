"""The Pallas KV-write kernels, in interpret mode on CPU, and the cpu backend's one-layer write
(a C++ custom call) equal `reference.write_kv_pages` / `reference.write_layer_kv`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from ksana_jax.kv_cache import float_kv
from ksana_jax.pallas_kernels import (
    ragged_paged_attention_cpu,
    reference,
    write_kv_pages_gpu,
    write_kv_pages_tpu,
)

NUM_LAYERS, NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE, HEAD_DIM = 3, 2, 12, 16, 64
NUM_TOKENS = 24  # not a multiple of the GPU kernel's 16-token blocks

WRITERS = {
    "tpu": functools.partial(write_kv_pages_tpu.write_kv_pages, interpret=True),
    "tpu_semantics": functools.partial(
        write_kv_pages_tpu.write_kv_pages, interpret=pltpu.InterpretParams(detect_races=True)
    ),
    "gpu": functools.partial(write_kv_pages_gpu.write_kv_pages, interpret=True),
}


def make_write(dtype, seed=0):
    """A step's slots: a prefill chunk starting mid-page and crossing pages, decode tokens
    on shuffled pages, and padding tokens that all write the sink slot (identical rows, so
    any order of the duplicates gives the same result). Unwritten slots hold NaN."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((NUM_LAYERS, 2, NUM_KV_HEADS, NUM_PAGES, PAGE_SIZE, HEAD_DIM))
    kv[:, :, :, 7] = np.nan  # a page nobody writes keeps its NaN
    pages = rng.permutation(np.arange(1, NUM_PAGES))
    chunk = [pages[0] * PAGE_SIZE + 9 + i for i in range(14)]  # crosses into pages[1]
    chunk = [s if i < 7 else pages[1] * PAGE_SIZE + i - 7 for i, s in enumerate(chunk)]
    decode = [pages[2 + i] * PAGE_SIZE + int(rng.integers(PAGE_SIZE)) for i in range(6)]
    slots = np.array(chunk + decode + [0] * 4, np.int32)
    assert slots.shape == (NUM_TOKENS,)
    new_kv = rng.standard_normal((NUM_LAYERS, 2, NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM))
    new_kv[:, :, -4:] = new_kv[:, :, -1:]
    return float_kv(jnp.asarray(kv, dtype)), jnp.asarray(new_kv, dtype), jnp.asarray(slots)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_write_matches_reference(writer, dtype, capsys):
    kv, new_kv, slots = make_write(dtype)
    want = np.asarray(reference.write_kv_pages(kv, new_kv, slots).pages.astype(jnp.float32))
    got = np.asarray(WRITERS[writer](kv, new_kv, slots).pages.astype(jnp.float32))
    np.testing.assert_array_equal(got, want)  # NaN == NaN here: untouched slots stay NaN
    assert "RACE DETECTED" not in capsys.readouterr().out


@pytest.mark.parametrize("writer", ["tpu", "gpu"])
def test_write_under_a_donating_jit(writer):
    """How the engine calls it: the KV donated to the step; a second write sees the first."""
    kv, new_kv, slots = make_write(jnp.float32, seed=1)
    want = reference.write_kv_pages(kv, new_kv, slots)
    want = np.asarray(reference.write_kv_pages(want, -new_kv, slots[::-1]).pages)
    step = jax.jit(WRITERS[writer], donate_argnums=0)
    got = step(step(kv, new_kv, slots), -new_kv, slots[::-1])
    np.testing.assert_array_equal(np.asarray(got.pages), want)


def test_mixed_dtypes_are_cast_to_the_kv_dtype():
    kv, new_kv, slots = make_write(jnp.bfloat16)
    want = reference.write_kv_pages(kv, new_kv.astype(jnp.float32), slots)
    for writer in ("tpu", "gpu"):
        got = WRITERS[writer](kv, new_kv.astype(jnp.float32), slots)
        assert got.pages.dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(got.pages.astype(jnp.float32)), np.asarray(want.pages.astype(jnp.float32))
        )


LAYER_WRITERS = {
    "tpu": functools.partial(write_kv_pages_tpu.write_layer_kv, interpret=True),
    "gpu": functools.partial(write_kv_pages_gpu.write_layer_kv, interpret=True),
}
if ragged_paged_attention_cpu.available():
    LAYER_WRITERS["cpu"] = ragged_paged_attention_cpu.write_layer_kv


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("writer", sorted(LAYER_WRITERS))
def test_layer_write_matches_reference(writer, dtype):
    """One layer at a time, as the model writes before each layer's attention; the layer
    index is a Python int here and traced under jit (one compile for all layers)."""
    kv, new_kv, slots = make_write(dtype)
    k_new, v_new = new_kv[1, 0], new_kv[1, 1]
    want = reference.write_layer_kv(kv, 1, k_new, v_new, slots).pages.astype(jnp.float32)
    got = LAYER_WRITERS[writer](kv, 1, k_new, v_new, slots).pages.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    traced = jax.jit(LAYER_WRITERS[writer])(kv, jnp.int32(1), k_new, v_new, slots)
    np.testing.assert_array_equal(np.asarray(traced.pages.astype(jnp.float32)), np.asarray(want))


@pytest.mark.skipif("cpu" not in LAYER_WRITERS, reason="no C++ compiler")
def test_cpu_layer_write_in_place_under_a_donating_jit():
    """As the engine's step calls it: the KV donated, one row (the decode of one sequence) and
    then 24, a slot past the pages skipped as the reference's scatter drops it; the result
    is the donated buffer itself (no KV-sized copy)."""
    kv, new_kv, slots = make_write(jnp.bfloat16, seed=2)
    slots = slots.at[3].set(NUM_PAGES * PAGE_SIZE)  # out of range: dropped
    k_new, v_new = new_kv[2, 0], new_kv[2, 1]
    want = reference.write_layer_kv(kv, 2, k_new[:1], v_new[:1], slots[:1])
    want = reference.write_layer_kv(want, 0, -k_new, v_new, slots)
    step = jax.jit(ragged_paged_attention_cpu.write_layer_kv, donate_argnums=0)
    pointer = kv.pages.unsafe_buffer_pointer()
    got = step(kv, jnp.int32(2), k_new[:1], v_new[:1], slots[:1])
    got = step(got, jnp.int32(0), -k_new, v_new, slots)
    assert got.pages.unsafe_buffer_pointer() == pointer
    # Past the sink page: the reference's one-row write zeroes its slot 0 as well.
    np.testing.assert_array_equal(
        np.asarray(got.pages[:, :, :, 1:].astype(jnp.float32)),
        np.asarray(want.pages[:, :, :, 1:].astype(jnp.float32)),
    )


@pytest.mark.parametrize("writer", sorted(LAYER_WRITERS))
def test_layer_write_rejects_a_layer_out_of_range(writer):
    kv, new_kv, slots = make_write(jnp.float32)
    with pytest.raises(ValueError, match="layer_index=3 out of range for 3 layers"):
        LAYER_WRITERS[writer](kv, 3, new_kv[0, 0], new_kv[0, 1], slots)


@pytest.mark.parametrize("module", [write_kv_pages_tpu, write_kv_pages_gpu], ids=["tpu", "gpu"])
def test_write_rejects_bad_shapes(module):
    kv, new_kv, slots = make_write(jnp.float32)
    with pytest.raises(ValueError, match="new_kv must be"):
        module.write_kv_pages(kv, new_kv[:, :, :, :1], slots)
    with pytest.raises(ValueError, match="slot_ids must be"):
        module.write_kv_pages(kv, new_kv, slots[:-1])
    with pytest.raises(ValueError, match=r"kv\.pages must be"):
        module.write_kv_pages(float_kv(kv.pages[0]), new_kv, slots)


@pytest.mark.tpu
@pytest.mark.gpu
def test_compiled_write_on_device():
    platform = jax.default_backend()
    modules = {"tpu": write_kv_pages_tpu, "gpu": write_kv_pages_gpu}
    if platform not in modules:
        pytest.skip(f"needs a TPU or GPU, running on {platform}")
    for dtype in (jnp.float32, jnp.bfloat16):
        kv, new_kv, slots = make_write(dtype)
        want = reference.write_kv_pages(kv, new_kv, slots).pages.astype(jnp.float32)
        got = jax.jit(modules[platform].write_kv_pages, donate_argnums=0)(kv, new_kv, slots)
        np.testing.assert_array_equal(np.asarray(got.pages.astype(jnp.float32)), np.asarray(want))

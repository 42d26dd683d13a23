"""The `AttentionBackend` objects: what each backend says it supports, how "auto" resolves,
the functions each hands out, and `check` refusing what a backend cannot run (the engine
calls it when it is built, before anything compiles: test_backends.py checks that)."""

from __future__ import annotations

import typing
import warnings

import jax.numpy as jnp
import pytest

from ksana_jax import pallas_kernels
from ksana_jax.config import ATTENTION_BACKENDS, AttentionBackendName, EngineConfig
from ksana_jax.kv_cache import resolve_kv_dtype
from ksana_jax.pallas_kernels import (
    BACKENDS,
    AttentionBackend,
    get_backend,
    paged_attention_gpu,
    ragged_paged_attention_cpu,
    ragged_paged_attention_tpu,
    ragged_paged_attention_xla,
    reference,
    resolve_backend,
)
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec

KV_SHAPE = (2, 2, 2, 9, 16, 64)  # [L, 2, K, num_pages, page_size, H]


def test_one_list_of_backend_names():
    names = typing.get_args(AttentionBackendName)
    assert tuple(BACKENDS) == names
    assert ("auto", *names) == ATTENTION_BACKENDS
    assert all(BACKENDS[n].name == n and str(BACKENDS[n]) == n for n in names)
    assert pallas_kernels.PALLAS_BACKENDS == ("pallas_tpu", "pallas_gpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_capabilities():
    assert [n for n, b in BACKENDS.items() if b.loops_over_own_context] == ["cpu", "xla"]
    assert [n for n, b in BACKENDS.items() if b.interpret_on_cpu] == ["pallas_tpu", "pallas_gpu"]
    assert "float16" not in BACKENDS["pallas_tpu"].kv_dtypes
    for backend in BACKENDS.values():
        assert set(backend.features) == {"sliding_window", "logit_softcap"}
        hash(backend)  # a jit static argument if need be


def test_resolve_backend():
    assert resolve_backend("auto", "tpu") is BACKENDS["pallas_tpu"]
    assert resolve_backend("auto", "gpu").name == "pallas_gpu"
    assert resolve_backend("auto", "cuda").name == "pallas_gpu"
    assert resolve_backend("auto", "cpu").name == "cpu"  # the kernel builds here
    assert resolve_backend("pallas_gpu", "cpu").name == "pallas_gpu"  # interpreted
    with pytest.raises(ValueError, match=r"'cpu' runs on \('cpu',\); this is gpu"):
        resolve_backend("cpu", "gpu")
    with pytest.raises(ValueError, match="'pallas_tpu' runs on"):
        resolve_backend("pallas_tpu", "gpu")
    with pytest.raises(ValueError, match="not one of"):
        resolve_backend("flash", "cpu")
    with pytest.raises(ValueError, match="no attention backend for platform"):
        resolve_backend("auto", "metal")


def test_resolve_backend_on_gpus_xla_compiles_no_triton_for():
    """XLA compiles Triton only from compute capability 8.0 (Ampere): a T4 (7.5) gets the
    reference from "auto", and a clear error for an explicit pallas_gpu."""
    for capability in ("8.0", "8.9", "9.0", "10.0", None, "gfx90a"):
        assert resolve_backend("auto", "gpu", capability).name == "pallas_gpu"
        assert resolve_backend("pallas_gpu", "gpu", capability).name == "pallas_gpu"
    with pytest.warns(UserWarning, match=r"compute capability 7\.5.*using the reference"):
        assert resolve_backend("auto", "gpu", "7.5").name == "reference"
    with pytest.raises(ValueError, match=r"needs compute capability 8\.0.*this GPU has 7\.0"):
        resolve_backend("pallas_gpu", "cuda", "7.0")
    assert resolve_backend("reference", "gpu", "7.5").name == "reference"
    assert resolve_backend("auto", "tpu", "7.5").name == "pallas_tpu"  # means nothing there


def test_attention_and_writers():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = get_backend("reference")
        assert ref.attention() is reference.ragged_paged_attention
        assert ref.kv_writer() is reference.write_kv_pages
        assert ref.layer_kv_writer() is reference.write_layer_kv
        # The cpu and xla backends: their own attention, never a warning; the xla one the
        # reference's KV writes, the cpu one its own one-layer write.
        for name, module in (
            ("cpu", ragged_paged_attention_cpu),
            ("xla", ragged_paged_attention_xla),
        ):
            assert get_backend(name).attention() is module.ragged_paged_attention
            assert pallas_kernels.get_attention(name) is module.ragged_paged_attention
        assert get_backend("xla").kv_writer() is reference.write_kv_pages
        assert pallas_kernels.get_layer_kv_writer("xla") is reference.write_layer_kv
        cpu_writer = pallas_kernels.get_layer_kv_writer("cpu")
        assert cpu_writer.func is ragged_paged_attention_cpu.write_layer_kv
    for name, module in (
        ("pallas_tpu", ragged_paged_attention_tpu),
        ("pallas_gpu", paged_attention_gpu),
    ):
        backend = get_backend(name)
        with pytest.warns(UserWarning, match="interpret mode"):
            attention = pallas_kernels.get_attention(backend, interpret=True)
        assert attention.func is module.ragged_paged_attention
        assert attention.keywords == {"interpret": True}
        with pytest.warns(UserWarning, match="interpret mode"):
            writer = backend.kv_writer(interpret=True)
        assert writer.keywords == {"interpret": True}
        with pytest.warns(UserWarning, match="interpret mode"):
            layer_writer = pallas_kernels.get_layer_kv_writer(name, interpret=True)
        assert layer_writer.func.__name__ == "write_layer_kv"
        assert backend.interpreted_here()  # this is a CPU
    with pytest.raises(ValueError, match="resolve_backend"):
        pallas_kernels.get_attention("auto")


def test_check_accepts_what_each_backend_runs():
    specs = [AttentionSpec(0.1, sliding_window=4096, logit_softcap=50.0), AttentionSpec(0.1)]
    for backend in BACKENDS.values():
        backend.check(KV_SHAPE, jnp.bfloat16, specs=specs, num_heads=4, dtype="bfloat16")
        backend.check((1, 2, 8, 9, 16, 256), "float32", num_heads=16)  # Gemma-3-like heads


@pytest.mark.parametrize(
    "name,kv_shape,kv_dtype,num_heads,message",
    [
        ("pallas_tpu", KV_SHAPE, "float16", 4, "float16 cannot be read on TPU"),
        ("pallas_tpu", (2, 2, 2, 9, 12, 64), "bfloat16", 4, "page_size=12 must be a multiple"),
        ("pallas_gpu", (2, 2, 2, 9, 16, 80), "float32", 4, "head_dim=80 must be a power of two"),
        ("cpu", (2, 2, 2, 9, 16, 512), "float32", 4, "head_dim <= 256"),
        ("cpu", KV_SHAPE, "float32", 2 * 17, "<= 16 query heads per KV head"),
        ("pallas_tpu", KV_SHAPE, "int8", 4, "page_size=16 must be a multiple of 32 for a int8"),
        ("pallas_tpu", KV_SHAPE, "float8_e4m3fn", 4, "page_size=16 must be a multiple of 32"),
    ],
)
def test_check_refuses_with_the_field_named(name, kv_shape, kv_dtype, num_heads, message):
    with pytest.raises(ValueError, match=message):
        BACKENDS[name].check(kv_shape, kv_dtype, num_heads=num_heads)


def test_check_refuses_a_spec_feature_the_backend_lacks():
    partial = AttentionBackend(
        "xla",
        "ksana_jax.pallas_kernels.ragged_paged_attention_xla",
        None,
        ("cpu",),
        features=("logit_softcap",),
    )
    partial.check(KV_SHAPE, "float32", specs=[AttentionSpec(1.0, logit_softcap=30.0)])
    with pytest.raises(ValueError, match="does not support sliding_window"):
        partial.check(KV_SHAPE, "float32", specs=[AttentionSpec(1.0, sliding_window=8)])


def test_auto_kv_dtype_follows_the_backend():
    assert resolve_kv_dtype("auto", "bfloat16", "cpu") == "float16"
    assert resolve_kv_dtype("auto", "bfloat16", "cpu", BACKENDS["cpu"]) == "float16"
    assert resolve_kv_dtype("auto", "bfloat16", "cpu", BACKENDS["pallas_tpu"]) == "bfloat16"
    assert resolve_kv_dtype("auto", "bfloat16", "tpu", BACKENDS["pallas_tpu"]) == "bfloat16"
    assert resolve_kv_dtype("float32", "bfloat16", "cpu") == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_dtype("int4", "bfloat16", "cpu")

"""Attention kernels over the paged KV array, each beside its jnp oracle in reference.py.

Every attention backend has one signature (semantics: `reference.ragged_paged_attention`):

    attn(q [T, N, H], k_new [T, K, H], v_new [T, K, H], kv [L, 2, K, num_pages, page_size, H],
         layer_index i32[], page_table i32[S, P], seq_lens i32[S], query_starts i32[S+1],
         *, spec: AttentionSpec) -> f32[T, N, H]   (attention_spec.py: scale, window, soft-cap)

and the KV writers two (semantics: `reference.write_kv_pages`, `reference.write_layer_kv`):

    write(kv [L, 2, K, num_pages, page_size, H], new_kv [L, 2, T, K, H], slot_ids i32[T]) -> kv
    write_layer(kv, layer_index, k_new [T, K, H], v_new [T, K, H], slot_ids i32[T]) -> kv

Backends: "reference" (pure jnp, one gather of the whole context per token: the oracle),
"cpu" (ragged_paged_attention_cpu.py/.cc: a C++ XLA FFI kernel built at first use; the CPU
path; KV writes are the reference's), "xla" (ragged_paged_attention_xla.py: the oracle in jnp
grouped by sequence, a flash-style loop over the context; the CPU path where no C++
compiler is at hand; the reference's KV writes), "pallas_tpu"
(ragged_paged_attention_tpu.py, write_kv_pages_tpu.py: Mosaic), "pallas_gpu"
(paged_attention_gpu.py, write_kv_pages_gpu.py: Triton); attention_args.py checks the
arguments for every kernel. `resolve_backend("auto", platform)` picks the backend for the
platform. "cpu" and "xla" loop over each row's own context, so a wide page table costs them
nothing (`LOOPS_OVER_OWN_CONTEXT`). Kernel modules are imported on first use, so importing
this package (the model does, for the reference) does not import Pallas.

Under a context mesh (`ShardingPlan.activate`), the Pallas, cpu and xla attention and the
Pallas one-layer write run per device under `shard_map`, each on its own KV heads
(`sharding.shard_over_heads`): XLA cannot partition a kernel or a custom call, and the xla
backend's per-sequence loops partition badly. The reference is plain jnp, which GSPMD
partitions itself.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable

import jax

from ksana_jax.pallas_kernels import reference
from ksana_jax.sharding import shard_over_heads

BACKENDS = ("reference", "cpu", "xla", "pallas_tpu", "pallas_gpu")
AUTO_BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "cpu": "cpu"}
PALLAS_BACKENDS = ("pallas_tpu", "pallas_gpu")  # the ones that need interpret mode on CPU
LOOPS_OVER_OWN_CONTEXT = ("cpu", "xla")

_ATTENTION_MODULES = {
    "cpu": "ksana_jax.pallas_kernels.ragged_paged_attention_cpu",
    "xla": "ksana_jax.pallas_kernels.ragged_paged_attention_xla",
    "pallas_tpu": "ksana_jax.pallas_kernels.ragged_paged_attention_tpu",
    "pallas_gpu": "ksana_jax.pallas_kernels.paged_attention_gpu",
}
_WRITER_MODULES = {
    "pallas_tpu": "ksana_jax.pallas_kernels.write_kv_pages_tpu",
    "pallas_gpu": "ksana_jax.pallas_kernels.write_kv_pages_gpu",
}

AttentionFn = Callable[..., jax.Array]
KVWriteFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
LayerKVWriteFn = Callable[..., jax.Array]


def resolve_backend(backend: str, platform: str, compute_capability: str | None = None) -> str:
    """Concrete backend name: "auto" becomes the kernel for `platform` (tpu -> pallas_tpu,
    gpu/cuda -> pallas_gpu, cpu -> cpu, or xla with a warning when the cpu kernel cannot be
    built here); a concrete name is checked and returned.

    `compute_capability` is the GPU's (jax's `device.compute_capability`, e.g. "7.5"). XLA
    compiles Triton, and so the pallas_gpu kernels, only from Ampere (8.0) on: on an older
    CUDA GPU (a T4, Colab's commonest) "auto" is "reference" with a warning, and an explicit
    "pallas_gpu" is a ValueError rather than a compile error at the first step.
    """
    before_ampere = platform in ("gpu", "cuda") and _cuda_before_ampere(compute_capability)
    if backend == "auto":
        if platform not in AUTO_BACKEND:
            raise ValueError(
                f"no attention backend for platform {platform!r}; known: {sorted(AUTO_BACKEND)}"
            )
        backend = AUTO_BACKEND[platform]
        if backend == "cpu" and not _cpu_kernel().available():
            warnings.warn(
                "the cpu attention kernel could not be built (no C++ compiler? see "
                "ragged_paged_attention_cpu.py); using the slower xla backend",
                stacklevel=2,
            )
            return "xla"
        if backend == "pallas_gpu" and before_ampere:
            warnings.warn(
                f"this GPU has compute capability {compute_capability}; XLA compiles the "
                "pallas_gpu (Triton) kernels only from 8.0 (Ampere) on: using the reference "
                "attention backend",
                stacklevel=2,
            )
            return "reference"
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {('auto', *BACKENDS)}")
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"attention backend 'cpu' is an XLA:CPU custom call; this is {platform}")
    if backend == "pallas_gpu" and before_ampere:
        raise ValueError(
            f"attention backend 'pallas_gpu' needs compute capability 8.0 (Ampere) or newer: "
            f"XLA compiles Triton kernels only there, and this GPU has {compute_capability}; "
            "use 'reference' (or 'auto')"
        )
    return backend


def _cuda_before_ampere(compute_capability: str | None) -> bool:
    """True for an NVIDIA compute capability below 8.0 ("7.5"); False for None or anything
    that is not one (a ROCm "gfx90a")."""
    try:
        return int(str(compute_capability).split(".")[0]) < 8
    except ValueError:
        return False


def _cpu_kernel():
    return importlib.import_module(_ATTENTION_MODULES["cpu"])


def check_kv_layout(backend: str, shape: tuple[int, ...], dtype) -> None:
    """Raises ValueError naming the field if `backend`'s kernels cannot read a KV array of
    this shape [L, 2, K, num_pages, page_size, H] and dtype (Mosaic's tiling rules for
    pallas_tpu, a power-of-two head_dim for pallas_gpu) -- before anything compiles. The
    jnp backends read any layout."""
    if backend not in PALLAS_BACKENDS:
        return
    module = importlib.import_module(_ATTENTION_MODULES[backend])
    num_layers, _, num_kv_heads, num_pages, page_size, head_dim = shape
    try:
        module.kv_layout(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            num_pages=num_pages,
            page_size=page_size,
            head_dim=head_dim,
            dtype=dtype,
        )
    except ValueError as e:
        raise ValueError(f"attention_backend={backend!r} cannot run this model: {e}") from None


def _kernel_module(backend: str, modules: dict[str, str], interpret: bool):
    if backend not in BACKENDS:
        raise ValueError(
            f"attention backend {backend!r} is not one of {BACKENDS} "
            '("auto" is resolved first, with resolve_backend(backend, platform))'
        )
    if backend not in modules:  # the reference, or the cpu and xla backends' KV writers
        return None
    if interpret and backend in PALLAS_BACKENDS:
        warnings.warn(
            f"attention backend {backend!r} runs in Pallas interpret mode: for testing only, "
            "far slower than the reference backend",
            stacklevel=3,
        )
    return importlib.import_module(modules[backend])


def get_attention(backend: str, interpret: bool = False) -> AttentionFn:
    """The attention function of `backend` ("reference" | "cpu" | "xla" | "pallas_tpu" |
    "pallas_gpu"); `interpret=True` runs a Pallas kernel on CPU (tests only; it warns)."""
    module = _kernel_module(backend, _ATTENTION_MODULES, interpret)
    if module is None:
        return reference.ragged_paged_attention
    kernel = module.ragged_paged_attention
    if backend in PALLAS_BACKENDS:
        kernel = functools.partial(kernel, interpret=interpret)
    return shard_over_heads(kernel, "attention")


def get_kv_writer(backend: str, interpret: bool = False) -> KVWriteFn:
    """The KV write of `backend` (same names as get_attention); the Pallas ones alias the KV
    array to their output, so under a donating jit they update it in place."""
    module = _kernel_module(backend, _WRITER_MODULES, interpret)
    if module is None:
        return reference.write_kv_pages
    return functools.partial(module.write_kv_pages, interpret=interpret)


def get_layer_kv_writer(backend: str, interpret: bool = False) -> LayerKVWriteFn:
    """The one-layer KV write of `backend` (`reference.write_layer_kv`'s signature); the
    Pallas ones alias the KV array to their output, like get_kv_writer's."""
    module = _kernel_module(backend, _WRITER_MODULES, interpret)
    if module is None:
        return reference.write_layer_kv
    kernel = functools.partial(module.write_layer_kv, interpret=interpret)
    return shard_over_heads(kernel, "write_layer")

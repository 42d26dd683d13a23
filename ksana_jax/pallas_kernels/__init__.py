"""Attention kernels over the paged KV array, each beside its jnp oracle in reference.py, and
the `AttentionBackend` objects that say what each set of kernels supports.

Every attention backend has one signature (semantics: `reference.ragged_paged_attention`):

    attn(q [T, N, H], k_new [T, K, H], v_new [T, K, H], kv [L, 2, K, num_pages, page_size, H],
         layer_index i32[], page_table i32[S, P], seq_lens i32[S], query_starts i32[S+1],
         *, spec: AttentionSpec) -> f32[T, N, H]   (attention_spec.py: scale, window, soft-cap)

and the KV writers two (semantics: `reference.write_kv_pages`, `reference.write_layer_kv`):

    write(kv [L, 2, K, num_pages, page_size, H], new_kv [L, 2, T, K, H], slot_ids i32[T]) -> kv
    write_layer(kv, layer_index, k_new [T, K, H], v_new [T, K, H], slot_ids i32[T]) -> kv

A layer's rotary, write and attention together have one more (semantics:
`reference.attend_layer`, the composition of the two above):

    attend_layer(qkv [T, K, N/K + 2, H], kv, layer_index, cos [T, H/2], sin [T, H/2],
                 slot_ids, page_table, seq_lens, query_starts, *, spec) -> (f32[T, N, H], kv)

Backends (`BACKENDS`, keyed by config.AttentionBackendName, the one list of their names):
"reference" (pure jnp, one gather of the whole context per token: the oracle), "cpu"
(ragged_paged_attention_cpu.py/.cc: a C++ XLA FFI kernel built at first use; the CPU path;
with float pages a layer's rotary, KV write and attention are one call, quantized pages and
the every-layer write take the reference's write), "xla" (ragged_paged_attention_xla.py: the
oracle in jnp grouped by sequence, a flash-style loop over the context; the CPU path where
no C++ compiler is at hand; the reference's KV writes), "pallas_tpu"
(ragged_paged_attention_tpu.py, write_kv_pages_tpu.py: Mosaic), "pallas_gpu"
(paged_attention_gpu.py, write_kv_pages_gpu.py: Triton); attention_args.py checks the
arguments for every kernel. Every backend implements every AttentionSpec feature (sliding
window, logit soft-cap), and with a window the kernels skip KV pages wholly before it.

An `AttentionBackend` states what it supports -- platforms, parameter and KV dtypes, spec
features, the KV layouts its kernels read, whether it runs on CPU only in Pallas's
interpreter, whether it loops over each row's own context (so a wide page table costs it
nothing) -- and `check` refuses anything else when the engine is built, before anything
compiles. `resolve_backend("auto", platform)` picks the backend for the platform. The jitted
step takes a backend by name (a static argument) and looks the object up with
`get_backend`. Kernel modules are imported on first use, so importing this package (the
model does, for the reference) does not import Pallas.

Under a context mesh (`ShardingPlan.activate`), the Pallas, cpu and xla attention and the
Pallas one-layer write run per device under `shard_map`, each on its own KV heads
(`sharding.shard_over_heads`): XLA cannot partition a kernel or a custom call, and the xla
backend's per-sequence loops partition badly. The reference is plain jnp, which GSPMD
partitions itself.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
import warnings
from collections.abc import Callable, Iterable

import jax
import numpy as np

from ksana_jax.config import KV_CACHE_QUANTIZED, SUPPORTED_DTYPES, AttentionBackendName
from ksana_jax.pallas_kernels import reference
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec, refuse_unsupported
from ksana_jax.sharding import shard_over_heads

AttentionFn = Callable[..., jax.Array]
KVWriteFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
LayerKVWriteFn = Callable[..., jax.Array]
LayerAttentionFn = Callable[..., tuple[jax.Array, typing.Any]]

# KV page dtypes by their numpy names (kv_cache.resolve_kv_dtype's results).
_FLOAT_KV_DTYPES = ("float32", "bfloat16", "float16")
_CONCRETE_KV_DTYPES = (*_FLOAT_KV_DTYPES, *dict.fromkeys(KV_CACHE_QUANTIZED.values()))
# What every backend implements today (AttentionSpec.features() names a spec's).
_WINDOW_AND_SOFTCAP = ("sliding_window", "logit_softcap")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One set of attention kernels and what it supports (frozen: hashable).

    `check` refuses a model, KV array or platform it cannot run, naming the field, when the
    engine is built; `attention`, `kv_writer` and `layer_kv_writer` give its functions.
    """

    name: AttentionBackendName
    attention_module: str | None  # module with ragged_paged_attention; None: the reference
    writer_module: str | None  # module with write_kv_pages / write_layer_kv; None: reference's
    platforms: tuple[str, ...]  # jax platforms it compiles for
    kv_dtypes: tuple[str, ...] = _CONCRETE_KV_DTYPES  # KV array dtypes its kernels read
    dtypes: tuple[str, ...] = SUPPORTED_DTYPES  # parameter (query) dtypes
    features: tuple[str, ...] = _WINDOW_AND_SOFTCAP  # AttentionSpec features it implements
    # A Pallas kernel: on CPU only Pallas's interpreter runs it (tests only: it warns).
    interpret_on_cpu: bool = False
    # Loops over each row's own context: a wide page table (context bucket) costs nothing.
    loops_over_own_context: bool = False
    # Its layer attention reads each sequence's pages from the persistent batch's page table
    # in place (StepInputs.page_rows), so a step gathers no [S, P] table from it.
    reads_page_rows: bool = False
    min_cuda_capability: int | None = None  # major CUDA compute capability it needs
    # KV dtypes that need a newer CUDA GPU than the rest: (dtype, "major.minor") pairs.
    kv_dtype_min_cuda_capability: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.name

    def _module(self, module: str | None, interpret: bool):
        if module is None:
            return None
        if interpret and self.interpret_on_cpu:
            warnings.warn(
                f"attention backend {self.name!r} runs in Pallas interpret mode: for testing "
                "only, far slower than the reference backend",
                stacklevel=4,
            )
        return importlib.import_module(module)

    def interpreted_here(self) -> bool:
        """Whether its kernels must run in Pallas's interpreter on jax's default platform."""
        return self.interpret_on_cpu and jax.default_backend() == "cpu"

    def attention(self, interpret: bool = False) -> AttentionFn:
        """The attention function; `interpret=True` runs a Pallas kernel on CPU."""
        module = self._module(self.attention_module, interpret)
        if module is None:
            return reference.ragged_paged_attention
        kernel = module.ragged_paged_attention
        if self.interpret_on_cpu:
            kernel = functools.partial(kernel, interpret=interpret)
        return shard_over_heads(kernel, "attention")

    def kv_writer(self, interpret: bool = False) -> KVWriteFn:
        """The every-layer KV write; the Pallas ones alias the KV array to their output, so
        under a donating jit they update it in place."""
        module = self._module(self.writer_module, interpret)
        if module is None:
            return reference.write_kv_pages
        return functools.partial(module.write_kv_pages, interpret=interpret)

    def layer_kv_writer(self, interpret: bool = False) -> LayerKVWriteFn:
        """The one-layer KV write (`reference.write_layer_kv`'s signature)."""
        module = self._module(self.writer_module, interpret)
        if module is None:
            return reference.write_layer_kv
        kernel = functools.partial(module.write_layer_kv, interpret=interpret)
        return shard_over_heads(kernel, "write_layer")

    def layer_attention(self, interpret: bool = False) -> LayerAttentionFn:
        """A layer's rotary, KV write and attention (`reference.attend_layer`'s signature):
        the attention module's own `attend_layer` where it has one, else the reference's
        composition of this backend's one-layer writer and attention."""
        module = self._module(self.attention_module, interpret)
        if module is not None and hasattr(module, "attend_layer"):
            return shard_over_heads(module.attend_layer, "attend_layer")
        return functools.partial(
            reference.attend_layer,
            write=self.layer_kv_writer(interpret),
            attention=self.attention(interpret),
        )

    def check(
        self,
        kv_shape: tuple[int, ...],
        kv_dtype,
        *,
        specs: Iterable[AttentionSpec] = (),
        num_heads: int | None = None,
        dtype=None,
        compute_capability: str | None = None,
    ) -> None:
        """Raises ValueError naming what this backend cannot run -- the KV dtype (also one
        a CUDA GPU of `compute_capability` cannot convert, fp8 before 8.9), the KV
        layout [L, 2, K, num_pages, page_size, H] (Mosaic's tiling rules for pallas_tpu, a
        power-of-two head_dim for pallas_gpu), the cpu kernel's head limits for `num_heads`
        query heads, a feature of one of the layers' attention `specs`, or the parameter
        `dtype` -- before anything compiles."""
        for spec in dict.fromkeys(specs):
            refuse_unsupported(spec, self.name, self.features)
        if dtype is not None and np.dtype(dtype).name not in self.dtypes:
            raise ValueError(
                f"attention_backend={self.name!r} takes dtype {self.dtypes}, got {dtype}"
            )
        kv_name = np.dtype(kv_dtype).name
        if kv_name not in _FLOAT_KV_DTYPES:  # a quantized KV first, then the kernels' reasons
            self._check_kv_dtype(kv_name)
        self._check_kernel_layout(kv_shape, kv_dtype, num_heads)
        self._check_kv_dtype(kv_name)
        needed = dict(self.kv_dtype_min_cuda_capability).get(kv_name)
        if needed and compute_capability and _capability(compute_capability) < _capability(needed):
            raise ValueError(
                f"attention_backend={self.name!r} reads a {kv_name} KV cache only on compute "
                f"capability {needed} or newer (Triton converts it there); this GPU has "
                f"{compute_capability}: choose another kv_cache_dtype"
            )

    def _check_kv_dtype(self, kv_name: str) -> None:
        if kv_name not in self.kv_dtypes:
            aliases = [k for k, v in KV_CACHE_QUANTIZED.items() if v == kv_name]
            asked = f"kv_cache_dtype={aliases[0]!r} ({kv_name})" if aliases else kv_name
            raise ValueError(
                f"attention_backend={self.name!r} cannot read a {asked} KV cache; "
                f"kv_cache_dtype may be one of {self.kv_dtypes}"
            )

    def _check_kernel_layout(self, kv_shape, kv_dtype, num_heads) -> None:
        """The kernel module's own checks: `kv_layout` (the KV layout it reads) and
        `check_heads`, where it defines them."""
        if self.attention_module is None:
            return
        module = importlib.import_module(self.attention_module)
        num_layers, _, num_kv_heads, num_pages, page_size, head_dim = kv_shape
        try:
            if hasattr(module, "kv_layout"):
                module.kv_layout(
                    num_layers=num_layers,
                    num_kv_heads=num_kv_heads,
                    num_pages=num_pages,
                    page_size=page_size,
                    head_dim=head_dim,
                    dtype=kv_dtype,
                )
            if num_heads is not None and hasattr(module, "check_heads"):
                module.check_heads(num_heads, num_kv_heads, head_dim)
        except ValueError as e:
            raise ValueError(
                f"attention_backend={self.name!r} cannot run this model: {e}"
            ) from None

    def check_platform(self, platform: str, compute_capability: str | None = None) -> None:
        """Raises ValueError if this backend cannot compile for `platform` (a Pallas backend
        on "cpu" runs interpreted, for tests) or for a CUDA GPU of `compute_capability`."""
        allowed = self.platforms + (("cpu",) if self.interpret_on_cpu else ())
        if platform not in allowed:
            raise ValueError(
                f"attention backend {self.name!r} runs on {self.platforms}; this is {platform}"
            )
        major = _cuda_major(compute_capability) if platform in ("gpu", "cuda") else None
        needed = self.min_cuda_capability
        if needed is not None and major is not None and major < needed:
            raise ValueError(
                f"attention backend {self.name!r} needs compute capability {needed}.0 or "
                f"newer: XLA compiles Triton kernels only there, and this GPU has "
                f"{compute_capability}; use 'reference' (or 'auto')"
            )


_KERNELS = "ksana_jax.pallas_kernels."
_ALL_PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")
BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend("reference", None, None, _ALL_PLATFORMS),
        AttentionBackend(
            "cpu",
            _KERNELS + "ragged_paged_attention_cpu",
            _KERNELS + "ragged_paged_attention_cpu",
            ("cpu",),
            loops_over_own_context=True,
            reads_page_rows=True,
        ),
        AttentionBackend(
            "xla",
            _KERNELS + "ragged_paged_attention_xla",
            None,
            _ALL_PLATFORMS,
            loops_over_own_context=True,
        ),
        AttentionBackend(
            "pallas_tpu",
            _KERNELS + "ragged_paged_attention_tpu",
            _KERNELS + "write_kv_pages_tpu",
            ("tpu",),
            # Mosaic loads no float16 vectors; int8 / fp8 pages: page_size a multiple of 32
            kv_dtypes=("float32", "bfloat16", *dict.fromkeys(KV_CACHE_QUANTIZED.values())),
            interpret_on_cpu=True,
        ),
        AttentionBackend(
            "pallas_gpu",
            _KERNELS + "paged_attention_gpu",
            _KERNELS + "write_kv_pages_gpu",
            ("gpu", "cuda", "rocm"),
            kv_dtypes=_CONCRETE_KV_DTYPES,
            interpret_on_cpu=True,
            min_cuda_capability=8,  # XLA compiles Triton from Ampere on
            kv_dtype_min_cuda_capability=(("float8_e4m3fn", "8.9"),),  # Ada, Hopper on
        ),
    )
}
assert tuple(BACKENDS) == typing.get_args(AttentionBackendName)
AUTO_BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "cpu": "cpu"}
# Derived, for callers that test a name: the backends that need interpret mode on CPU.
PALLAS_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.interpret_on_cpu)


def get_backend(backend: str | AttentionBackend) -> AttentionBackend:
    """The backend object of a concrete name ("auto" is resolved first, by resolve_backend)."""
    if isinstance(backend, AttentionBackend):
        return backend
    if backend not in BACKENDS:
        raise ValueError(
            f"attention backend {backend!r} is not one of {tuple(BACKENDS)} "
            '("auto" is resolved first, with resolve_backend(backend, platform))'
        )
    return BACKENDS[backend]


def resolve_backend(
    backend: str, platform: str, compute_capability: str | None = None
) -> AttentionBackend:
    """The backend for a configured name: "auto" becomes the kernel for `platform` (tpu ->
    pallas_tpu, gpu/cuda -> pallas_gpu, cpu -> cpu, or xla with a warning when the cpu kernel
    cannot be built here); a concrete name is checked against the platform and returned.

    `compute_capability` is the GPU's (jax's `device.compute_capability`, e.g. "7.5"). XLA
    compiles Triton, and so the pallas_gpu kernels, only from Ampere (8.0) on: on an older
    CUDA GPU (a T4, Colab's commonest) "auto" is "reference" with a warning, and an explicit
    "pallas_gpu" is a ValueError rather than a compile error at the first step.
    """
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of {('auto', *BACKENDS)}")
        BACKENDS[backend].check_platform(platform, compute_capability)
        return BACKENDS[backend]
    if platform not in AUTO_BACKEND:
        raise ValueError(
            f"no attention backend for platform {platform!r}; known: {sorted(AUTO_BACKEND)}"
        )
    chosen = BACKENDS[AUTO_BACKEND[platform]]
    if chosen.name == "cpu" and not importlib.import_module(chosen.attention_module).available():
        warnings.warn(
            "the cpu attention kernel could not be built (no C++ compiler? see "
            "ragged_paged_attention_cpu.py); using the slower xla backend",
            stacklevel=2,
        )
        return BACKENDS["xla"]
    try:
        chosen.check_platform(platform, compute_capability)
    except ValueError:
        warnings.warn(
            f"this GPU has compute capability {compute_capability}; XLA compiles the "
            "pallas_gpu (Triton) kernels only from 8.0 (Ampere) on: using the reference "
            "attention backend",
            stacklevel=2,
        )
        return BACKENDS["reference"]
    return chosen


def _capability(compute_capability: str) -> tuple[int, ...]:
    """ "8.9" -> (8, 9); anything not a CUDA capability (a ROCm "gfx90a") -> (99,), which no
    requirement refuses."""
    try:
        return tuple(int(part) for part in str(compute_capability).split("."))
    except ValueError:
        return (99,)


def _cuda_major(compute_capability: str | None) -> int | None:
    """The major version of an NVIDIA compute capability ("7.5" -> 7); None for None or
    anything that is not one (a ROCm "gfx90a")."""
    try:
        return int(str(compute_capability).split(".")[0])
    except ValueError:
        return None


# The call shapes models use: by backend name (or object).
def get_attention(backend: str | AttentionBackend, interpret: bool = False) -> AttentionFn:
    """`get_backend(backend).attention(interpret)`."""
    return get_backend(backend).attention(interpret)


def get_kv_writer(backend: str | AttentionBackend, interpret: bool = False) -> KVWriteFn:
    """`get_backend(backend).kv_writer(interpret)`."""
    return get_backend(backend).kv_writer(interpret)


def get_layer_kv_writer(backend: str | AttentionBackend, interpret: bool = False) -> LayerKVWriteFn:
    """`get_backend(backend).layer_kv_writer(interpret)`."""
    return get_backend(backend).layer_kv_writer(interpret)

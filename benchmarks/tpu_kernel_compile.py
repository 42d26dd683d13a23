"""The Pallas TPU kernels compiled by Mosaic for real TPU generations, on a machine without one.

`jax.export` (tests/test_pallas_export.py) runs the Pallas-to-Mosaic lowering and its
block-shape rules; Mosaic's own compiler (vector layouts, tiling of every op) runs only in
libtpu. With libtpu installed, jax compiles ahead of time for a TPU topology it only
describes (`jax.experimental.topologies`), so this compiles the attention kernel and the
two KV writes at SmolLM2, Llama-3-8B-like and Gemma-3-4B-like shapes (the last with its
1024-token sliding window and a logit soft-cap) in bfloat16 and float32 for each TPU
generation, and prints which compile and how long each took. A kernel that fails here
(`Mosaic failed to compile TPU kernel: ...`) would fail on the TPU. Nothing runs.
`--engine-step` also compiles the whole SmolLM2 engine step and counts its whole-KV copies,
with the KV in the TPU's default layout and pinned row-major (as the runner holds it), and
reports its memory per chip and collectives. `--engine-model qwen3_30b_a3b` compiles that
model's step instead (abstract weights, aot_engine_step.MODEL_SHAPES) at each of
`--engine-placements` over the topology's chips (e.g. 8,8ep: tensor-parallel over 8 chips,
without and with expert parallelism), `--engine-model llama3_8b --quantization int4` an
int4 Llama-3-8B's, with the HBM left for KV beside it and the whole dequantized matrices
it materialises; a step that needs more HBM than a chip has fails to compile and is
reported as such.

libtpu must match jax (jax 0.10.2: libtpu 0.0.42.*). Install it beside, not into, the
project's environment (with libtpu importable, every jax process looks for a TPU first):

    pip install --no-deps --target /tmp/libtpu "libtpu==0.0.42.*"
    PYTHONPATH=/tmp/libtpu TPU_WORKER_HOSTNAMES=localhost \\
        python benchmarks/tpu_kernel_compile.py [--topologies v4:2x2x1,v5e:2x2,v5p:2x2x1,v6e:2x2]
        [--engine-step [--engine-model qwen3_30b_a3b --engine-placements 8,8ep]
        [--engine-model llama3_8b --quantization int4]] [--no-kernels]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from aot_engine_step import (
    add_engine_model_arguments,
    describe_report,
    engine_models,
    lower_decode_step,
    memory_report,
    placed,
    step_report,
)
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ksana_jax.kv_cache import KVCacheSpec, abstract_kv, float_kv_shapes
from ksana_jax.pallas_kernels import ragged_paged_attention_tpu, write_kv_pages_tpu
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec

# (name, layers, query heads, KV heads, head dim), as tests/test_pallas_export.py.
MODELS = [("smollm2", 30, 9, 3, 64), ("llama3_8b", 32, 32, 8, 128), ("gemma3_4b", 34, 8, 4, 256)]
# What attention compiles with beyond the scale: Gemma 3's local layers' window, and Gemma 2's
# attention soft-cap (both features compiled in one kernel).
FEATURES = {"gemma3_4b": dict(sliding_window=1024, logit_softcap=50.0)}
PAGE_SIZE, NUM_PAGES, PAGES_PER_SEQ = 16, 512, 64  # contexts up to 1024
QUANTIZED_PAGE_SIZE = 32  # Mosaic's (32, 128) tile of 8-bit arrays (contexts up to 2048)
# (parameter dtype, KV dtype): float KV in the parameters' dtype, and bf16 with int8 / fp8 KV.
DTYPES = [
    (jnp.bfloat16, None),
    (jnp.float32, None),
    (jnp.bfloat16, "int8"),
    (jnp.bfloat16, "float8_e4m3fn"),
]
# (T tokens, S rows): a mixed bucket (8 tokens a row: 8-token query blocks) and a decode
# bucket (one token a row: the smallest query blocks).
BUCKETS = {"mixed": (128, 16), "decode": (64, 64)}


def kernels(num_layers, num_heads, num_kv_heads, head_dim, dtype, features=None, kv_dtype=None):
    """(name, jitted function, argument shapes) of each TPU kernel at these shapes; attention
    with `features` (AttentionSpec fields: window, soft-cap) if given. `kv_dtype` int8 /
    float8_e4m3fn: quantized pages of QUANTIZED_PAGE_SIZE rows with their scales, queries and
    new K/V in `dtype`; None: float pages of `dtype` (queries in float32)."""
    sds = jax.ShapeDtypeStruct
    if kv_dtype is None:
        shape = (num_layers, 2, num_kv_heads, NUM_PAGES, PAGE_SIZE, head_dim)
        kv, q_dtype = float_kv_shapes(sds(shape, dtype)), jnp.float32
    else:
        spec = KVCacheSpec(
            num_layers, num_kv_heads, NUM_PAGES, QUANTIZED_PAGE_SIZE, head_dim, kv_dtype
        )
        kv, q_dtype = abstract_kv(spec), dtype
    i32 = jnp.int32
    spec = AttentionSpec(head_dim**-0.5, **(features or {}))
    attention = jax.jit(
        functools.partial(ragged_paged_attention_tpu.ragged_paged_attention, spec=spec)
    )
    found = []
    for bucket, (num_tokens, num_seqs) in BUCKETS.items():
        new = sds((num_tokens, num_kv_heads, head_dim), dtype)
        attention_args = (
            sds((num_tokens, num_heads, head_dim), q_dtype),
            new,
            new,
            kv,
            sds((), i32),
            sds((num_seqs, PAGES_PER_SEQ), i32),
            sds((num_seqs,), i32),
            sds((num_seqs + 1,), i32),
        )
        found.append((f"attention/{bucket}", attention, attention_args))
    num_tokens = BUCKETS["mixed"][0]
    new = sds((num_tokens, num_kv_heads, head_dim), dtype)
    all_layers = sds((num_layers, 2, num_tokens, num_kv_heads, head_dim), dtype)
    slots = sds((num_tokens,), i32)
    return [
        *found,
        (
            "write_kv_pages",
            jax.jit(write_kv_pages_tpu.write_kv_pages, donate_argnums=0),
            (kv, all_layers, slots),
        ),
        (
            "write_layer_kv",
            jax.jit(write_kv_pages_tpu.write_layer_kv, donate_argnums=0),
            (kv, sds((), i32), new, new, slots),
        ),
    ]


def one_chip(topology: str) -> NamedSharding:
    """A sharding onto the first chip of a TPU topology that is only described."""
    devices = topologies.get_topology_desc(topology, "tpu").devices
    return NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())


def compile_for(topology: str, fn, shapes) -> float:
    """Seconds to compile `fn` for one chip of `topology` (raises what Mosaic raises)."""
    shapes = placed(list(shapes), one_chip(topology))
    start = time.perf_counter()
    fn.lower(*shapes).compile()
    return time.perf_counter() - start


# One chip's HBM by device kind (data sheets).
HBM_BYTES = {"TPU v4": 32e9, "TPU v5 lite": 16e9, "TPU v5": 95e9, "TPU v6 lite": 32e9}


def engine_step_report(model, sharding, pinned: bool, device_kind: str) -> str:
    """Compiles the whole engine step (pallas_tpu, a 32-row decode bucket) with every argument
    on `sharding` (one chip) or, None, as the model's plan places it over the topology's
    chips; says how many KV-sized copies it makes, its memory per chip against the chip's
    HBM (`device_kind`'s), collectives and dequantized matrices (or why it did not
    compile). `pinned`: the KV argument and result in row-major format, as the runner holds
    them on a TPU."""
    lowered, kv = lower_decode_step(model, "pallas_tpu", "tpu", sharding, pinned=pinned)
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # e.g. more HBM than a chip has: report it, go on
        return f"FAILED: {str(e).splitlines()[0][:300]}"
    seconds = time.perf_counter() - start
    record = step_report(compiled, kv, model)
    return (
        f"compiled in {seconds:.1f} s; {record['kv_copies']} whole-KV copies (KV "
        f"{record['kv_bytes'] / 1e6:.0f} MB); {describe_report(record)}\n    "
        + memory_report(record, HBM_BYTES.get(device_kind, float("nan")))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topologies", default="v4:2x2x1,v5e:2x2,v5p:2x2x1,v6e:2x2")
    parser.add_argument(
        "--engine-step",
        action="store_true",
        help="also compile the whole engine step (--engine-model; for SmolLM2 with the KV "
        "layout pinned and not), count its whole-KV copies, memory and collectives",
    )
    add_engine_model_arguments(parser, "the topology's chips")
    parser.add_argument(
        "--kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the attention and KV-write kernels (--no-kernels: the engine step only)",
    )
    args = parser.parse_args()
    try:
        one_chip(args.topologies.split(",")[0])
    except RuntimeError:  # "JAX TPU support not installed": no libtpu to describe a TPU with
        raise SystemExit(
            "no libtpu: install it beside the venv and put it on PYTHONPATH, as this script's "
            "docstring says"
        ) from None
    failures = 0
    if args.kernels:
        print(f"{'topology':10s} {'model':10s} {'dtype[/KV dtype]':22s} {'kernel':17s} result")
    for topology in args.topologies.split(",") if args.kernels else ():
        for name, *shape in MODELS:
            for dtype, kv_dtype in DTYPES:  # float16: refused, see kv_layout
                features = FEATURES.get(name)
                for kernel, fn, shapes in kernels(*shape, dtype, features, kv_dtype):
                    try:
                        result = f"compiled in {compile_for(topology, fn, shapes):.1f} s"
                    except Exception as e:  # report every kernel, then fail at the end
                        failures += 1
                        result = f"FAILED: {str(e).splitlines()[0][:160]}"
                    dtype_name = jnp.dtype(dtype).name + (f"/{kv_dtype}" if kv_dtype else "")
                    print(f"{topology:10s} {name:10s} {dtype_name:22s} {kernel:17s} {result}")
    if args.engine_step:
        for topology in args.topologies.split(","):
            devices = topologies.get_topology_desc(topology, "tpu").devices
            for label, model, sharding in engine_models(
                args.engine_model, args.engine_placements, devices, args.quantization
            ):
                for pinned in (False, True) if args.engine_model == "smollm2" else (True,):
                    layout = "KV pinned row-major" if pinned else "KV in default layout"
                    report = engine_step_report(model, sharding, pinned, devices[0].device_kind)
                    print(f"{topology:10s} {label} engine step, {layout}: {report}")
    if failures:
        raise SystemExit(f"{failures} kernel(s) failed to compile")


if __name__ == "__main__":
    main()

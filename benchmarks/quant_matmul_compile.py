"""The quantized products compiled for GPUs and TPUs that are only described, at Llama-3-8B's
matrix shapes, on a machine without either: the int4 matmul kernels
(ksana_jax/pallas_kernels/quant_matmul.py) and XLA's int8 products.

For each target, format (`--formats`), matrix ([I -> O]: the MLP's up/gate and down
projections, attention's query/output and key/value projections, the LM head) and row count
(decode's 1 and 32 rows, a 256-row prefill chunk) it compiles the product with bfloat16 x
and prints whether it compiled, and:
  - GPU (XLA:GPU with jaxlib's Triton, as gpu_aot_compile.py): the kernel's grid, shared
    memory per program, registers and spills (with a ptxas at hand), programs per SM;
  - TPU (libtpu's Mosaic, as tpu_kernel_compile.py): the least scoped VMEM limit the
    kernel compiles under (whole MiB, by bisection; v5e's default limit is 16 MiB), then
    the compile under the default limit;
  - both: the temporaries of the whole compiled function, and how many buffers of the
    compiled HLO (outside fusions) have the dequantized matrix's shape (bf16[O, I]): 0
    means no dequantized weight is materialised; the temporaries stay far below one
    dequantized matrix (O * I * 2 bytes).

    # GPUs: the CUDA plugin beside the venv (gpu_aot_compile.py's docstring)
    PYTHONPATH=.venv/gpu-aot python benchmarks/quant_matmul_compile.py --gpus l4,h200
    # TPUs: libtpu beside the venv (tpu_kernel_compile.py's docstring)
    PYTHONPATH=/tmp/libtpu TPU_WORKER_HOSTNAMES=localhost \\
        python benchmarks/quant_matmul_compile.py --topologies v5e:2x2
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin's check would fail here

import argparse
import dataclasses
import functools
import itertools
import json
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
from aot_engine_step import placed, unfused_weight_copies

from ksana_jax import quant
from ksana_jax.models import layers
from ksana_jax.pallas_kernels import quant_matmul

# Llama-3-8B's matrices, [inputs, outputs].
MATRICES = {
    "up/gate": (4096, 14336),
    "down": (14336, 4096),
    "q/o": (4096, 4096),
    "k/v": (4096, 1024),
    "lm_head": (4096, 128256),
}
ROWS = (1, 32, 256)


FORMATS = ("int4", "int8", "int8-dequantize", "q8_0")


def shapes(inputs: int, outputs: int, rows: int, fmt: str = "int4") -> list:
    """x bf16[rows, I] and a quantized w [O, I] computing in bfloat16, as ShapeDtypeStructs."""
    w = quant.abstract("int4" if fmt == "int4" else "int8", (outputs, inputs), "bfloat16")
    if fmt == "q8_0":
        groups = jax.ShapeDtypeStruct((outputs, inputs // quant.GROUP_SIZE), jnp.float16)
        w = dataclasses.replace(w, scales=groups)
    return [jax.ShapeDtypeStruct((rows, inputs), jnp.bfloat16), w]


def xla_product(fmt: str, platform: str):
    """The jitted int8 product of `fmt` as the engine traces it on `platform`."""

    def dequantize_then_dot(x, w):
        w = quant.dequantize(w)
        return jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    fn = dequantize_then_dot if fmt == "int8-dequantize" else layers.linear

    def traced(x, w):
        default_backend = jax.default_backend
        jax.default_backend = lambda: platform  # linear picks its path by the platform
        try:
            return fn(x, w)
        finally:
            jax.default_backend = default_backend

    return jax.jit(traced)


def product(fmt: str, platform: str):
    if fmt == "int4":
        return quant_matmul.matmul_gpu if platform == "gpu" else quant_matmul.matmul_tpu
    return xla_product(fmt, platform)


def weight_buffers(executable, w) -> dict:
    """The compiled function's temporaries, and its buffers holding w dequantized."""
    hlo = executable.as_text()
    return {
        "temp_bytes": executable.memory_analysis().temp_size_in_bytes,
        "dequantized_bytes": w.shape[0] * w.shape[1] * 2,
        "dequantized_buffers": unfused_weight_copies(hlo, types.SimpleNamespace(params=[w])),
    }


def gpu_record(gpu: str, args: list, ptxas, fmt: str = "int4") -> dict:
    import gpu_aot_compile

    fn = product(fmt, "gpu")
    record = gpu_aot_compile.kernel_record(gpu, fn, args, ptxas)
    if record["compiled"]:
        placed_args = placed(args, gpu_aot_compile.gpu_sharding(gpu))
        executable = fn.lower(*placed_args).compile()
        record.update(weight_buffers(executable, args[1]))
    return record


def compiles_under(args: list, vmem_limit_bytes: int) -> bool:
    fn = functools.partial(quant_matmul.matmul_tpu, vmem_limit_bytes=vmem_limit_bytes)
    try:
        jax.jit(fn).lower(*args).compile()
    except Exception as e:
        if "CompileTimeScopedVmemOom" in str(e):
            return False
        raise
    return True


def tpu_record(topology: str, args: list, fmt: str = "int4") -> dict:
    from tpu_kernel_compile import one_chip

    placed_args = placed(args, one_chip(topology))
    start = time.perf_counter()
    try:
        executable = product(fmt, "tpu").lower(*placed_args).compile()
    except Exception as e:  # report every shape, then fail at the end
        return {"compiled": False, "error": str(e).splitlines()[0][:300]}
    record = dict(compiled=True, seconds=round(time.perf_counter() - start, 1))
    if fmt != "int4":  # no kernel: XLA's own product
        record.update(weight_buffers(executable, args[1]))
        return record
    # The least scoped VMEM (whole MiB, up to 64) the kernel compiles under, by bisection.
    low, high = 0, 64
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compiles_under(placed_args, middle << 20) else (middle, high)
    record["vmem_mib"] = high
    record.update(weight_buffers(executable, args[1]))
    return record


def describe(record: dict) -> str:
    row = (
        f"{record['target']:8s} {record['format']:15s} {record['matrix']:8s} "
        f"{record['shape']:14s} {record['rows']:>4d} "
    )
    if not record["compiled"]:
        return row + f"FAILED: {record['error']}"
    row += (
        f"{record['temp_bytes'] / 1e6:8.2f} {record['dequantized_bytes'] / 1e6:8.1f} "
        f"{record['dequantized_buffers']:>5d}  "
    )
    if "vmem_mib" in record:
        return row + f"least VMEM limit it compiles under: {record['vmem_mib']} MiB"
    if record["format"] != "int4":
        launches = f"{record['launches']} kernel launches" if "launches" in record else ""
        return row + f"XLA's product {launches}"
    (kernel,) = record["kernels"]
    return row + (
        f"grid {kernel['grid']}, {kernel['warps']} warps, shared {kernel['shared_bytes'] // 1024}"
        f" KB, {kernel.get('registers', '?')} registers, {kernel.get('spill_bytes', '?')} B "
        f"spilled, {kernel.get('per_sm', '?')} per SM"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default="", help="e.g. l4,h200 (gpu_aot_compile.GPUS)")
    parser.add_argument("--topologies", default="", help="e.g. v5e:2x2")
    parser.add_argument("--formats", default="int4", help=f"of {','.join(FORMATS)}")
    parser.add_argument("--matrices", default=",".join(MATRICES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--json", help="also write every record to this file")
    args = parser.parse_args()
    if not (args.gpus or args.topologies):
        parser.error("name --gpus and/or --topologies")
    targets = [("gpu", g) for g in args.gpus.split(",") if g]
    targets += [("tpu", t) for t in args.topologies.split(",") if t]
    ptxas = None
    if args.gpus:
        import gpu_aot_compile

        ptxas = gpu_aot_compile.find_ptxas()
    print(
        f"{'target':8s} {'format':15s} {'matrix':8s} {'I -> O':14s} {'rows':>4s} {'temp MB':>8s} "
        f"{'deq. MB':>8s} {'deq. buffers':>5s}  kernel"
    )
    records, failures = [], 0
    for (platform, target), fmt, name, rows in itertools.product(
        targets, args.formats.split(","), args.matrices.split(","), map(int, args.rows.split(","))
    ):
        inputs, outputs = MATRICES[name]
        fn_args = shapes(inputs, outputs, rows, fmt)
        if platform == "gpu":
            record = gpu_record(target, fn_args, ptxas, fmt)
        else:
            record = tpu_record(target, fn_args, fmt)
        record.update(
            target=target, format=fmt, matrix=name, shape=f"{inputs} -> {outputs}", rows=rows
        )
        failures += not record["compiled"]
        print(describe(record), flush=True)
        records.append(record)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1, default=str))
    if failures:
        raise SystemExit(f"{failures} compile(s) failed")


if __name__ == "__main__":
    main()

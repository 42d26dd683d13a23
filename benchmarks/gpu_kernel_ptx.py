"""The Pallas GPU attention kernel as the GPU would get it, inspected on a machine without one.

For each model and workload of benchmarks/attention.py (the device-sized rows), this lowers
`paged_attention_gpu` to Triton IR through jax, compiles that IR with the `triton` package
to PTX for a target architecture (sm_90a, an H100/H200, by default), runs `ptxas -v`, and
prints per launch config (num_warps, num_stages):
  - registers per thread and spill bytes (spills go through local memory: slow);
  - shared memory per program (with registers, how many programs fit an SM);
  - the `cp.async.wait_group N` values: a loop whose wait is 0 waits for every copy it
    issued before it computes, so its loads are not overlapped; N > 0 keeps the next
    block's copies in flight.
No GPU is needed. jaxlib compiles its own (bundled) Triton version on a real GPU, so
these are close to, not the same as, what runs there: a structural check to pick the
configs worth timing (`benchmarks/attention_sweep.py`), not a measurement.

    pip install triton   # any recent version; not a dependency of ksana-jax
    python benchmarks/gpu_kernel_ptx.py [--model llama3_8b,smollm2] [--workloads decode,prefill]
        [--launch 4x2,4x3,8x2] [--arch 90]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from attention import MODELS, PAGE_SIZE, WORKLOADS

from ksana_jax.pallas_kernels import paged_attention_gpu


def batch_shapes(rows, num_heads: int, num_kv_heads: int, head_dim: int, dtype):
    """Shapes of benchmarks/attention.py's batch for `rows` [(cached, new)]; no data."""
    sds = jax.ShapeDtypeStruct
    pages = [-(-(c + n) // PAGE_SIZE) for c, n in rows]
    num_tokens, num_seqs = sum(n for _, n in rows), len(rows)
    return (
        sds((num_tokens, num_heads, head_dim), jnp.float32),
        sds((num_tokens, num_kv_heads, head_dim), dtype),
        sds((num_tokens, num_kv_heads, head_dim), dtype),
        sds((1, 2, num_kv_heads, 1 + sum(pages), PAGE_SIZE, head_dim), dtype),
        sds((), jnp.int32),
        sds((num_seqs, max(pages)), jnp.int32),
        sds((num_seqs,), jnp.int32),
        sds((num_seqs + 1,), jnp.int32),
    )


@contextlib.contextmanager
def _captured_triton_modules():
    """Collects the text of every Triton module jax lowers meanwhile (a jax-internal hook:
    the Pallas Triton lowering serializes the module into the custom call, as bytecode)."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules: list[str] = []

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield modules
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


def triton_ir(shapes, **tuning) -> str:
    """The kernel's Triton IR (text) for a batch of `shapes`, lowered for CUDA on this host."""
    head_dim = shapes[0].shape[-1]
    attention = functools.partial(
        paged_attention_gpu.ragged_paged_attention, sm_scale=head_dim**-0.5, **tuning
    )
    check = jax.export.DisabledSafetyCheck.custom_call(paged_attention_gpu.TRITON_CUSTOM_CALL)
    with _captured_triton_modules() as modules:
        jax.export.export(jax.jit(attention), platforms=["cuda"], disabled_checks=[check])(*shapes)
    (module,) = modules
    return module


def wait_groups(ptx: str) -> dict[int, int]:
    """How often each `cp.async.wait_group N` occurs in the PTX."""
    return dict(
        collections.Counter(int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx))
    )


def compile_report(ttir: str, num_warps: int, num_stages: int, arch: int = 90) -> dict:
    """Registers, spills, shared memory and copy waits of `ttir` compiled for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        kernel = triton.compile(
            path,
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(kernel.asm["ptx"])
        gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        log = _ptxas(ptx_path, gpu_name)
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return {
        "registers": registers,
        "spill_bytes": spills,
        "shared_bytes": int(kernel.metadata.shared),
        "wait_groups": wait_groups(kernel.asm["ptx"]),
    }


def _ptxas(ptx_path: str, gpu_name: str) -> str:
    """`ptxas -v` output from the first ptxas bundled with triton that accepts the PTX."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    errors = []
    for name in sorted(n for n in os.listdir(bin_dir) if n.startswith("ptxas")):
        proc = subprocess.run(
            [os.path.join(bin_dir, name), "-v", "--gpu-name", gpu_name, ptx_path, "-o", os.devnull],
            capture_output=True,
            text=True,
        )
        if proc.returncode == 0:
            return proc.stderr + proc.stdout
        errors.append(f"{name}: {proc.stderr.strip()[-200:]}")
    raise RuntimeError("no bundled ptxas accepted the PTX: " + "; ".join(errors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3_8b,smollm2")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--workloads", default="decode,long_decode,prefill,mixed")
    parser.add_argument("--launch", default="default,4x2,4x3,4x4,8x2,8x3")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()

    dtype = jnp.dtype(args.dtype)
    print(
        f"sm_{args.arch}, KV {dtype.name}, page {PAGE_SIZE}; block_q, block_k and key splits as"
        " the kernel picks them (resolve_tuning)"
    )
    print(
        f"{'model':10s} {'workload':12s} {'warps x stages':>14s} {'regs':>5s} {'spill B':>8s} "
        f"{'shared KB':>9s}  cp.async waits (N: count)"
    )
    for model in args.model.split(","):
        num_heads, num_kv_heads, head_dim = MODELS[model]
        for workload in args.workloads.split(","):
            rows = WORKLOADS[workload]["device"]
            shapes = batch_shapes(rows, num_heads, num_kv_heads, head_dim, dtype)
            tuning = paged_attention_gpu.resolve_tuning(
                shapes[0].shape, shapes[3].shape, dtype, shapes[5].shape
            )
            for launch in args.launch.split(","):
                if launch == "default":
                    warps, stages = tuning.num_warps, tuning.num_stages
                    label = f"{warps}x{stages} (dflt)"
                else:
                    warps, stages = (int(x) for x in launch.split("x"))
                    label = launch
                ttir = triton_ir(shapes, num_warps=warps, num_stages=stages)
                report = compile_report(ttir, warps, stages, args.arch)
                waits = ", ".join(f"{n}: {c}" for n, c in sorted(report["wait_groups"].items()))
                print(
                    f"{model:10s} {workload:12s} {label:>14s} {report['registers']:5d} "
                    f"{report['spill_bytes']:8d} {report['shared_bytes'] / 1024:9.1f}  {waits}"
                )


if __name__ == "__main__":
    main()
